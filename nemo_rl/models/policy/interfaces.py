"""PolicyWorkerHandle: what the training loop calls on the policy worker.

Implemented by `RayPolicyClient` (a Ray actor behind per-call deadlines); in one process the same
calls are `PolicyCore.train_step` and `state_io`'s functions of the core. Every method is
synchronous and raises a named `PolicyError` on failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from nemo_rl.data.train import TrainBatch

if TYPE_CHECKING:  # the worker pulls in torch and Ray; the package's light re-exports must not
    from nemo_rl.models.policy.worker import LossFn


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
