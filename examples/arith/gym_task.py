"""The arithmetic task as the library's Gym task (`env.task: examples.arith.gym_task:TASK`).

Contract:
- `TASK` implements `nemo_rl.environments.task.GymTask`: `rows(seed, count, sampling)` is
  `build_row(p, sampling)` for each of `make_problems(seed, count)`, and `resources_server` is
  `RESOURCES_SERVER`, our `arith_resources` instance (package `arith`, launched as
  `python -m examples.arith.resources`) with the agent instance `arith_agent` wired to it.
- The names (`arith_resources`, `arith_agent`) are the Gym global config's keys, so they also
  name the servers' log files (`gym_<name>.log`) and liveness probes.
- `CHAINED_TASK` (`env.task: examples.arith.gym_task:CHAINED_TASK`) is the long-tail variant:
  `build_chain_row` for each of `make_chains(seed, count, spec)` (k calculator calls per prompt,
  see `examples.arith.chain`), served by `examples.arith.chain_resources` (`arith_chain_resources`,
  agent `arith_chain_agent`). `TASK` is unchanged by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from examples.arith.chain import ChainSpec, build_chain_row, make_chains
from examples.arith.rows import build_row
from examples.arith.task import make_problems
from nemo_rl.environments.nemo_gym_launch import ResourcesServer
from nemo_rl.environments.task import RowSampling

RESOURCES_MODULE = "examples.arith.resources"
RESOURCES_SERVER = ResourcesServer(
    name="arith_resources",
    package="arith",
    module=RESOURCES_MODULE,
    # Gym's config model requires `entrypoint`; the launcher starts servers by module, so it is only a label.
    block={"entrypoint": "arith_resources.py", "domain": "math"},
    agent_name="arith_agent",
)


@dataclass(frozen=True)
class ArithGymTask:
    """Generated arithmetic problems as Gym `/run` rows, served by `examples.arith.resources`."""

    resources_server: ResourcesServer = field(default=RESOURCES_SERVER)

    def rows(self, seed: int, count: int, sampling: RowSampling) -> list[dict[str, Any]]:
        return [build_row(problem, sampling) for problem in make_problems(seed, count)]


TASK = ArithGymTask()


CHAIN_RESOURCES_MODULE = "examples.arith.chain_resources"
CHAIN_RESOURCES_SERVER = ResourcesServer(
    name="arith_chain_resources",
    package="arith_chain",
    module=CHAIN_RESOURCES_MODULE,
    block={"entrypoint": "chain_resources.py", "domain": "math"},
    agent_name="arith_chain_agent",
)


@dataclass(frozen=True)
class ChainedArithGymTask:
    """Chained arithmetic problems (k calculator calls each, k drawn from `spec`) as Gym `/run` rows."""

    spec: ChainSpec = field(default_factory=ChainSpec)
    resources_server: ResourcesServer = field(default=CHAIN_RESOURCES_SERVER)

    def rows(self, seed: int, count: int, sampling: RowSampling) -> list[dict[str, Any]]:
        return [build_chain_row(chain, sampling) for chain in make_chains(seed, count, self.spec)]


CHAINED_TASK = ChainedArithGymTask()
