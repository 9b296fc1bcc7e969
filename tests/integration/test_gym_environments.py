"""Gym's shipped environments through the main loop on the real stack (capture on, tiny CPU model).

Each recipe names a Gym resources server by package (`env.gym.resources_server`) and reads the
package's own `data/example.jsonl` at run time. The tiny model does not solve these tasks (its
rewards are 0), so no reward is asserted here: a range check on all-zero rewards proves nothing.
The contract checked is the pipeline's: every dispatched rollout is accounted for (kept or
placeholder), some rollouts are kept as verified rows, the prompts are the package's and the
Gym server started is the package's. Kept small for CI: 1 prompt x 2 generations per step.
Gym's own `simple_agent_with_compaction`, as shipped (it sends `required_prefix_token_ids: null`
on every call), runs one step through our capture gate: every rollout is kept, none fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
GENERATIONS = 2


def _run(recipe: str, log_dir: Path, steps: int = STEPS, extra: tuple[str, ...] = ()) -> tuple[list[dict], str]:
    proc = subprocess.run(
        [sys.executable, "examples/run_grpo_single_controller.py", "--config", f"examples/configs/{recipe}.yaml",
         f"grpo.max_num_steps={steps}", "grpo.num_prompts_per_step=1",
         f"grpo.num_generations_per_prompt={GENERATIONS}", f"logger.log_dir={log_dir}", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()], proc.stdout


@pytest.mark.integration
@pytest.mark.parametrize(
    "recipe,server",
    [
        ("grpo_gym_example_multi_step", "example_multi_step"),
        ("grpo_gym_example_single_tool_call", "example_single_tool_call"),
    ],
)
def test_gym_environment_runs_through_the_loop(tmp_path: Path, recipe: str, server: str) -> None:
    lines, stdout = _run(recipe, tmp_path / recipe)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        assert m["rollouts/dispatched"] == GENERATIONS
        assert m["rollouts/dispatched"] == m["finalize/kept_rollouts"] + m["finalize/placeholders"]
    assert sum(m["finalize/kept_rollouts"] for m in lines) >= 1
    assert sum(m["finalize/rows"] for m in lines) >= 1
    # The prompts came from the installed package's example rows, and Gym's server was the one started.
    assert f"resources_servers/{server}/data/example.jsonl" in stdout
    assert list((tmp_path / recipe).glob(f"gym_{server}*.log"))


@pytest.mark.integration
def test_gyms_compaction_agent_as_shipped_keeps_exact_rollouts(tmp_path: Path) -> None:
    log_dir = tmp_path / "compaction"
    lines, _ = _run("grpo_gym_example_single_tool_call", log_dir, steps=1,
                    extra=("env.agent=simple_agent_with_compaction",))
    assert [m["step"] for m in lines] == [1]
    (m,) = lines
    # Before the gate accepted the field, both were run_failed placeholders (HTTP 400 from Gym's request model).
    assert m["rollouts/dispatched"] == GENERATIONS == m["finalize/kept_rollouts"]
    assert m["finalize/placeholders"] == 0 and "finalize/placeholders/run_failed" not in m
    # Rows exist only once verify_and_linearize matched them to the worker's staged ids (exact by construction).
    assert m["finalize/rows"] >= GENERATIONS and m["finalize/calls_per_rollout"] >= 1
    assert m["finalize/served_generated_tokens"] > 0 and m["finalize/kept_generated_token_fraction"] == 1.0
    agent_log = (log_dir / "gym_example_single_tool_call_agent.log").read_text(errors="replace")
    assert " -m responses_api_agents.simple_agent_with_compaction.app\n" in agent_log
