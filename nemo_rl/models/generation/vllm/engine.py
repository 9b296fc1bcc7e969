"""A real vLLM `AsyncLLM` driven by exact token ids (`lifecycle.start_vllm_engine` starts one).

Promises: `generate` takes prompt token ids (never text) and returns the exact sampled ids with
the engine's raw logprob of each (`generate_stream`: the same, step by step); every sample is
kept in a bounded record log for audits;
`reload_weights` drains, reloads, clears the prefix cache and bumps `weight_version`, so every
result carries the one version that generated all of its tokens. States `serving`,
`refitting`, `failed`: every wait is bounded (`EngineDeadlines`); a drain past its deadline
aborts the refit (old weights kept); a reload that fails or an engine that died is `failed`
for good (`EngineFailedError`), never wedged in `refitting`. `core_processes()` reports the
engine-core child processes for the component watch; `timing()` the engine's own idle and
refit-pause counters (the async loop's `async/engine_idle_fraction`, `async/refit_pause_s`).
See docs/design-docs/vllm-worker-capture.md, "Engine states and deadlines".
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_rl.data.errors import FatalError, RecoverableError
from nemo_rl.distributed.component_watch import ChildProcess
from nemo_rl.models.generation.vllm import worker_extension
from nemo_rl.models.generation.vllm.chat import InvalidChatRequest, SamplingRequest
from nemo_rl.models.generation.vllm.config import VllmConfig
from nemo_rl.utils.lru import BoundedLRU


class EngineError(FatalError, RuntimeError):
    """The vLLM engine failed to start or answered outside its contract (vLLM's `EngineDeadError`
    side): the engine cannot be trusted to serve."""


class EngineFailedError(EngineError):
    """The engine is in the terminal `failed` state; the message names why."""


class RefitFailedError(EngineError):
    """The reload timed out or raised: the weights are unknown, so the engine is `failed`."""


class EngineRequestError(RecoverableError, RuntimeError):
    """One request or one refit attempt failed and the engine serves on (vLLM's
    `EngineGenerateError` side): the caller answers it (503) or keeps the previous weights."""


class GenerationTimeoutError(EngineRequestError):
    """One generation outlived `generation.vllm.generate_timeout_s` and was aborted."""


class RefitGateTimeoutError(EngineRequestError):
    """A request waited longer than the refit deadlines allow for the refit gate to reopen."""


class RefitAbortedError(EngineRequestError):
    """The refit was aborted before any weight changed: the engine serves its previous version."""


class EngineState(str, enum.Enum):
    SERVING = "serving"
    REFITTING = "refitting"
    FAILED = "failed"


@dataclass(frozen=True)
class EngineDeadlines:
    generate_s: float
    refit_drain_s: float
    refit_reload_s: float

    @classmethod
    def from_config(cls, cfg: VllmConfig) -> "EngineDeadlines":
        return cls(cfg.generate_timeout_s, cfg.refit_drain_timeout_s, cfg.refit_reload_timeout_s)

    @property
    def refit_gate_s(self) -> float:
        """The longest a refit can keep the gate closed (drain + reload); a waiter never waits longer."""
        return self.refit_drain_s + self.refit_reload_s


@dataclass(frozen=True)
class EngineTiming:
    """The engine's own clock and counters, cumulative since it started (read them before and after).

    `idle_s`: seconds with no request admitted (the closed refit gate included); `refit_pause_s`:
    seconds the refit gate was closed (drain + reload, aborted refits too); `refit_drained_calls`:
    calls in flight when a refit closed the gate (they finish under the old version)."""

    clock_s: float
    idle_s: float
    refits: int
    refits_aborted: int
    refit_pause_s: float
    refit_drained_calls: int
    refits_with_calls_in_flight: int


@dataclass(frozen=True)
class StreamStep:
    """One step of `VllmEngine.generate_stream`: new sampled ids, or (last) the finished result."""

    new_token_ids: list[int]
    result: "GenerationResult | None"


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


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


class VllmEngine:
    """An `AsyncLLM` (or anything with its `generate` / `abort` / `collective_rpc` /
    `reset_prefix_cache` / `shutdown`) behind the state machine of the module docstring.

    `params_cls` builds sampling parameters (vLLM's `SamplingParams`); `dead_errors` are the
    exception types meaning the engine process died (vLLM's `EngineDeadError`). Both are injected
    so the wait logic can be tested without vLLM.
    """

    def __init__(
        self,
        engine: Any,
        eos_token_id: int,
        max_model_len: int,
        max_records: int,
        deadlines: EngineDeadlines,
        *,
        params_cls: Callable[..., Any],
        dead_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._engine = engine
        self._eos = eos_token_id
        self._max_model_len = max_model_len
        self._deadlines = deadlines
        self._params_cls = params_cls
        self._dead_errors = dead_errors
        # Insertion order: a record read by the audit is not kept longer than one never read.
        self._records: BoundedLRU[str, GenerationResult] = BoundedLRU(max_records)
        self.weight_version = 0
        self._cond = asyncio.Condition()
        self._inflight = 0
        self._state = EngineState.SERVING
        self._failure: str | None = None
        self._clock: Callable[[], float] = time.monotonic
        self._idle_since: float | None = self._clock()  # None while a request is admitted
        self._idle_s = 0.0
        self._refits = self._refits_aborted = self._refit_drained_calls = self._refits_with_calls = 0
        self._refit_pause_s = 0.0

    # --- state -------------------------------------------------------------------------------
    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def failure(self) -> str | None:
        """Why the engine is `failed` (None while it is not)."""
        return self._failure

    @property
    def inflight(self) -> int:
        return self._inflight

    def timing(self) -> EngineTiming:
        """The idle and refit counters now (`EngineTiming`); the current idle stretch is included."""
        now = self._clock()
        idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        return EngineTiming(now, idle, self._refits, self._refits_aborted, self._refit_pause_s,
                            self._refit_drained_calls, self._refits_with_calls)

    def _raise_if_failed(self) -> None:
        if self._state is EngineState.FAILED:
            raise EngineFailedError(f"the vLLM engine is failed: {self._failure}")

    async def _fail(self, reason: str) -> None:
        """Enter the terminal `failed` state and wake every waiter (they then raise)."""
        async with self._cond:
            if self._state is not EngineState.FAILED:
                self._state = EngineState.FAILED
                self._failure = reason
            self._cond.notify_all()

    async def _wait_gate_open(self) -> None:
        """Wait (holding the condition) until no refit runs, within the refit deadlines."""
        if self._state is not EngineState.REFITTING:
            return
        try:
            await asyncio.wait_for(
                self._cond.wait_for(lambda: self._state is not EngineState.REFITTING), self._deadlines.refit_gate_s
            )
        except TimeoutError as e:
            raise RefitGateTimeoutError(
                f"the refit gate stayed closed longer than generation.vllm.refit_drain_timeout_s + "
                f"refit_reload_timeout_s = {self._deadlines.refit_gate_s:g} s; retry the request"
            ) from e

    async def _admit(self) -> int:
        """Count one in-flight request once the gate is open; returns the version it will run under."""
        async with self._cond:
            self._raise_if_failed()
            await self._wait_gate_open()
            self._raise_if_failed()
            self._inflight += 1
            if self._idle_since is not None:
                self._idle_s += self._clock() - self._idle_since
                self._idle_since = None
            return self.weight_version

    async def _release(self) -> None:
        async with self._cond:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle_since = self._clock()
            self._cond.notify_all()

    async def _last_output(self, prompt_ids: list[int], params: Any, request_id: str) -> Any:
        """The final output of one engine stream, within `generate_s` (aborted past it)."""

        async def consume(stream: AsyncIterator[Any]) -> Any:
            final = None
            async for out in stream:
                final = out
            return final

        try:
            return await asyncio.wait_for(
                consume(self._engine.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id)),
                self._deadlines.generate_s,
            )
        except TimeoutError as e:
            # wait_for cancelled the stream (vLLM aborts a cancelled request itself); abort explicitly
            # too, so the engine frees the sequence even if the cancellation raced the last token.
            await self._abort(request_id)
            raise GenerationTimeoutError(
                f"request {request_id} produced no final output within generation.vllm.generate_timeout_s="
                f"{self._deadlines.generate_s:g} s and was aborted"
            ) from e
        except self._dead_errors as e:
            await self._fail(f"the engine process died while serving request {request_id}: {type(e).__name__}: {e}")
            raise EngineFailedError(f"the vLLM engine is failed: {self._failure}") from e

    async def _abort(self, request_id: str) -> None:
        try:
            await asyncio.wait_for(self._engine.abort(request_id), self._deadlines.generate_s)
        except TimeoutError as e:
            await self._fail(f"aborting request {request_id} did not finish within {self._deadlines.generate_s:g} s")
            raise EngineFailedError(f"the vLLM engine is failed: {self._failure}") from e
        except self._dead_errors as e:
            await self._fail(f"the engine process died while aborting request {request_id}: {type(e).__name__}: {e}")
            raise EngineFailedError(f"the vLLM engine is failed: {self._failure}") from e

    def core_processes(self) -> list[ChildProcess]:
        """This engine's engine-core processes (see `engine_core_processes`)."""
        return engine_core_processes(self._engine)

    # --- requests ----------------------------------------------------------------------------
    def _params(self, prompt_ids: list[int], sampling: SamplingRequest) -> Any:
        room = self._max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidChatRequest(
                f"prompt of {len(prompt_ids)} tokens exceeds the maximum context length {self._max_model_len}"
            )
        try:
            return self._params_cls(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=min(sampling.max_tokens, room),
                seed=sampling.seed,
                logprobs=0,
                stop_token_ids=[self._eos],
                detokenize=False,
            )
        except ValueError as e:  # vLLM validates sampling values with ValueError: the caller's input
            raise InvalidChatRequest(f"sampling parameters rejected by the engine: {e}") from e

    def _result(self, final: Any, request_id: str, version: int) -> GenerationResult:
        """The exact result of one finished engine stream (kept in the record log)."""
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

    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> GenerationResult:
        params = self._params(prompt_ids, sampling)
        version = await self._admit()
        try:
            final = await self._last_output(prompt_ids, params, request_id)
        finally:
            await self._release()
        return self._result(final, request_id, version)

    async def generate_stream(
        self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str
    ) -> AsyncIterator[StreamStep]:
        """`generate`, step by step: each engine output's new token ids as it is produced, then one
        last step carrying the `GenerationResult` (the same exact record `generate` returns).

        The whole stream is bounded by `generate_s`. A consumer that stops early (`aclose`, a client
        gone) aborts the request in the engine before the generator closes; nothing is recorded.
        """
        params = self._params(prompt_ids, sampling)
        version = await self._admit()
        stream = self._engine.generate({"prompt_token_ids": list(prompt_ids)}, params, request_id)
        deadline = time.monotonic() + self._deadlines.generate_s
        seen, final, finished = 0, None, False
        try:
            while True:
                try:
                    out = await asyncio.wait_for(anext(stream), max(deadline - time.monotonic(), 0.0))
                except StopAsyncIteration:
                    break
                except TimeoutError as e:
                    raise GenerationTimeoutError(
                        f"request {request_id} produced no final output within generation.vllm.generate_timeout_s="
                        f"{self._deadlines.generate_s:g} s and was aborted"
                    ) from e
                except self._dead_errors as e:
                    finished = True  # nothing left to abort
                    await self._fail(f"the engine process died while serving request {request_id}: {type(e).__name__}: {e}")
                    raise EngineFailedError(f"the vLLM engine is failed: {self._failure}") from e
                final = out
                ids = out.outputs[0].token_ids if out.outputs else []
                if len(ids) > seen:
                    step = StreamStep([int(t) for t in ids[seen:]], None)
                    seen = len(ids)
                    yield step
            finished = True
        finally:
            if not finished:  # a timeout, a failed step, or a consumer that went away mid-stream
                await asyncio.wait_for(stream.aclose(), self._deadlines.generate_s)
                await self._abort(request_id)
            await self._release()
        yield StreamStep([], self._result(final, request_id, version))

    def _remember(self, result: GenerationResult) -> None:
        self._records.put(result.request_id, result)

    def records(self, request_ids: list[str]) -> dict[str, GenerationResult]:
        return {rid: record for rid in request_ids if (record := self._records.peek(rid)) is not None}

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Logprob of each prompt token given its prefix (position 0 gets 0.0); gated like generate."""
        params = self._params_cls(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        request_id = f"plp-{os.urandom(8).hex()}"
        await self._admit()
        try:
            final = await self._last_output(token_ids, params, request_id)
        finally:
            await self._release()
        if final is None or final.prompt_logprobs is None:
            raise EngineError("vLLM returned no prompt logprobs")
        values = [0.0]
        for pos, tok in zip(final.prompt_logprobs[1:], token_ids[1:]):
            values.append(float(pos[tok].logprob))
        return values

    # --- refit -------------------------------------------------------------------------------
    async def reload_weights(self, weights_dir: Path, version: int) -> None:
        """Refit to `version` from `weights_dir` (see the module docstring for every outcome)."""
        if not weights_dir.is_dir():
            raise RefitAbortedError(
                f"refit to version {version} aborted: weights dir {weights_dir} is not a directory; the engine "
                f"keeps serving version {self.weight_version}"
            )
        async with self._cond:
            self._raise_if_failed()
            await self._wait_gate_open()  # a concurrent refit finishes (or fails) first
            self._raise_if_failed()
            self._state = EngineState.REFITTING
            closed_at, draining = self._clock(), self._inflight
            self._refit_drained_calls += draining
            self._refits_with_calls += int(draining > 0)
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self._inflight == 0), self._deadlines.refit_drain_s)
            except TimeoutError as e:
                inflight = self._inflight
                self._state = EngineState.SERVING
                self._refits_aborted += 1
                self._refit_pause_s += self._clock() - closed_at
                self._cond.notify_all()
                raise RefitAbortedError(
                    f"refit to version {version} aborted: {inflight} generation(s) still in flight after "
                    f"generation.vllm.refit_drain_timeout_s={self._deadlines.refit_drain_s:g} s; the engine keeps "
                    f"serving version {self.weight_version} (nothing was reloaded)"
                ) from e
            except BaseException:
                # Cancelled while draining: nothing was reloaded, so the old weights still serve.
                self._state = EngineState.SERVING
                self._refits_aborted += 1
                self._refit_pause_s += self._clock() - closed_at
                self._cond.notify_all()
                raise
        try:
            await asyncio.wait_for(self._reload(weights_dir), self._deadlines.refit_reload_s)
        except TimeoutError as e:
            await self._fail(
                f"refit to version {version} did not finish within generation.vllm.refit_reload_timeout_s="
                f"{self._deadlines.refit_reload_s:g} s; the weights may be partially loaded"
            )
            raise RefitFailedError(f"the vLLM engine is failed: {self._failure}") from e
        except asyncio.CancelledError:
            await self._fail(f"refit to version {version} was cancelled while loading weights; the weights are unknown")
            raise
        except Exception as e:  # vLLM's reload raises many types; the weights are unknown after any of them
            await self._fail(f"refit to version {version} from {weights_dir} raised {type(e).__name__}: {e}")
            raise RefitFailedError(f"the vLLM engine is failed: {self._failure}") from e
        async with self._cond:
            self.weight_version = version
            self._state = EngineState.SERVING
            self._refits += 1
            self._refit_pause_s += self._clock() - closed_at
            self._cond.notify_all()

    async def _reload(self, weights_dir: Path) -> None:
        await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
        await self._engine.reset_prefix_cache()
        # The engine core's freed heap is not returned to the OS by itself (see worker_extension).
        await self._engine.collective_rpc(worker_extension.TRIM_METHOD, kwargs={})

    def shutdown(self) -> None:
        self._engine.shutdown()

