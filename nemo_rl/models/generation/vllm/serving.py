"""The worker's one orchestrator: every chat completion, whole or streamed, plain or admitted.

`ChatService` (`http` is a thin shell over it) checks the request, renders it and builds the
reply (`chat`), asks the engine for ids (`engine`) and drives an admitted (`ng_capture`) call
through `custody.CustodyCore` step by step (open, plan, finish; no callbacks). Promises: a plain
call is answered as stock vLLM would; an admitted call's prompt is the parent's exact ids plus
the newly rendered tail (never re-tokenized history), its reply without token echo. Refuses, by
a named `ApiError`, a template refusal, a context overflow and a tail that cannot be placed
exactly (`TailRenderError`: `capture_failed`, never a silently different prompt); anything else
is a bug that propagates. `stream=true` (`chat_completions_stream`): every check up to the first
token runs before any byte; a consumer that stops early aborts the generation and the call is
`client_disconnected`, never staged. `chat_service` builds the worker's service.
See docs/design-docs/vllm-worker-capture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any, Protocol

from jinja2 import TemplateError

from nemo_rl.data.calls import RequestFieldError, ServedCall, check_chat_request, has_assistant_turn
from nemo_rl.data.errors import ApiError
from nemo_rl.models.generation.vllm.chat import (
    HERMES,
    ChatTemplateTokenizer,
    ContentStreamer,
    ToolParser,
    assistant_reply,
    build_chat_completion,
    chat_tools,
    chunk,
    content_mode,
    context_overflow_message,
    final_chunks,
    include_usage,
    new_request_id,
    normalize_messages,
    parses_tool_calls,
    probe_turn_end,
    render_root_prompt,
    render_token_in_tail,
    replay_chunks,
    sampled_turn_close,
    sampling_from_body,
    sse_event,
    stream_decoder,
)
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.custody import CallOpening, CallPlan, CustodyCore
from nemo_rl.models.generation.vllm.engine import GenerationResultLike, SamplingRequest, StreamStep
from nemo_rl.models.generation.vllm.errors import (
    EngineFailedError,
    GenerationTimeoutError,
    InvalidChatRequest,
    RefitGateTimeoutError,
    TailRenderError,
    TemplateProbeError,
)
from nemo_rl.models.generation.vllm.tool_parsers import get_tool_call_parser
from nemo_rl.utils import instrumentation  # opt-in per-call cost (benchmarks/capture_ab.py)

LOGGER = logging.getLogger(__name__)

# The failure of a streamed call whose client went away before its reply was complete (off-chain:
# aborted in the engine, nothing staged, Gym's capture told; the gate ledgers it uncommitted).
CLIENT_DISCONNECTED = "client_disconnected"


def record_generation(started: float, prompt_ids: list[int], result: GenerationResultLike) -> None:
    """The engine's part of one call's cost (both paths; read by benchmarks/capture_ab.py)."""
    instrumentation.add_call_cost("generate_s", time.perf_counter() - started)
    instrumentation.set_call_fact("generate_t0_s", started)
    instrumentation.set_call_fact("prompt_tokens", len(prompt_ids))
    instrumentation.set_call_fact("generated_tokens", len(result.token_ids))


class Generator(Protocol):
    """What the service asks of the engine (`engine.VllmEngine`; unit tests pass their own)."""

    weight_version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> GenerationResultLike: ...

    def generate_stream(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> AsyncIterator[StreamStep]: ...


def chat_service(engine: Any, tokenizer: Any, gen: GenerationConfig, custody: CustodyCore | None) -> ChatService:
    """The worker's `ChatService` over its engine (custody None: token capture off); the chat
    template's end-of-turn is probed and the tool-call parser resolved here, once."""
    return ChatService(
        engine,
        tokenizer,
        model_name=gen.model_name,
        default_max_tokens=gen.max_new_tokens,
        max_model_len=gen.vllm.max_model_len,
        turn_end=probe_turn_end(tokenizer),
        tool_call_parser=get_tool_call_parser(gen.tool_call_parser),
        custody=custody,
    )


class ChatService:
    """Chat completions over an exact-id engine; admitted calls go through `custody` (None: capture off)."""

    def __init__(
        self,
        engine: Generator,
        tokenizer: ChatTemplateTokenizer,
        *,
        model_name: str,
        default_max_tokens: int,
        max_model_len: int,
        turn_end: str | TemplateProbeError,
        tool_call_parser: ToolParser = HERMES,
        custody: CustodyCore | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 1")
        self._engine = engine
        self._tokenizer = tokenizer
        self._parser = tool_call_parser
        # The template's end-of-turn text, probed once at set-up (`chat.probe_turn_end`); a failed
        # probe makes every token-in call capture_failed (plain and ROOT calls are unaffected).
        self._turn_end = turn_end
        self._model_name = model_name
        self._default_max_tokens = default_max_tokens
        self._max_model_len = max_model_len
        self.custody = custody
        self._stats: Counter[str] = Counter()

    @property
    def stats(self) -> Counter[str]:
        """Call counters: this layer's (plain calls, refusals) plus the custody core's (a snapshot)."""
        return self._stats + self.custody.stats if self.custody is not None else Counter(self._stats)

    @property
    def weight_version(self) -> int:
        return self._engine.weight_version

    @property
    def engine(self) -> Generator:
        return self._engine

    @property
    def tokenizer(self) -> ChatTemplateTokenizer:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tool_call_parser(self) -> str:
        return self._parser.name

    # --- requests ------------------------------------------------------------------------------

    def parse_chat(self, body: Any, *, streamed: bool) -> tuple[list[dict], list[dict] | None, SamplingRequest]:
        """The checked request's messages, tools and sampling (`ApiError` 400 naming the field otherwise)."""
        try:
            check_chat_request(body, max_model_len=self._max_model_len)
            if streamed and body.get("ng_capture") is None and (body.get("logprobs") or body.get("return_token_ids")):
                raise RequestFieldError("logprobs", "logprobs and return_token_ids are not streamed by this worker "
                                        "(fix: send them without stream=true)")
        except RequestFieldError as e:
            raise ApiError("invalid_request", e.message, param=e.field) from e
        try:
            messages = normalize_messages(body.get("messages"))
            tools = chat_tools(body.get("tools"))
            sampling = sampling_from_body(body, default_max_tokens=self._default_max_tokens)
        except InvalidChatRequest as e:
            raise ApiError("invalid_request", str(e)) from e
        return messages, tools, sampling

    async def chat_completions(self, body: Any) -> dict:
        """One whole chat completion (an admitted call's reply carries `ng_commit_coords`)."""
        messages, tools, sampling = self.parse_chat(body, streamed=False)
        raw_admission = body.get("ng_capture")
        if raw_admission is None:
            return await self._serve_plain(
                messages, tools, sampling, parse_tools=parses_tool_calls(tools, body.get("tool_choice"))
            )
        opened = await self._open_admitted(body, raw_admission, messages, tools, sampling)
        if isinstance(opened, CallOpening):
            assert opened.replay is not None, "an opening that was not planned is a replay"
            return opened.replay
        try:
            result = await self.generate(opened.prompt_ids, opened.sampling)
        except BaseException:
            # Refused or not generated (timeout, failed engine): nothing was staged under this id, so a
            # retry of the same call (Gym's client retries 5xx with the same body) may use it.
            self.require_custody().release(opened)
            raise
        return await self.require_custody().finish(opened, result, self.reply(result))

    async def chat_completions_stream(self, body: Any) -> AsyncIterator[bytes]:
        """A `stream=true` chat completion: every check up to the first token runs here (an `ApiError`
        before any byte is sent); returns the SSE events (role chunk, content deltas as the engine
        produces them, `chat.final_chunks`). An admitted call is staged and committed exactly as
        `chat_completions` does before its finish chunk (which carries `ng_commit_coords`)."""
        messages, tools, sampling = self.parse_chat(body, streamed=True)
        usage = include_usage(body)
        request_id = new_request_id()
        raw_admission = body.get("ng_capture")
        if raw_admission is None:
            parse_tools = parses_tool_calls(tools, body.get("tool_choice"))
            prompt_ids = self.render_root(messages, tools)
            sampling = self.fit_context(prompt_ids, sampling)
            steps = self._plain_steps(prompt_ids, sampling, request_id, parse_tools)
            return self._sse(request_id, steps, content_mode(parse_tools, self.tool_call_parser), usage)
        opened = await self._open_admitted(body, raw_admission, messages, tools, sampling)
        if isinstance(opened, CallOpening):
            assert opened.replay is not None, "an opening that was not planned is a replay"
            return _replayed(opened.replay, usage)
        steps = self._stream_admitted(opened, request_id)
        return self._sse(request_id, steps, content_mode(True, self.tool_call_parser), usage)

    def tokenize(self, body: Any, *, max_model_len: int) -> dict:
        """`/tokenize` as stock vLLM answers it: `{"tokens", "count"}` of the body's chat (rendered as
        the chat route renders a ROOT prompt) or of its `prompt` string (no special tokens added)."""
        if not isinstance(body, dict):
            raise ApiError("invalid_request", "request body must be a JSON object", param="body")
        try:
            if "messages" in body:
                check_chat_request({"messages": body["messages"], "tools": body.get("tools")}, max_model_len=max_model_len)
                ids = self.render_root(normalize_messages(body["messages"]), chat_tools(body.get("tools")))
            elif isinstance(body.get("prompt"), str):
                ids = self._tokenizer.encode(body["prompt"], add_special_tokens=False)
            else:
                raise RequestFieldError("messages", "tokenize needs `messages` (chat) or `prompt` (a string)")
        except RequestFieldError as e:
            raise ApiError("invalid_request", e.message, param=e.field) from e
        except InvalidChatRequest as e:
            raise ApiError("invalid_request", str(e)) from e
        return {"tokens": ids, "count": len(ids)}

    def require_custody(self) -> CustodyCore:
        """The custody core an admitted (`ng_capture`) call needs, whole or streamed; 400 without one."""
        if self.custody is None:
            raise ApiError(
                "capture_not_installed",
                "request carries ng_capture but token capture is not installed on this worker "
                "(set token_capture.enabled=true, or point the gate at a capture-off worker)",
                param="ng_capture",
            )
        return self.custody

    def take_served(self, rollout_ids: list[str]) -> list[ServedCall]:
        """Pop the served-call records of `rollout_ids` (`CustodyCore.take_served`; none without custody)."""
        return self.custody.take_served(rollout_ids) if self.custody is not None else []

    # --- prompts -------------------------------------------------------------------------------

    def render_root(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The whole conversation through the model's template; a template refusal is the caller's 400."""
        try:
            return render_root_prompt(self._tokenizer, messages, tools)
        except TemplateError as e:  # templates `raise_exception` on conversations they do not accept
            raise ApiError(
                "invalid_request", f"the model's chat template cannot render these messages: {e}", param="messages"
            ) from e

    def render_tail(self, messages: list[dict], tools: list[dict] | None, prefix: list[int]) -> list[int]:
        """The token-in tail after `prefix` (`TailRenderError` when it cannot be exact; a template refusal is 400)."""
        if isinstance(self._turn_end, TemplateProbeError):
            raise TailRenderError(f"no end-of-turn marker: {self._turn_end}")
        try:
            return render_token_in_tail(
                self._tokenizer,
                messages,
                tools,
                turn_end=self._turn_end,
                sampled_close=sampled_turn_close(self._tokenizer, prefix),
            )
        except TemplateError as e:
            raise ApiError(
                "invalid_request", f"the model's chat template cannot render these messages: {e}", param="messages",
            ) from e

    def fit_context(self, prompt_ids: list[int], sampling: SamplingRequest) -> SamplingRequest:
        """400 on context overflow; otherwise the sampling with max_tokens clipped to the room left."""
        requested = sampling.max_tokens if sampling.max_tokens_explicit else None
        message = context_overflow_message(len(prompt_ids), requested, self._max_model_len)
        if message is not None:
            self._stats["context_length_exceeded"] += 1
            field = "messages" if len(prompt_ids) >= self._max_model_len else "max_tokens"
            raise ApiError("context_length_exceeded", message, param=field)
        room = self._max_model_len - len(prompt_ids)
        return sampling if sampling.max_tokens <= room else replace(sampling, max_tokens=room)

    # --- admitted calls: custody step by step ----------------------------------------------------

    async def _open_admitted(
        self,
        body: Any,
        raw_admission: Any,
        messages: list[dict],
        tools: list[dict] | None,
        sampling: SamplingRequest,
    ) -> CallOpening | CallPlan:
        """An admitted call opened by custody and planned over the prompt rendered here (any refusal
        raises, the id released), or the replay opening of a re-send. Whoever generates the plan
        then ends it with exactly one of `finish`, `release` or `abandon`."""
        custody = self.require_custody()
        opening = await custody.open(body, raw_admission)
        if opening.replay is not None:
            return opening
        try:
            prompt_ids, tail_error = self._admitted_prompt(opening.prefix, messages, tools)
            sampling = self.fit_context(prompt_ids, sampling)  # before any capture lifecycle step
            return custody.plan(
                opening, prompt_ids=prompt_ids, tail_error=tail_error, sampling=sampling,
                weight_version=self.weight_version, history_has_assistant_turn=has_assistant_turn(messages),
            )
        except BaseException:
            custody.release(opening)
            raise

    def _admitted_prompt(
        self, prefix: list[int] | None, messages: list[dict], tools: list[dict] | None
    ) -> tuple[list[int], str | None]:
        """The prompt of an admitted call and why it is not captured (None: it is): a ROOT's whole
        render, or the parent's exact ids plus the new tail."""
        if prefix is None:
            return self.render_root(messages, tools), None
        try:
            return prefix + self.render_tail(messages, tools, prefix), None
        except TailRenderError as e:
            # Serve the turn from the re-rendered conversation, but never as captured.
            return self.render_root(messages, tools), f"tail_render_failed: {e}"

    # --- generation and replies ------------------------------------------------------------------

    async def _serve_plain(
        self, messages: list[dict], tools: list[dict] | None, sampling: SamplingRequest, *, parse_tools: bool
    ) -> dict:
        prompt_ids = self.render_root(messages, tools)
        sampling = self.fit_context(prompt_ids, sampling)
        return self.plain_reply(await self.generate(prompt_ids, sampling), sampling, parse_tools=parse_tools)

    def plain_reply(self, result: GenerationResultLike, sampling: SamplingRequest, *, parse_tools: bool) -> dict:
        """A plain (capture-off) call's reply, with the token echo its request asked for; counted served."""
        self._stats["plain_calls"] += 1
        self._stats["served_calls"] += 1
        return self._response(
            result,
            include_logprobs=sampling.logprobs,
            include_token_ids=sampling.return_token_ids,
            parse_tools=parse_tools,
            tokens_as_ids=sampling.return_tokens_as_token_ids,
        )

    def reply(self, result: GenerationResultLike) -> dict:
        """An admitted call's reply: no token echo, whatever the request asked."""
        return self._response(result, include_logprobs=False, include_token_ids=False)

    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest) -> GenerationResultLike:
        started = time.perf_counter()
        with self.engine_errors():
            result = await self._engine.generate(prompt_ids, sampling, new_request_id())
            record_generation(started, prompt_ids, result)
            return result

    @contextlib.contextmanager
    def engine_errors(self) -> Iterator[None]:
        """The engine's failures as the `ApiError`s the transport answers (one mapping for both paths)."""
        try:
            yield
        except InvalidChatRequest as e:
            raise ApiError("invalid_request", str(e)) from e
        except EngineFailedError as e:
            raise ApiError("worker_failed", str(e)) from e
        except GenerationTimeoutError as e:
            self._stats["generation_timeout"] += 1
            raise ApiError("generation_timeout", str(e)) from e
        except RefitGateTimeoutError as e:
            raise ApiError("worker_refitting", str(e)) from e

    def _response(
        self,
        result: GenerationResultLike,
        *,
        include_logprobs: bool,
        include_token_ids: bool,
        parse_tools: bool = True,
        tokens_as_ids: bool = True,
    ) -> dict:
        parsed = assistant_reply(
            self._tokenizer, result.token_ids, parser=self._parser, parse_tools=parse_tools
        )
        return build_chat_completion(
            request_id=result.request_id,
            model=self._model_name,
            parsed=parsed,
            finish_reason=result.finish_reason,
            prompt_token_ids=result.prompt_token_ids,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            include_logprobs=include_logprobs,
            include_token_ids=include_token_ids,
            # vLLM names a logprob entry by the token's own text unless asked for `token_id:N`.
            logprob_tokens=None if tokens_as_ids or not include_logprobs else [
                self._tokenizer.decode([t], skip_special_tokens=False) for t in result.token_ids
            ],
        )

    # --- the streamed path -----------------------------------------------------------------------

    async def _plain_steps(
        self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str, parse_tools: bool
    ) -> AsyncIterator[Any]:
        steps = self._engine_steps(prompt_ids, sampling, request_id)
        async with contextlib.aclosing(steps):
            async for step in steps:
                if step.result is None:
                    yield step.new_token_ids
                    continue
                yield self.plain_reply(step.result, sampling, parse_tools=parse_tools)

    async def _engine_steps(
        self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str
    ) -> AsyncIterator[StreamStep]:
        """The engine's steps for one streamed call, engine errors mapped as `generate` maps them."""
        started = time.perf_counter()
        first = True
        with self.engine_errors():
            async with contextlib.aclosing(self._engine.generate_stream(prompt_ids, sampling, request_id)) as steps:
                async for step in steps:
                    if first:
                        instrumentation.set_call_fact("first_token_s", time.perf_counter() - started)
                        first = False
                    if step.result is not None:
                        record_generation(started, prompt_ids, step.result)
                    yield step

    async def _stream_admitted(self, plan: CallPlan, request_id: str) -> AsyncIterator[Any]:
        """Generate a planned call step by step: yields each step's new ids (a list), then the reply
        (a dict, `ng_commit_coords` included) once `custody.finish` staged it as a whole call is.

        A consumer that stops before the reply (the client went away) leaves the call aborted in
        the engine, abandoned in custody (`CLIENT_DISCONNECTED`, with the tokens generated so far,
        recorded served, not staged, its id spoiled): an off-chain outcome, never staged.
        """
        custody = self.require_custody()
        steps = self._engine_steps(plan.prompt_ids, plan.sampling, request_id)
        generated, result = 0, None
        try:
            async for step in steps:
                if step.result is not None:
                    result = step.result
                    break
                generated += len(step.new_token_ids)
                yield step.new_token_ids
        except (GeneratorExit, asyncio.CancelledError):
            if result is None:
                custody.abandon(plan, generated, CLIENT_DISCONNECTED)
                LOGGER.warning("client went away mid-stream: rollout=%s call=%s aborted after %d token(s), not staged",
                               *plan.key, generated)
            raise
        except BaseException:
            custody.release(plan)  # not generated to the end: nothing staged under this id
            raise
        finally:
            await steps.aclose()  # aborts an unfinished generation in the engine
        if result is None:
            custody.release(plan)
            raise ApiError("worker_failed", f"request {request_id}: the engine stream ended without a result")
        yield await custody.finish(plan, result, self.reply(result))

    async def _sse(self, request_id: str, steps: AsyncIterator[Any], mode: str, usage: bool) -> AsyncIterator[bytes]:
        """SSE events of one stream: `steps` yields new ids (lists), then the finished reply (a dict).

        The role chunk is yielded once the first step is in (generation started), so a consumer
        that stops at any yield finds `steps` running and its close records the call."""
        created = int(time.time())
        model = self._model_name
        streamer = ContentStreamer(stream_decoder(self._tokenizer, mode), mode)
        try:
            item = await anext(steps, None)
            yield sse_event(chunk(request_id, model, created, {"role": "assistant", "content": ""}))
            while item is not None:
                if isinstance(item, dict):
                    for event in final_chunks({**item, "created": created}, streamer.streamed, include_usage=usage):
                        yield sse_event(event)
                    return
                delta = streamer.push(item)
                if delta:
                    yield sse_event(chunk(request_id, model, created, {"content": delta}))
                item = await anext(steps, None)
        finally:
            await steps.aclose()  # a consumer gone mid-stream: the generation is aborted, the call recorded


async def _replayed(reply: dict, usage: bool) -> AsyncIterator[bytes]:
    """A committed reply re-sent as a whole stream (a byte-identical re-send of a streamed call)."""
    for event in replay_chunks(reply, include_usage=usage):
        yield sse_event(event)
