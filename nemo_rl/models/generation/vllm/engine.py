"""A real vLLM `AsyncLLM` driven by exact token ids (`lifecycle.start_vllm_engine` starts one).

Promises: `generate` takes prompt token ids (never text) and returns the exact sampled ids with
the engine's raw logprob of each; every sample is kept in a bounded record log for audits.
States `serving`, `refitting`, `failed`: calls are admitted through a gate a refit closes
(`close_gate`, `open_gate`; the refit procedure is `refit.reload_weights`, the probes
`diagnostics`), the streamed call (`generate_stream`) too, so every result carries the one
version that generated all of its tokens. Every wait is bounded (`EngineDeadlines`); a drain
past its deadline reopens the gate (old weights kept); an engine that died or a reload that
failed is `failed` for good (`EngineFailedError`), never wedged in `refitting`. `timing()`
reports the engine's own idle and refit-pause counters.
See docs/design-docs/vllm-worker-capture.md, "Engine states and deadlines".
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_rl.data.errors import error_name
from nemo_rl.models.generation.vllm.config import VllmConfig
from nemo_rl.models.generation.vllm.errors import (
    EngineError,
    EngineFailedError,
    GenerationTimeoutError,
    InvalidChatRequest,
    RefitAbortedError,
    RefitGateTimeoutError,
)
from nemo_rl.utils.lru import BoundedLRU


@dataclass(frozen=True)
class SamplingRequest:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    logprobs: bool
    return_token_ids: bool
    max_tokens_explicit: bool = False  # the caller set max_tokens (else the server default, clipped to fit)
    # vLLM's `return_tokens_as_token_ids`: logprob entries name tokens `token_id:N` (else their text).
    return_tokens_as_token_ids: bool = False


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
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class GenerationResultLike(Protocol):
    """What the layers above read of a `GenerationResult` (test engines return their own records)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


@dataclass(frozen=True)
class StreamStep:
    """One step of `VllmEngine.generate_stream`: new sampled ids, or (last) the finished result."""

    new_token_ids: list[int]
    result: GenerationResult | None


def token_prompt_input(renderer: Any, prompt_ids: list[int]) -> Any:
    """The engine input for exact prompt ids, rendered by vLLM's own `Renderer.render_cmpl`.

    What `AsyncLLM.generate` does itself for a raw `{"prompt_token_ids": ...}` prompt, which vLLM
    deprecates (and logs at every engine start); ids are never re-tokenized either way.
    """
    (engine_input,) = renderer.render_cmpl([{"prompt_token_ids": prompt_ids}])
    return engine_input


class VllmEngine:
    """An `AsyncLLM` (or anything with its `generate` / `abort` / `collective_rpc` /
    `reset_prefix_cache` / `shutdown`) behind the state machine of the module docstring.

    `params_cls` builds sampling parameters (vLLM's `SamplingParams`); `prompt_input` turns prompt
    ids into the engine input `generate` takes (`token_prompt_input`: vLLM's renderer);
    `dead_errors` are the exception types meaning the engine process died (vLLM's
    `EngineDeadError`). All are injected so the wait logic can be tested without vLLM.
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
        prompt_input: Callable[[list[int]], Any],
        dead_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._engine = engine
        self._eos = eos_token_id
        self._max_model_len = max_model_len
        self._deadlines = deadlines
        self._params_cls = params_cls
        self._prompt_input = prompt_input
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

    @property
    def deadlines(self) -> EngineDeadlines:
        return self._deadlines

    @property
    def dead_errors(self) -> tuple[type[BaseException], ...]:
        return self._dead_errors

    @property
    def async_llm(self) -> Any:
        """The wrapped `AsyncLLM`, for the procedures off the request path (refit, diagnostics)."""
        return self._engine

    @property
    def params_cls(self) -> Callable[..., Any]:
        return self._params_cls

    def timing(self) -> EngineTiming:
        """The idle and refit counters now (`EngineTiming`); the current idle stretch is included."""
        now = self._clock()
        idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        return EngineTiming(now, idle, self._refits, self._refits_aborted, self._refit_pause_s,
                            self._refit_drained_calls, self._refits_with_calls)

    def _raise_if_failed(self) -> None:
        if self._state is EngineState.FAILED:
            raise EngineFailedError(f"the vLLM engine is failed: {self._failure}")

    async def fail(self, reason: str) -> None:
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

    async def admit(self) -> int:
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

    async def release(self) -> None:
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
                consume(self.outputs(prompt_ids, params, request_id)),
                self._deadlines.generate_s,
            )
        except TimeoutError as e:
            # wait_for cancelled the stream (vLLM aborts a cancelled request itself); abort explicitly
            # too, so the engine frees the sequence even if the cancellation raced the last token.
            await self.abort(request_id)
            raise GenerationTimeoutError(
                f"request {request_id} produced no final output within generation.vllm.generate_timeout_s="
                f"{self._deadlines.generate_s:g} s and was aborted"
            ) from e
        except self._dead_errors as e:
            raise await self.died(request_id, e) from e

    async def died(self, request_id: str, error: BaseException) -> EngineFailedError:
        """Fail the engine for its process dying while serving `request_id`; returns the error to raise."""
        await self.fail(f"the engine process died while serving request {request_id}: {error_name(error)}: {error}")
        return EngineFailedError(f"the vLLM engine is failed: {self._failure}")

    async def outputs(self, prompt_ids: list[int], params: Any, request_id: str) -> AsyncIterator[Any]:
        """The engine's raw output stream for one request (the caller admits, bounds and aborts it).

        An async generator, so the prompt is rendered at the first step, inside the caller's bounds
        and error handling, like the engine's own work; closing it closes the engine's stream.
        """
        stream = self._engine.generate(self._prompt_input(list(prompt_ids)), params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        try:
            await asyncio.wait_for(self._engine.abort(request_id), self._deadlines.generate_s)
        except TimeoutError as e:
            await self.fail(f"aborting request {request_id} did not finish within {self._deadlines.generate_s:g} s")
            raise EngineFailedError(f"the vLLM engine is failed: {self._failure}") from e
        except self._dead_errors as e:
            await self.fail(f"the engine process died while aborting request {request_id}: {error_name(e)}: {e}")
            raise EngineFailedError(f"the vLLM engine is failed: {self._failure}") from e

    # --- requests ----------------------------------------------------------------------------
    def sampling_params(self, prompt_ids: list[int], sampling: SamplingRequest) -> Any:
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

    def result(self, final: Any, request_id: str, version: int) -> GenerationResult:
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
        final, version = await self.run(prompt_ids, self.sampling_params(prompt_ids, sampling), request_id)
        return self.result(final, request_id, version)

    async def run(self, prompt_ids: list[int], params: Any, request_id: str) -> tuple[Any, int]:
        """One admitted request within `generate_s`: its final output and the version it ran under."""
        version = await self.admit()
        try:
            return await self._last_output(prompt_ids, params, request_id), version
        finally:
            await self.release()

    async def generate_stream(
        self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str
    ) -> AsyncIterator[StreamStep]:
        """`generate`, step by step (`stream=true` only): each engine output's new token ids as it
        is produced, then one last step carrying the `GenerationResult` (the same exact record
        `generate` returns).

        Admitted through the gate like `generate`; the whole stream is bounded by `generate_s`. A
        consumer that stops early (`aclose`, a client gone) aborts the request in the engine before
        the generator closes; nothing is recorded.
        """
        params = self.sampling_params(prompt_ids, sampling)
        version = await self.admit()
        stream = self.outputs(prompt_ids, params, request_id)
        generate_s = self._deadlines.generate_s
        deadline = time.monotonic() + generate_s
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
                        f"{generate_s:g} s and was aborted"
                    ) from e
                except self._dead_errors as e:
                    finished = True  # nothing left to abort
                    raise await self.died(request_id, e) from e
                final = out
                ids = out.outputs[0].token_ids if out.outputs else []
                if len(ids) > seen:
                    step = StreamStep([int(t) for t in ids[seen:]], None)
                    seen = len(ids)
                    yield step
            finished = True
        finally:
            if not finished:  # a timeout, a failed step, or a consumer that went away mid-stream
                await asyncio.wait_for(stream.aclose(), generate_s)
                await self.abort(request_id)
            await self.release()
        yield StreamStep([], self.result(final, request_id, version))

    def _remember(self, result: GenerationResult) -> None:
        self._records.put(result.request_id, result)

    def records(self, request_ids: list[str]) -> dict[str, GenerationResult]:
        return {rid: record for rid in request_ids if (record := self._records.peek(rid)) is not None}

    # --- the refit gate (the procedure over it is `refit.reload_weights`) --------------------------
    async def close_gate(self, version: int) -> float:
        """Close the gate for a refit to `version` once no other refit runs, and wait (within
        `refit_drain_s`) until no call is in flight; returns the clock when it closed. A drain past
        its deadline, or a cancelled one, reopens the gate with nothing reloaded (`RefitAbortedError`)."""
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
            except BaseException as e:
                # Not drained (deadline or cancelled): nothing was reloaded, so the old weights still serve.
                inflight = self._inflight
                self._state = EngineState.SERVING
                self._refits_aborted += 1
                self._refit_pause_s += self._clock() - closed_at
                self._cond.notify_all()
                if not isinstance(e, TimeoutError):
                    raise
                raise RefitAbortedError(
                    f"refit to version {version} aborted: {inflight} generation(s) still in flight after "
                    f"generation.vllm.refit_drain_timeout_s={self._deadlines.refit_drain_s:g} s; the engine keeps "
                    f"serving version {self.weight_version} (nothing was reloaded)"
                ) from e
        return closed_at

    async def open_gate(self, version: int, closed_at: float) -> None:
        """Reopen the gate closed at `closed_at` after a reload: every later call runs under `version`."""
        async with self._cond:
            self.weight_version = version
            self._state = EngineState.SERVING
            self._refits += 1
            self._refit_pause_s += self._clock() - closed_at
            self._cond.notify_all()

    def shutdown(self) -> None:
        self._engine.shutdown()

