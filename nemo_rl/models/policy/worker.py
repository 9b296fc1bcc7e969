"""The Ray shell around PolicyCore, and the deadline-bounded client the loop calls.

`PolicyWorker` holds one PolicyCore (the train step) and calls `state_io` on it for the refit
export, checkpoints and fingerprints; any failure inside a method is a `PolicyWorkerError` naming
the method and the cause. `RayPolicyClient` implements `PolicyWorkerHandle`: every call waits at
most `call_timeout_s` (`PolicyWorkerTimeoutError`), a dead actor is `PolicyWorkerDiedError`, and
`loss_fn` is checked in the driver before it is pickled. With a train partition the worker
reads a `TrainPlan`'s rows itself and checks their digests (`TrainRowDigestError`: nothing is
trained). Checkpoint and refit folders must be shared by every node; `check_shared_dir` proves
it, failing by the knob's name.
See docs/design-docs/policy.md, "The Ray shell and its client".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.actor import ActorHandle

from nemo_rl.data.errors import PolicyWorkerError
from nemo_rl.data.train import TrainBatch, TrainPlan
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig, attach_client
from nemo_rl.data_plane.partitions import read_train_batch
from nemo_rl.distributed.actor_call import (
    ActorCallError,
    ActorCallTimeoutError,
    ActorRaisedError,
    call_with_deadline,
)
from nemo_rl.distributed.shared_fs import SharedDirProbe, check_probe
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy import state_io
from nemo_rl.models.policy.core import LossFn, PolicyCore, check_loss_fn
from nemo_rl.models.policy.errors import PolicyWorkerDiedError, PolicyWorkerTimeoutError
from nemo_rl.models.policy.state_io import PolicyStateInfo

T = TypeVar("T")


def _own_node_id(_actor: object) -> str:
    return ray.get_runtime_context().get_node_id()


def _guard(method: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except PolicyWorkerError:
        raise
    except Exception as e:  # re-raised by name: the one class callers catch across Ray
        raise PolicyWorkerError(f"PolicyWorker.{method} failed: {type(e).__name__}: {e}") from e


@ray.remote(num_cpus=1)
class PolicyWorker:
    def __init__(self, cfg: PolicyConfig, data_plane: DataPlaneConfig | None = None) -> None:
        self._core = _guard("__init__", PolicyCore, cfg)
        self._data_plane = data_plane
        self._client: DataPlaneClient | None = None

    def _read_plan(self, plan: TrainPlan) -> TrainBatch:
        if self._data_plane is None:
            raise PolicyWorkerError(
                "train_planned needs the data plane: spawn the policy worker with the run's DataPlaneConfig"
            )
        if self._client is None:
            self._client = attach_client(self._data_plane)
        return read_train_batch(self._client, plan)

    def train_planned(self, plan: TrainPlan, loss_fn: LossFn) -> dict[str, float]:
        batch = _guard("train_planned", self._read_plan, plan)
        return _guard("train_planned", self._core.train_step, batch, loss_fn)

    def close_data_plane(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        return _guard("get_logprobs", self._core.get_logprobs, token_ids)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        return _guard("train_step", self._core.train_step, batch, loss_fn)

    def export_weights(self, out_dir: str) -> str:
        return str(_guard("export_weights", state_io.export_weights, self._core, out_dir))

    def state_fingerprint(self) -> str:
        return _guard("state_fingerprint", state_io.state_fingerprint, self._core)

    def check_shared_dir(self, probe: SharedDirProbe, knob: str) -> None:
        import ray.util

        where = f"the policy worker on node {ray.util.get_node_ip_address()}"
        _guard("check_shared_dir", check_probe, probe, knob, where)

    def optimizer_fingerprint(self) -> str:
        return _guard("optimizer_fingerprint", state_io.optimizer_fingerprint, self._core)

    def save_state(self, out_dir: str) -> PolicyStateInfo:
        return _guard("save_state", state_io.save_state, self._core, out_dir)

    def load_state(self, in_dir: str) -> PolicyStateInfo:
        return _guard("load_state", state_io.load_state, self._core, in_dir)


class RayPolicyClient:
    """PolicyWorkerHandle over a PolicyWorker actor, with a deadline on every call."""

    def __init__(self, actor: ActorHandle, call_timeout_s: float, name: str) -> None:
        self._actor = actor
        self._timeout = call_timeout_s
        self._name = name

    @classmethod
    def spawn(
        cls, cfg: PolicyConfig, name: str = "policy_worker", data_plane: DataPlaneConfig | None = None
    ) -> RayPolicyClient:
        actor = PolicyWorker.options(num_gpus=1 if cfg.device == "cuda" else 0).remote(cfg, data_plane)
        return cls(actor, cfg.call_timeout_s, name)

    def _get(self, method: str, ref: ray.ObjectRef) -> Any:
        try:
            return call_with_deadline(ref, actor=self._name, op=method, timeout_s=self._timeout)
        except ActorRaisedError as e:
            assert e.cause is not None
            raise e.cause from None  # the worker's own PolicyWorkerError, naming the method
        except ActorCallTimeoutError as e:
            raise PolicyWorkerTimeoutError(
                f"{self._name}.{method} missed its deadline of {self._timeout}s "
                "(policy.call_timeout_s); the worker is stuck or overloaded"
            ) from e
        except ActorCallError as e:
            raise PolicyWorkerDiedError(f"{self._name}.{method}: the actor died: {e.cause}") from e

    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        return self._get("get_logprobs", self._actor.get_logprobs.remote(token_ids))

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        loss_fn = check_loss_fn(loss_fn)
        return self._get("train_step", self._actor.train_step.remote(batch, loss_fn))

    def train_planned(self, plan: TrainPlan, loss_fn: LossFn) -> dict[str, float]:
        """`train_step` on the rows the plan names, read and digest-checked by the worker itself."""
        loss_fn = check_loss_fn(loss_fn)
        return self._get("train_planned", self._actor.train_planned.remote(plan, loss_fn))

    def export_weights(self, out_dir: str | Path) -> Path:
        return Path(self._get("export_weights", self._actor.export_weights.remote(str(out_dir))))

    def state_fingerprint(self) -> str:
        return self._get("state_fingerprint", self._actor.state_fingerprint.remote())

    def node_id(self) -> str:
        """The Ray node the actor runs on, measured inside it."""
        return self._get("node_id", self._actor.__ray_call__.remote(_own_node_id))

    def check_shared_dir(self, probe: SharedDirProbe, knob: str) -> None:
        """The actor reads the driver's marker in `probe.folder`, or `PolicyWorkerError` names the knob."""
        self._get("check_shared_dir", self._actor.check_shared_dir.remote(probe, knob))

    def optimizer_fingerprint(self) -> str:
        return self._get("optimizer_fingerprint", self._actor.optimizer_fingerprint.remote())

    def save_state(self, out_dir: str | Path) -> PolicyStateInfo:
        return self._get("save_state", self._actor.save_state.remote(str(out_dir)))

    def load_state(self, in_dir: str | Path) -> PolicyStateInfo:
        return self._get("load_state", self._actor.load_state.remote(str(in_dir)))

    def kill(self) -> None:
        ray.kill(self._actor, no_restart=True)
