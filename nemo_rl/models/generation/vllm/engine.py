"""The one module that imports vLLM: a real `AsyncLLM` engine driven by exact token ids.

Contract:
- `generate` takes prompt token ids (never text) and returns the exact sampled ids with the
  engine's logprob of each sampled token (`logprobs=0`: the chosen token only, raw model
  logprobs, which is what the trainer recomputes).
- Every sample is remembered in a bounded record log keyed by request id, so audits can compare
  a training row with what the engine itself sampled.
- `reload_weights` admits no new request, waits for in-flight ones, reloads from a folder of
  safetensors, clears the prefix cache, bumps `weight_version`, then admits again: every result
  carries the exact version that generated all of its tokens.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from nemo_rl.models.generation.vllm.chat import InvalidChatRequest, SamplingRequest
from nemo_rl.models.generation.vllm.config import VllmConfig


class EngineError(RuntimeError):
    """The vLLM engine failed to start or to serve a request."""


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


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


class VllmEngine:
    def __init__(self, engine, eos_token_id: int, max_model_len: int, max_records: int) -> None:
        self._engine = engine
        self._eos = eos_token_id
        self._max_model_len = max_model_len
        self._max_records = max_records
        self._records: OrderedDict[str, GenerationResult] = OrderedDict()
        self.weight_version = 0
        self._cond = asyncio.Condition()
        self._inflight = 0
        self._refitting = False

    @classmethod
    def start(cls, model_dir: Path, cfg: VllmConfig, eos_token_id: int) -> "VllmEngine":
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args(model_dir, cfg))
        try:
            engine = AsyncLLM.from_engine_args(args)
        except Exception as e:  # vLLM raises many types at startup; all mean "no engine".
            raise EngineError(f"vLLM AsyncLLM failed to start for model {model_dir}: {e}") from e
        return cls(engine, eos_token_id, cfg.max_model_len, cfg.max_records)

    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> GenerationResult:
        from vllm import SamplingParams

        room = self._max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidChatRequest(
                f"prompt of {len(prompt_ids)} tokens exceeds the maximum context length {self._max_model_len}"
            )
        params = SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=min(sampling.max_tokens, room),
            seed=sampling.seed,
            logprobs=0,
            stop_token_ids=[self._eos],
            detokenize=False,
        )
        async with self._cond:
            await self._cond.wait_for(lambda: not self._refitting)
            self._inflight += 1
            version = self.weight_version
        try:
            final = None
            async for out in self._engine.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id):
                final = out
        finally:
            async with self._cond:
                self._inflight -= 1
                self._cond.notify_all()
        if final is None or not final.outputs:
            raise EngineError(f"vLLM returned no output for request {request_id}")
        completion = final.outputs[0]
        token_ids = [int(t) for t in completion.token_ids]
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise EngineError(f"vLLM returned {len(completion.logprobs or [])} logprobs for {len(token_ids)} tokens")
        logprobs = [float(pos[t].logprob) for pos, t in zip(completion.logprobs, token_ids)]
        result = GenerationResult(
            request_id=request_id,
            prompt_token_ids=[int(t) for t in final.prompt_token_ids],
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason="length" if completion.finish_reason == "length" else "stop",
            weight_version=version,
        )
        self._remember(result)
        return result

    def _remember(self, result: GenerationResult) -> None:
        self._records[result.request_id] = result
        while len(self._records) > self._max_records:
            self._records.popitem(last=False)

    def records(self, request_ids: list[str]) -> dict[str, GenerationResult]:
        return {rid: self._records[rid] for rid in request_ids if rid in self._records}

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprob of each prompt token given its prefix (position 0 gets 0.0)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        final = None
        async for out in self._engine.generate({"prompt_token_ids": list(token_ids)}, params, f"plp-{os.urandom(8).hex()}"):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise EngineError("vLLM returned no prompt logprobs")
        values = [0.0]
        for pos, tok in zip(final.prompt_logprobs[1:], token_ids[1:]):
            values.append(float(pos[tok].logprob))
        return values

    async def reload_weights(self, weights_dir: Path, version: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._refitting)
            self._refitting = True
            await self._cond.wait_for(lambda: self._inflight == 0)
        try:
            await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
            await self._engine.reset_prefix_cache()
            self.weight_version = version
        finally:
            async with self._cond:
                self._refitting = False
                self._cond.notify_all()

    def shutdown(self) -> None:
        self._engine.shutdown()


async def wait_ready(engine: VllmEngine, timeout_s: float) -> None:
    """One tiny generation proves the engine serves (bounded)."""
    probe = SamplingRequest(temperature=0.0, top_p=1.0, max_tokens=1, seed=None, logprobs=False, return_token_ids=False)
    await asyncio.wait_for(engine.generate([engine._eos], probe, "warmup-0"), timeout_s)
