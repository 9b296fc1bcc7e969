"""Start-up and tear-down of one vLLM worker's parts (off the rollout path: run once per worker).

Owns the engine's start (`engine_args` and `cpu_engine_env` per flavor, `start_vllm_engine`, the
only vLLM import; `start_engine` builds tokenizer and engine off the event loop; `wait_ready`),
the custody core's assembly (`build_custody` over any staging sink and source, `build_tq_custody`
and `attach_capture` over the data plane, `duplicate_wait_bound_s`) and `close_capture` (the
write-behind writer joined before its data-plane client closes); the service itself is
`serving.chat_service`'s. The actor shell (`worker.py`) calls these and converts their failures
to `WorkerError`s.
Invariant: nothing here runs per request; what it builds is what the request path then uses.
See docs/design-docs/vllm-worker-capture.md ("The actor shell").
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from nemo_gym.token_id_capture.adapters.vllm import VLLMCaptureAdapter
from nemo_gym.token_id_capture.staging import RolloutTokenCapture, StagingSink, StagingSource
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig, attach_client_async
from nemo_rl.data_plane.client import StageWriter
from nemo_rl.data_plane.partitions import TQTokenSink, TQTokenSource
from nemo_rl.models.generation.vllm import worker_extension
from nemo_rl.models.generation.vllm.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.vllm.custody import (
    DEFAULT_DUPLICATE_WAIT_S,
    DEFAULT_MAX_SERVED_ROLLOUTS,
    CustodyCore,
    StageBarrier,
)
from nemo_rl.models.generation.vllm.custody_state import PrefixCache
from nemo_rl.models.generation.vllm.engine import EngineDeadlines, SamplingRequest, VllmEngine, token_prompt_input
from nemo_rl.models.generation.vllm.errors import EngineError
from nemo_rl.token_capture.config import TokenCaptureConfig


def load_tokenizer(model_dir: Path):  # -> a transformers tokenizer (blocking: file reads, imports)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def cpu_engine_env(cfg: VllmConfig) -> dict[str, str]:
    """Environment a CPU engine needs (set before vLLM is imported)."""
    cpus = os.cpu_count() or 1
    bind = cfg.omp_threads_bind if cfg.omp_threads_bind != "auto" else f"0-{cpus - 1}"
    # No VLLM_CPU_KVCACHE_SPACE: it would override the exact `kv_cache_memory_bytes` engine arg
    # with whole GiB. VLLM_ENABLE_V1_MULTIPROCESSING=0 does not move the engine core in-process
    # (AsyncLLM always spawns it); it only stops the CPU platform from turning the "uni" executor
    # into "mp", whose extra worker process would import vLLM a third time (~35 s per start on
    # 2 cores) for no gain with one engine per worker.
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
    }


def engine_args(model_dir: Path, cfg: VllmConfig) -> dict:
    """`AsyncEngineArgs` keyword arguments for `cfg.flavor` (the launcher resolves auto first).

    cpu (and an unresolved auto): float32, an exact KV budget (`kv_cache_memory_bytes`), the
    in-process "uni" executor. gpu: `dtype`, `tensor_parallel_size` GPUs (the "mp" executor when
    more than one, inside the Ray actor that reserved them), a KV cache sized by
    `gpu_memory_utilization` (vLLM ignores that fraction when kv_cache_memory_bytes is given).
    """
    args = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype=cfg.dtype,
        seed=cfg.seed,
        enforce_eager=cfg.enforce_eager,
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=True,
        disable_log_stats=True,
        worker_extension_cls=worker_extension.QUALNAME,  # heap trim after every refit, quiet benign reload warnings
    )
    if cfg.flavor == "gpu":
        tp = cfg.tensor_parallel_size
        return {
            **args,
            "tensor_parallel_size": tp,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "distributed_executor_backend": "mp" if tp > 1 else "uni",
        }
    return {**args, "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes, "distributed_executor_backend": "uni"}


def start_vllm_engine(model_dir: Path, cfg: VllmConfig, eos_token_id: int) -> VllmEngine:
    """A `VllmEngine` over a freshly started `AsyncLLM` (blocking: vLLM's imports and model load)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    args = AsyncEngineArgs(**engine_args(model_dir, cfg))
    try:
        engine = AsyncLLM.from_engine_args(args)
    except Exception as e:  # vLLM raises many types at startup; all mean "no engine".
        raise EngineError(f"vLLM AsyncLLM failed to start for model {model_dir}: {e}") from e
    return VllmEngine(
        engine,
        eos_token_id,
        cfg.max_model_len,
        cfg.max_records,
        EngineDeadlines.from_config(cfg),
        params_cls=SamplingParams,
        prompt_input=partial(token_prompt_input, engine.renderer),
        dead_errors=(EngineDeadError,),
    )


async def start_engine(model_dir: Path, cfg: VllmConfig) -> tuple[Any, VllmEngine]:
    """The model's tokenizer and a started `VllmEngine` (the slow part: vLLM imports, model load;
    the caller then proves it serves with `wait_ready`). Both are built off the event loop, so
    the worker's open port keeps answering 503 `worker_starting` while vLLM loads (~60 s on CPU)."""
    tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)  # transformers' import takes a second or more
    engine = await asyncio.to_thread(start_vllm_engine, model_dir, cfg, tokenizer.eos_token_id)
    # Every refit would otherwise log vLLM's "RotaryEmbedding: Failed to load weights" (benign: no
    # checkpoint holds its computed cache); other layers' reload warnings still reach the log.
    await engine.async_llm.collective_rpc(worker_extension.QUIET_METHOD)
    return tokenizer, engine


async def wait_ready(engine: VllmEngine, timeout_s: float) -> None:
    """One tiny generation proves the engine serves (bounded)."""
    probe = SamplingRequest(temperature=0.0, top_p=1.0, max_tokens=1, seed=None, logprobs=False, return_token_ids=False)
    await asyncio.wait_for(engine.generate([engine.eos_token_id], probe, "warmup-0"), timeout_s)


async def attach_capture(
    dp_cfg: DataPlaneConfig,
    capture_cfg: TokenCaptureConfig,
    gen: GenerationConfig,
    *,
    weight_version_fn: Callable[[], int],
    vocab_size: int,
    worker_index: int,
) -> tuple[DataPlaneClient, "TQCustody"]:
    """The worker's data-plane client (attached awaited, never `ray.get` on the actor's loop) and
    its `TQCustody`; the client is closed again if the custody cannot be built."""
    client = await attach_client_async(dp_cfg)
    try:
        custody = build_tq_custody(
            client,
            capture_cfg,
            weight_version_fn=weight_version_fn,
            vocab_size=vocab_size,
            max_admitted_calls=gen.vllm.max_admitted_calls,
            worker_index=worker_index,
            duplicate_wait_s=duplicate_wait_bound_s(gen.vllm.generate_timeout_s, capture_cfg.stage_timeout_s),
        )
    except BaseException:
        await asyncio.to_thread(client.close)
        raise
    return client, custody


async def close_capture(custody: "TQCustody | None", client: Any, stage_timeout_s: float) -> None:
    """Join the write-behind writer (bounded by `stage_timeout_s`), then close its data-plane client.

    Both wait on threads: run off the actor's event loop."""
    if custody is not None and custody.writer is not None:
        await asyncio.to_thread(custody.writer.close, stage_timeout_s)  # before its client
    if client is not None:
        await asyncio.to_thread(client.close)


def duplicate_wait_bound_s(generate_timeout_s: float, stage_timeout_s: float) -> float:
    """The longest an admitted call can take here: the parents' wait, a prefix read (which may wait
    for a missing key), the generation and a before-reply write, each under its own deadline."""
    return generate_timeout_s + 3 * stage_timeout_s


def build_custody(
    sink: StagingSink,
    source: StagingSource | None,
    *,
    weight_version_fn: Callable[[], int],
    prefix_cache_max_tokens: int,
    vocab_size: int,
    max_admitted_calls: int,
    worker_index: int = 0,
    max_served_rollouts: int = DEFAULT_MAX_SERVED_ROLLOUTS,
    duplicate_wait_s: float = DEFAULT_DUPLICATE_WAIT_S,
    barrier: StageBarrier | None = None,
    barrier_timeout_s: float = 0.0,
) -> CustodyCore:
    """The custody core over one staging sink and source: Gym's capture core (vLLM adapter), the
    prefix cache over `source` (None: `staging_chain` admissions are 503) and, under write-behind,
    the `barrier` (its waits bounded by `barrier_timeout_s`)."""
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=weight_version_fn, adapter=VLLMCaptureAdapter())
    return CustodyCore(
        capture,
        PrefixCache(source, prefix_cache_max_tokens) if source is not None else None,
        vocab_size=vocab_size,
        max_admitted_calls=max_admitted_calls,
        worker_index=worker_index,
        max_served_rollouts=max_served_rollouts,
        duplicate_wait_s=duplicate_wait_s,
        barrier=barrier,
        barrier_timeout_s=barrier_timeout_s,
    )


@dataclass(frozen=True)
class TQCustody:
    """The worker's custody over the data plane: the core, its write-behind writer and its prefix source."""

    core: CustodyCore
    writer: StageWriter | None  # under token_capture.stage_write=behind_reply
    source: TQTokenSource

    def stats(self) -> dict[str, Any]:
        return {
            "prefix_fetch_missing_waits": self.source.missing_waits,
            "stage_writer": dict(self.writer.stats) if self.writer is not None else None,
        }


def build_tq_custody(
    client: Any,
    capture_cfg: TokenCaptureConfig,
    *,
    weight_version_fn: Callable[[], int],
    vocab_size: int,
    max_admitted_calls: int,
    worker_index: int = 0,
    duplicate_wait_s: float = DEFAULT_DUPLICATE_WAIT_S,
) -> TQCustody:
    """`build_custody` over the data plane `client` (a `DataPlaneClient`, or anything with its
    put/put_many/get/clear): TQ staging sink and source and, under `behind_reply`, the `StageWriter`
    as the barrier (served report, parents' check, prefix seeding once durable)."""
    partition = capture_cfg.staging_partition
    timeout_s = capture_cfg.stage_timeout_s
    behind = capture_cfg.stage_write == "behind_reply"
    writer = StageWriter(client, partition, timeout_s=timeout_s) if behind else None
    # Under write-behind a parent staged by another worker may still be in its write.
    source = TQTokenSource(client, partition, timeout_s=timeout_s, missing_wait_s=timeout_s if behind else 0.0)
    core = build_custody(
        TQTokenSink(client, partition, timeout_s=timeout_s, writer=writer),
        source,
        weight_version_fn=weight_version_fn,
        prefix_cache_max_tokens=capture_cfg.prefix_cache_max_tokens,
        vocab_size=vocab_size,
        max_admitted_calls=max_admitted_calls,
        worker_index=worker_index,
        duplicate_wait_s=duplicate_wait_s,
        barrier=writer,
        barrier_timeout_s=timeout_s if writer is not None else 0.0,
    )
    return TQCustody(core, writer, source)
