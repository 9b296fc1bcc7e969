"""A vLLM worker's probes for the driver, scripts and tests (off the rollout path: no rollout runs them).

`capture_stats` (call counters, the prefix cache's and the stage writer's), `engine_records`
(what the engine itself sampled, for exactness audits), `prompt_logprobs` (the refit's
numerical probe, gated like a generation), `engine_core_processes` (the engine-core children,
for the component watch; answers for a failed engine too). The actor's methods of the same
names delegate here; failures that cross the Ray boundary are `WorkerError`s naming the worker.
See docs/design-docs/vllm-worker-capture.md ("The actor shell").
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from nemo_rl.data.errors import error_name
from nemo_rl.distributed.component_watch import ChildProcess
from nemo_rl.models.generation.vllm.engine import VllmEngine
from nemo_rl.models.generation.vllm.errors import EngineError, EngineRequestError, WorkerError
from nemo_rl.models.generation.vllm.serving import ChatService


def engine_core_processes(engine: Any) -> list[ChildProcess]:
    """The engine-core processes an `AsyncLLM` started, as its parent process sees them.

    vLLM v1 keeps them at `engine.engine_core.resources.engine_manager.processes`
    (`multiprocessing` processes; `exitcode` reaps a dead one without blocking). No engine
    manager means the engine core runs in this process: nothing separate to watch. An engine
    without that structure (another vLLM version) raises `EngineError` naming the path.
    """
    try:
        manager = engine.engine_core.resources.engine_manager
    except AttributeError as e:
        raise EngineError(
            f"cannot find the vLLM engine-core processes (engine.engine_core.resources.engine_manager) on "
            f"{type(engine).__name__}: {e}; this vLLM version keeps them elsewhere"
        ) from e
    if manager is None:
        return []
    processes = getattr(manager, "processes", None)
    if processes is None:
        raise EngineError(f"the vLLM engine manager {type(manager).__name__} lists no `processes`")
    return [ChildProcess(p.name, p.pid, p.exitcode) for p in processes]


def core_process_wires(engine: VllmEngine, worker_index: int) -> list[dict]:
    """`engine_core_processes` of the worker's engine as `ChildProcess.to_wire` dicts."""
    try:
        return [child.to_wire() for child in engine_core_processes(engine.async_llm)]
    except EngineError as e:  # converted before it crosses the Ray boundary
        raise WorkerError(f"vLLM worker {worker_index}: {e}") from e


def engine_records(engine: VllmEngine, request_ids: list[str]) -> dict[str, dict]:
    """What the engine itself sampled, per request id (the audit trail for exactness checks)."""
    return {rid: vars(rec) for rid, rec in engine.records(request_ids).items()}


async def engine_prompt_logprobs(engine: VllmEngine, token_ids: list[int]) -> list[float]:
    """Logprob of each prompt token given its prefix (position 0 gets 0.0); gated like generate."""
    params = engine.params_cls(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    final, _ = await engine.run(token_ids, params, f"plp-{os.urandom(8).hex()}")
    if final is None or final.prompt_logprobs is None:
        raise EngineError("vLLM returned no prompt logprobs")
    values = [0.0]
    for pos, tok in zip(final.prompt_logprobs[1:], token_ids[1:]):
        values.append(float(pos[tok].logprob))
    return values


async def prompt_logprobs(engine: VllmEngine, token_ids: list[int], worker_index: int) -> list[float]:
    """`engine_prompt_logprobs` for the actor, its failures as `WorkerError`s."""
    try:
        return await engine_prompt_logprobs(engine, token_ids)
    # Both sides of the engine's split (a dead engine, or a gate/deadline miss of this call):
    # converted before they cross the Ray boundary.
    except (EngineError, EngineRequestError) as e:
        raise WorkerError(f"vLLM worker {worker_index}: prompt_logprobs failed: {error_name(e)}: {e}") from e


def capture_stats(service: ChatService, engine: VllmEngine | None, custody: Any, worker_index: int) -> dict:
    """The worker's call, prefix-cache and stage-writer counters (`custody`: a `lifecycle.TQCustody` or None)."""
    core = service.custody  # None: token capture off
    cache = core.prefix_cache if core is not None else None
    return {
        "worker_index": worker_index,
        "served_calls": service.stats["served_calls"],
        # None only for a service without an engine (a test's stand-in): `serve` needs one
        "engine_timing": dataclasses.asdict(engine.timing()) if engine is not None else None,
        "served_rollouts_pending": core.served_rollouts_pending() if core is not None else 0,
        "calls": dict(service.stats),
        "capture_failures": list(core.capture_failures) if core is not None else [],
        "prefix_cache_fetched_keys": cache.fetched_keys if cache else 0,
        "prefix_cache_fetched_tokens": cache.fetched_tokens if cache else 0,
        "prefix_cache_seeded_keys": cache.seeded_keys if cache else 0,
        "prefix_cache_seed_rejected": cache.seed_rejected if cache else 0,
        "prefix_cache_tokens": cache.cached_tokens if cache else 0,
        **(custody.stats() if custody else {"prefix_fetch_missing_waits": 0, "stage_writer": None}),
    }
