"""PolicyWorkerHandle: what the training loop calls on a policy, local or remote.

Implemented by `PolicyCore` (in-process, tests) and `RayPolicyClient` (a Ray actor behind
per-call deadlines). Every method is synchronous and raises a named `PolicyError` on failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy.loss import LossFn


@runtime_checkable
class PolicyWorkerHandle(Protocol):
    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Per sequence, the logprob of each token given its prefix (position 0: 0.0)."""
        ...

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on `batch` with `loss_fn` (picklable); returns the step's metrics."""
        ...

    def export_weights(self, out_dir: str | Path) -> Path:
        """Write `model.safetensors` + `config.json` into `out_dir`; returns the folder."""
        ...

    def state_fingerprint(self) -> str:
        """sha256 hex digest of the current weights."""
        ...
