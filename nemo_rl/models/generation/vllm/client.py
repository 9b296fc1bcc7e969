"""The driver's side of the vLLM workers: `WorkerGroup` (their lifecycle handle: refit, probes,
audits, shutdown) and `ServedReporter` (the per-rollout served report, `WorkerGroup.served`).

Never imports the actor module (`worker.py`): a driver process needs only the worker's error
classes (`errors.py`) and Ray handles. Promises: every actor call has a deadline
(`generation.vllm.call_timeout_s`), and a dead or hung worker surfaces as `WorkerError` naming
the operation (`raise_worker_error`); what a worker raised itself (a `WorkerError` such as a
refit failure, its own `WorkerFailedError`, or a bug) reaches the caller as it is; no driver
coroutine blocks its event loop in `ray.get` (`ServedReporter.take_served_async` awaits).
Invariant: the per-run control bearer lives on `WorkerGroup.control_token`, out of its repr,
never printed or logged. Spawning the workers is `launcher.py`'s.
See docs/design-docs/vllm-worker-capture.md, "The launcher".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import ray

from nemo_rl.data.calls import ServedCall
from nemo_rl.distributed.actor_call import (
    ActorCallError,
    ActorCallTimeoutError,
    ActorDiedError,
    ActorRaisedError,
    await_with_deadline,
    call_with_deadline,
)
from nemo_rl.distributed.component_watch import (
    ChildProcess,
    Component,
    ComponentKind,
    Probe,
    Role,
    actor_children_probe,
    ray_actor_probe,
)
from nemo_rl.distributed.placement import actor_node_ids
from nemo_rl.distributed.shared_fs import SharedDirProbe
from nemo_rl.models.generation.vllm.errors import WorkerError

WORKERS = "vLLM workers"  # the actor name `ActorCallError`s of group calls carry


def raise_worker_error(
    failure: ActorCallTimeoutError | ActorDiedError | ActorRaisedError, timeout_s: float
) -> NoReturn:
    """A failed group call as a `WorkerError`; what a worker raised itself stays as it is (a
    `WorkerError` such as a refit failure, a `WorkerFailedError`, or a bug)."""
    if isinstance(failure, ActorRaisedError):
        assert failure.cause is not None
        raise failure.cause from None
    if isinstance(failure, ActorCallTimeoutError):
        raise WorkerError(f"vLLM worker {failure.op} exceeded its {timeout_s:.0f}s deadline") from failure
    raise WorkerError(f"vLLM worker died during {failure.op}: {failure.cause}") from failure


def merge_served(parts: list[list[dict]]) -> list[ServedCall]:
    """Every worker's `take_served` answer (wire dicts), in worker order, as `ServedCall`s.

    Nothing is dropped or deduplicated: each record is one completion a worker produced.
    A malformed record raises `RecordInvariantError` (`served_call`: a worker/driver version mismatch).
    """
    return [ServedCall.from_wire(record) for part in parts for record in part]


@dataclasses.dataclass(frozen=True)
class ServedReporter:
    """The driver's served-call report over the worker actors (`WorkerGroup.served`)."""

    handles: list[Any]
    call_timeout_s: float

    async def take_served_async(self, rollout_ids: list[str]) -> list[ServedCall]:
        """Pop what every worker served for `rollout_ids`; awaits the refs, never blocks the event loop."""
        refs = [h.take_served.remote(list(rollout_ids)) for h in self.handles]
        try:
            parts = await await_with_deadline(refs, actor=WORKERS, op="take_served", timeout_s=self.call_timeout_s)
        except ActorCallError as e:
            raise_worker_error(e, self.call_timeout_s)
        return merge_served(parts)


def engine_core_name(worker: int, index: int = 0, count: int = 1) -> str:
    """`vllm_worker_<i>/engine_core` (`..._<j>` when a worker runs several engine cores)."""
    return Component.engine_core(worker, index, count).name


def worker_name(worker: int) -> str:
    """`vllm_worker_<i>`: worker i's component name."""
    return Component(ComponentKind.VLLM_WORKER, worker).name


@dataclass
class WorkerGroup:
    handles: list[Any]
    base_urls: list[str]
    call_timeout_s: float
    control_token: str = field(default="", repr=False)  # the run's bearer for the workers' control routes
    planned_nodes: list[str | None] = field(default_factory=list)  # node id per worker (None: Ray decides)

    def _get(self, refs: list[Any], op: str) -> list[Any]:
        try:
            return call_with_deadline(refs, actor=WORKERS, op=op, timeout_s=self.call_timeout_s)
        except ActorCallError as e:
            raise_worker_error(e, self.call_timeout_s)

    def update_weights(self, weights_dir: Path, version: int) -> list[int]:
        return self._get([h.update_weights.remote(str(weights_dir), version) for h in self.handles], "update_weights")

    def check_shared_dir(self, probe: SharedDirProbe, knob: str) -> None:
        """Every worker reads the driver's marker in `probe.folder`, or `WorkerError` names the knob."""
        self._get([h.check_shared_dir.remote(probe, knob) for h in self.handles], "check_shared_dir")

    def node_ids(self) -> list[str]:
        """The node id each worker runs on (worker order), measured inside the actors."""
        try:
            return actor_node_ids(self.handles, self.call_timeout_s, actor=WORKERS)
        except ActorCallError as e:
            raise_worker_error(e, self.call_timeout_s)

    def weight_versions(self) -> list[int]:
        """The weight version each worker serves, in worker order (measured from the workers)."""
        return self._get([h.weight_version.remote() for h in self.handles], "weight_version")

    def venv_info(self) -> list[dict]:
        """Per worker (in worker order), the venv its interpreter runs in (`VllmGenerationWorker.venv_info`)."""
        return self._get([h.venv_info.remote() for h in self.handles], "venv_info")

    def engine_records_by_worker(self, request_ids: list[str]) -> list[dict[str, dict]]:
        """Per worker (in worker order), the engine records it holds for `request_ids`: which worker
        served which completion."""
        return self._get([h.engine_records.remote(request_ids) for h in self.handles], "engine_records")

    def engine_records(self, request_ids: list[str]) -> dict[str, dict]:
        merged: dict[str, dict] = {}
        for part in self.engine_records_by_worker(request_ids):
            merged.update(part)
        return merged

    def served_calls(self) -> list[int]:
        """Completions each worker has produced since it started (its own counter), in worker order."""
        return [stats["served_calls"] for stats in self.capture_stats()]

    def engine_timings(self) -> list[dict]:
        """Per worker (in worker order), its engine's own `EngineTiming` counters as a dict."""
        return [stats["engine_timing"] for stats in self.capture_stats()]

    def prompt_logprobs(self, token_ids: list[int]) -> list[list[float]]:
        return self._get([h.prompt_logprobs.remote(token_ids) for h in self.handles], "prompt_logprobs")

    def capture_stats(self) -> list[dict]:
        return self._get([h.capture_stats.remote() for h in self.handles], "capture_stats")

    @property
    def served(self) -> ServedReporter:
        """The per-rollout served report over these workers (what the rollout manager is given)."""
        return ServedReporter(list(self.handles), self.call_timeout_s)

    def probes(self) -> list[Probe]:
        """Per worker: the actor, `vllm_worker_<i>`, and its engine core, `vllm_worker_<i>/engine_core`
        (both rollout path: a worker whose engine core died serves nothing)."""
        probes = []
        for i, h in enumerate(self.handles):
            probes.append(ray_actor_probe(worker_name(i), Role.ROLLOUT_PATH, h, f"vLLM worker {i}"))
            probes.append(actor_children_probe(engine_core_name(i), Role.ROLLOUT_PATH,
                                               h.engine_core_processes.remote, f"vLLM worker {i} engine core"))
        return probes

    def engine_core_pids(self) -> dict[str, int]:
        """Pid of every worker's engine-core process by component name (`engine_core_name`)."""
        parts = self._get([h.engine_core_processes.remote() for h in self.handles], "engine_core_processes")
        return {
            engine_core_name(i, j, len(part)): ChildProcess.from_wire(record).pid
            for i, part in enumerate(parts) for j, record in enumerate(part)
        }

    def shutdown(self) -> None:
        refs = [h.shutdown.remote() for h in self.handles]
        try:
            call_with_deadline(refs, actor=WORKERS, op="shutdown", timeout_s=60)
        except ActorCallError as e:
            if not e.recoverable:  # a shutdown that raised is a bug, not a gone or slow actor
                raise e.cause from None
            # gone or slow: the actor is killed right below either way
        for h in self.handles:
            ray.kill(h)
        self.handles = []
