"""A vLLM worker's refit (off the rollout path: run once per training step, never per request).

`reload_weights(engine, dir, version)` closes the engine's gate (new calls wait, in-flight ones
drain within `refit_drain_timeout_s`), reloads the safetensors folder in the engine core, clears
the prefix cache, returns the core's freed heap (`worker_extension`), then reopens the gate
under `version`. A folder that is missing or a drain past its deadline aborts with nothing
reloaded (`RefitAbortedError`: old weights, old version); a reload that times out, raises or is
cancelled fails the engine for good (`EngineFailedError`): its weights are unknown.
`update_weights` is the actor's `update_weights`: the shared-folder check, then the refit, its
failures as the `WorkerError`s that cross the Ray boundary.
See docs/design-docs/vllm-worker-capture.md ("Refit and weight versions").
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nemo_rl.data.errors import error_name
from nemo_rl.distributed.shared_fs import SharedDirError, require_dir
from nemo_rl.models.generation.vllm import worker_extension
from nemo_rl.models.generation.vllm.engine import VllmEngine
from nemo_rl.models.generation.vllm.errors import (
    EngineFailedError,
    RefitAbortedError,
    RefitAbortedWorkerError,
    WorkerError,
)


async def reload_weights(engine: VllmEngine, weights_dir: Path, version: int) -> None:
    """Refit `engine` to `version` from `weights_dir` (see the module contract for every outcome)."""
    if not weights_dir.is_dir():
        raise RefitAbortedError(
            f"refit to version {version} aborted: weights dir {weights_dir} is not a directory; the engine "
            f"keeps serving version {engine.weight_version}"
        )
    closed_at = await engine.close_gate(version)
    reload_s = engine.deadlines.refit_reload_s
    try:
        await asyncio.wait_for(_reload(engine.async_llm, weights_dir), reload_s)
    except TimeoutError as e:
        await engine.fail(
            f"refit to version {version} did not finish within generation.vllm.refit_reload_timeout_s="
            f"{reload_s:g} s; the weights may be partially loaded"
        )
        raise EngineFailedError(f"the vLLM engine is failed: {engine.failure}") from e
    except asyncio.CancelledError:
        await engine.fail(f"refit to version {version} was cancelled while loading weights; the weights are unknown")
        raise
    except Exception as e:  # vLLM's reload raises many types; the weights are unknown after any of them
        await engine.fail(f"refit to version {version} from {weights_dir} raised {error_name(e)}: {e}")
        raise EngineFailedError(f"the vLLM engine is failed: {engine.failure}") from e
    await engine.open_gate(version, closed_at)


async def _reload(llm, weights_dir: Path) -> None:
    await llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
    await llm.reset_prefix_cache()
    # The engine core's freed heap is not returned to the OS by itself (see worker_extension).
    await llm.collective_rpc(worker_extension.TRIM_METHOD, kwargs={})


async def update_weights(engine: VllmEngine, weights_dir: Path, version: int, *, worker_index: int, where: str) -> int:
    """The actor's refit to `version`; returns the engine's weight version after it."""
    try:
        # Before the engine drains: a folder this node cannot see is a deployment error, not a
        # failed reload, so the worker keeps serving its current weights.
        require_dir(weights_dir, "grpo.refit_dir", where)
    except SharedDirError as e:
        raise WorkerError(str(e)) from e
    try:
        await reload_weights(engine, weights_dir, version)
    except RefitAbortedError as e:
        raise RefitAbortedWorkerError(f"vLLM worker {worker_index}: {e}") from e
    except Exception as e:  # converted before it crosses the Ray boundary; a reload error also fails the engine
        raise WorkerError(
            f"vLLM worker {worker_index}: refit to version {version} from {weights_dir} failed: "
            f"{error_name(e)}: {e}"
        ) from e
    return engine.weight_version
