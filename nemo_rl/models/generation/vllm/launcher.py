"""Driver-side launch of vLLM generation workers in their flavored venv, with deadlines.

Contract: `spawn_workers` builds (or reuses) the venv named by the hash of its spec, starts
`num_workers` Ray actors whose interpreter is that venv's python and returns their base URLs as
soon as the ports are open, without waiting for the engines (so the caller can start other
components meanwhile); `await_workers` waits for the engines within
`generation.vllm.startup_timeout_s` and returns handles whose `base_url`s serve requests.
Every actor call made through `WorkerGroup` has a deadline; an actor
that dies or hangs surfaces as `WorkerError` naming the worker and the operation.
Worker `i` (0-based, the order of `handles`/`base_urls`) is constructed with `worker_index=i`.
`take_served_async` pops what every worker served for the given rollouts and
merge it (`merge_served`, worker order then call order); the async variant awaits the refs under
`asyncio.wait_for(call_timeout_s)` so a driver coroutine never blocks its event loop in ray.get.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.engine import cpu_engine_env
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker, WorkerError
from nemo_rl.token_capture.served import ServedCall
from nemo_rl.utils.venvs import REPO_ROOT, ensure_venv, venv_python, vllm_spec


def detect_flavor(requested: str) -> str:
    if requested != "auto":
        return requested
    return "gpu" if shutil.which("nvidia-smi") and os.path.exists("/dev/nvidia0") else "cpu"


def worker_env(gen: GenerationConfig, flavor: str) -> dict[str, str]:
    env = {
        "PYTHONPATH": str(REPO_ROOT),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if flavor == "cpu":
        env.update(cpu_engine_env(gen.vllm))
    return env


def merge_served(parts: list[list[dict]]) -> list[ServedCall]:
    """Every worker's `take_served` answer (wire dicts), in worker order, as `ServedCall`s.

    Nothing is dropped or deduplicated: each record is one completion a worker produced.
    A malformed record raises `ServedCallError` (a worker/driver version mismatch).
    """
    return [ServedCall.from_wire(record) for part in parts for record in part]


@dataclass
class WorkerGroup:
    handles: list[Any]
    base_urls: list[str]
    call_timeout_s: float

    def _get(self, refs: list[Any], op: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=self.call_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerError(f"vLLM worker {op} exceeded its {self.call_timeout_s:.0f}s deadline") from e
        except ray.exceptions.RayActorError as e:
            raise WorkerError(f"vLLM worker died during {op}: {e}") from e

    def update_weights(self, weights_dir: Path, version: int) -> list[int]:
        return self._get([h.update_weights.remote(str(weights_dir), version) for h in self.handles], "update_weights")

    def weight_versions(self) -> list[int]:
        """The weight version each worker serves, in worker order (measured from the workers)."""
        return self._get([h.weight_version.remote() for h in self.handles], "weight_version")

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

    def prompt_logprobs(self, token_ids: list[int]) -> list[list[float]]:
        return self._get([h.prompt_logprobs.remote(token_ids) for h in self.handles], "prompt_logprobs")

    async def _get_async(self, refs: list[Any], op: str) -> list[Any]:
        try:
            return list(await asyncio.wait_for(asyncio.gather(*refs), self.call_timeout_s))
        except asyncio.TimeoutError as e:
            raise WorkerError(f"vLLM worker {op} exceeded its {self.call_timeout_s:.0f}s deadline") from e
        except ray.exceptions.RayActorError as e:
            raise WorkerError(f"vLLM worker died during {op}: {e}") from e

    def capture_stats(self) -> list[dict]:
        return self._get([h.capture_stats.remote() for h in self.handles], "capture_stats")

    async def take_served_async(self, rollout_ids: list[str]) -> list[ServedCall]:
        """Pop what every worker served for `rollout_ids`; awaits the refs, never blocks the event loop."""
        refs = [h.take_served.remote(list(rollout_ids)) for h in self.handles]
        return merge_served(await self._get_async(refs, "take_served"))

    def shutdown(self) -> None:
        refs = [h.shutdown.remote() for h in self.handles]
        try:
            ray.get(refs, timeout=60)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            pass  # the actor is killed right below either way
        for h in self.handles:
            ray.kill(h)
        self.handles = []


@dataclass
class PendingWorkers:
    """Worker actors with open (503) endpoints whose engines are starting (see `spawn_workers`)."""

    group: WorkerGroup
    base_urls: list[str]
    engine_refs: list[Any]
    deadline: float  # time.monotonic() by which the workers must serve
    timeout_s: float


def _startup_get(group: WorkerGroup, refs: list[Any], deadline: float, timeout_s: float, what: str) -> list[Any]:
    """ray.get within the start-up deadline; the group is shut down before any error propagates."""
    try:
        return ray.get(refs, timeout=max(deadline - time.monotonic(), 0.0))
    except ray.exceptions.GetTimeoutError as e:
        group.shutdown()
        raise WorkerError(
            f"vLLM workers did not {what} within generation.vllm.startup_timeout_s={timeout_s:.0f}"
        ) from e
    except ray.exceptions.RayError as e:
        group.shutdown()
        raise WorkerError(f"vLLM worker failed to {what}: {e}") from e


def spawn_workers(
    model_dir: Path,
    gen: GenerationConfig,
    token_capture_cfg: dict,
    data_plane_cfg: dict | None,
    *,
    progress: Callable[[str], None] = print,
) -> PendingWorkers:
    """Build (or reuse) the venv, create the actors, open their ports and start their engines.

    Returns once every worker has a base URL (its routes answer 503 until `await_workers`), so
    the caller can point the Gym servers at it while vLLM loads. The venv build is not under the
    start-up deadline (it prints its own progress and is bounded by its installer); the rest is.
    """
    flavor = detect_flavor(gen.vllm.flavor)
    venv = ensure_venv(vllm_spec(flavor), progress=progress)
    deadline = time.monotonic() + gen.vllm.startup_timeout_s
    actor_cls = ray.remote(num_cpus=0)(VllmGenerationWorker)
    handles = [
        actor_cls.options(
            name=None,
            max_concurrency=1000,
            runtime_env={"py_executable": str(venv_python(venv)), "env_vars": worker_env(gen, flavor)},
        ).remote(str(model_dir), gen.model_dump(), token_capture_cfg, data_plane_cfg, worker_index=i)
        for i in range(gen.num_workers)
    ]
    progress(f"[generation] starting {len(handles)} vLLM worker(s) ({flavor}) from {model_dir}")
    group = WorkerGroup(handles=handles, base_urls=[], call_timeout_s=gen.vllm.call_timeout_s)
    # bind before start_engine: the engine's synchronous start blocks the actor's event loop.
    base_urls = _startup_get(group, [h.bind.remote() for h in handles], deadline, gen.vllm.startup_timeout_s, "open their ports")
    return PendingWorkers(
        group=group,
        base_urls=base_urls,
        engine_refs=[h.start_engine.remote() for h in handles],
        deadline=deadline,
        timeout_s=gen.vllm.startup_timeout_s,
    )


def await_workers(pending: PendingWorkers, *, progress: Callable[[str], None] = print) -> WorkerGroup:
    """Wait for the engines, then let every worker serve; the group is shut down on failure.

    When token capture is enabled the data plane must be running before this is called: `serve`
    attaches the staging sink before the first request is let through.
    """
    group = pending.group
    _startup_get(group, pending.engine_refs, pending.deadline, pending.timeout_s, "start their engines")
    group.base_urls = _startup_get(
        group, [h.serve.remote() for h in group.handles], pending.deadline, pending.timeout_s, "start serving"
    )
    progress(f"[generation] workers ready at {', '.join(group.base_urls)}")
    return group
