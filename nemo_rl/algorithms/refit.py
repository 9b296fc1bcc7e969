"""Refit: the policy's weights into every vLLM worker at one weight version, proven by a probe.

Contract of `refit_to(policy, workers, weights_dir, version, probe, context=...)`, the one refit the
loop's step (version = the step) and resume (version = the checkpoint's) both run:
- the policy exports its weights to `weights_dir` (a folder every worker reads: `grpo.refit_dir`),
  every worker loads them as `version` and reports the version it now serves;
- any other reported version raises a `GRPOError` of kind `stale_weights` ("<context> but the
  workers report versions [...]"), before anything is probed;
- the probe sequence is then scored by the first engine and by the trainer: the returned `Refit`
  holds both, so callers prove the engine serves the new weights (their own metrics).
Blocking (bounded Ray calls): call it off the event loop. Folder cleanup is the caller's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from nemo_rl.algorithms.errors import GRPOError


class RefitPolicy(Protocol):
    """The policy worker's side of a refit (`RayPolicyClient`)."""

    def export_weights(self, out_dir: str | Path) -> Path: ...

    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]: ...


class RefitWorkers(Protocol):
    """The generation workers' side of a refit (`WorkerGroup`)."""

    def update_weights(self, weights_dir: Path, version: int) -> list[int]: ...

    def prompt_logprobs(self, token_ids: list[int]) -> list[list[float]]: ...


@dataclass(frozen=True)
class Refit:
    """A finished refit: the version every worker serves, and the probe scored by engine and trainer."""

    version: int
    engine_probe: tuple[float, ...]
    trainer_probe: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.engine_probe) != len(self.trainer_probe) or not self.engine_probe:
            raise ValueError(
                f"engine and trainer scored probes of lengths {len(self.engine_probe)} and "
                f"{len(self.trainer_probe)}: need equal, non-zero lengths"
            )

    @property
    def engine_trainer_max_abs_diff(self) -> float:
        return max_abs_diff(self.engine_probe, self.trainer_probe)


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"max_abs_diff of sequences of lengths {len(a)} and {len(b)}: need equal, non-zero lengths")
    return max(abs(x - y) for x, y in zip(a, b))


def refit_to(
    policy: RefitPolicy, workers: RefitWorkers, weights_dir: Path, version: int, probe: list[int], *, context: str
) -> Refit:
    """Export, load into every worker as `version`, check the versions, score the probe (see the contract)."""
    out_dir = policy.export_weights(weights_dir)
    versions = workers.update_weights(out_dir, version)
    if set(versions) != {version}:
        raise GRPOError(f"{context} but the workers report versions {versions}", kind="stale_weights")
    engine_probe = workers.prompt_logprobs(probe)[0]
    trainer_probe = policy.get_logprobs([probe])[0]
    return Refit(version, tuple(engine_probe), tuple(trainer_probe))
