"""The worker's streamed chat completions (`stream=true`), off the default (whole-reply) path.

`open_chat_stream(service, body)` runs every check up to the first token before any byte (the
same `ApiError`s as a whole call), then yields SSE events: the role chunk, content deltas as the
engine produces them (`ContentStreamer`, decoded as `chat.assistant_reply` decodes the finished
reply), and `final_chunks` (the rest of the content, tool calls whole, the finish chunk carrying
`ng_commit_coords`, the usage chunk when asked). An admitted call is opened and finished by the
custody core exactly as a whole one (`stream_admitted`); a consumer that stops early aborts the
generation and the call is `client_disconnected`, never staged. `stream_sse` writes the events
(the worker's HTTP transport); a failure after the first byte is a terminal SSE error event.
Invariant: the concatenated content deltas equal the finished reply's content
(`StreamConsistencyError` otherwise, never a silent rewrite).
See docs/design-docs/vllm-worker-capture.md ("The streamed path").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from nemo_rl.data.errors import ApiError, FatalError
from nemo_rl.models.generation.vllm.custody import CallOpening, CallServing, CustodyCore
from nemo_rl.models.generation.vllm.engine import GenerationResult, GenerationTimeoutError, SamplingRequest, VllmEngine
from nemo_rl.models.generation.vllm.serving import (
    ChatService,
    generated_text,
    new_request_id,
    parses_tool_calls,
    record_generation,
)
from nemo_rl.utils import instrumentation  # opt-in per-call cost (benchmarks/capture_ab.py)

LOGGER = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
HERMES_TOOL_START = "<tool_call>"
CHUNK_OBJECT = "chat.completion.chunk"
DISCONNECT_POLL_S = 0.05  # how often a stream with no event due checks that its client is still there
# The failure of a streamed call whose client went away before its reply was complete (off-chain:
# aborted in the engine, nothing staged, Gym's capture told; the gate ledgers it uncommitted).
CLIENT_DISCONNECTED = "client_disconnected"


class StreamConsistencyError(FatalError, RuntimeError):
    """The content already streamed is not a prefix of the finished reply's content (a bug)."""


def sse_event(payload: Any) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def chunk(request_id: str, model: str, created: int, delta: dict, finish_reason: str | None = None) -> dict:
    """A `chat.completion.chunk` with one choice."""
    return {
        "id": request_id,
        "object": CHUNK_OBJECT,
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, created: int, usage: dict) -> dict:
    """The chunk `stream_options.include_usage` asks for: no choices, the call's usage."""
    return {"id": request_id, "object": CHUNK_OBJECT, "created": created, "model": model, "choices": [],
            "usage": usage}


def hold_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (so they are not streamed yet)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ContentStreamer:
    """Content deltas of one reply as its ids arrive (see the module contract).

    `decode(ids)` renders the ids generated so far the way the finished reply decodes them; the
    whole text is decoded on every push, so a multi-byte character or a merge across tokens is
    never split (the decode cost grows with the reply's length, not with the history's).
    `mode`: "all" streams every character, "until_marker" stops before `HERMES_TOOL_START`,
    "at_end" streams nothing until `final_chunks`.
    """

    def __init__(self, decode: Callable[[list[int]], str], mode: str) -> None:
        if mode not in ("all", "until_marker", "at_end"):
            raise ValueError(f"mode={mode!r}: must be all, until_marker or at_end")
        self._decode = decode
        self._mode = mode
        self._ids: list[int] = []
        self.streamed = ""
        self._stopped = mode == "at_end"

    def push(self, new_ids: list[int]) -> str:
        """The new content these ids make safe to stream ("" when none)."""
        self._ids.extend(new_ids)
        if self._stopped or not new_ids:
            return ""
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        if self._mode == "until_marker":
            at = text.find(HERMES_TOOL_START)
            if at >= 0:
                text, self._stopped = text[:at], True
            else:
                text = text[: len(text) - hold_back(text, HERMES_TOOL_START)]
        if not text.startswith(self.streamed) or len(text) <= len(self.streamed):
            return ""  # a decode that rewrote earlier text (rare merges): wait, the end reconciles
        delta = text[len(self.streamed) :]
        self.streamed = text
        return delta


def content_mode(parse_tools: bool, parser: str) -> str:
    """The `ContentStreamer` mode for a reply (see the module contract)."""
    if not parse_tools:
        return "all"
    return "until_marker" if parser == "hermes" else "at_end"


def streamed_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """Tool calls in OpenAI's streamed delta shape (each whole, with its `index`)."""
    return [
        {"index": i, "id": call["id"], "type": call.get("type", "function"),
         "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}
        for i, call in enumerate(tool_calls)
    ]


def final_chunks(reply: dict, streamed: str, *, include_usage: bool) -> list[dict]:
    """The chunks that close a stream whose content so far is `streamed` (module contract).

    `reply` is the finished chat completion; its `ng_commit_coords` (when present) rides on the
    finish chunk, the one a relay must read before it lets `[DONE]` through.
    """
    request_id, model, created = reply["id"], reply["model"], reply["created"]
    choice = reply["choices"][0]
    message = choice["message"]
    content = message.get("content")
    if not (content or "").startswith(streamed):
        raise StreamConsistencyError(
            f"stream {request_id}: streamed content {streamed[-40:]!r}... is not a prefix of the reply's content"
        )
    out: list[dict] = []
    rest = (content or "")[len(streamed) :]
    if rest:
        out.append(chunk(request_id, model, created, {"content": rest}))
    if message.get("tool_calls"):
        out.append(chunk(request_id, model, created, {"tool_calls": streamed_tool_calls(message["tool_calls"])}))
    finish = chunk(request_id, model, created, {}, choice["finish_reason"])
    if "ng_commit_coords" in reply:
        finish["ng_commit_coords"] = reply["ng_commit_coords"]
    out.append(finish)
    if include_usage:
        out.append(usage_chunk(request_id, model, created, reply["usage"]))
    return out


def replay_chunks(reply: dict, *, include_usage: bool) -> list[dict]:
    """A finished reply as a whole stream (a re-send replayed): the role chunk, then `final_chunks`."""
    first = chunk(reply["id"], reply["model"], reply["created"], {"role": "assistant", "content": ""})
    return [first, *final_chunks(reply, "", include_usage=include_usage)]


def include_usage(body: dict) -> bool:
    """`stream_options.include_usage` of a streamed request (`data.calls` checked its shape)."""
    options = body.get("stream_options")
    return bool(isinstance(options, dict) and options.get("include_usage"))


# --- the engine's streamed generation ---------------------------------------------------------


@dataclass(frozen=True)
class StreamStep:
    """One step of `generate_stream`: new sampled ids, or (last) the finished result."""

    new_token_ids: list[int]
    result: GenerationResult | None


async def generate_stream(
    engine: VllmEngine, prompt_ids: list[int], sampling: SamplingRequest, request_id: str
) -> AsyncIterator[StreamStep]:
    """`engine.generate`, step by step: each engine output's new token ids as it is produced, then
    one last step carrying the `GenerationResult` (the same exact record `generate` returns).

    Admitted through the engine's gate like `generate`; the whole stream is bounded by
    `generate_s`. A consumer that stops early (`aclose`, a client gone) aborts the request in the
    engine before the generator closes; nothing is recorded.
    """
    params = engine.sampling_params(prompt_ids, sampling)
    version = await engine.admit()
    stream = engine.outputs(prompt_ids, params, request_id)
    generate_s = engine.deadlines.generate_s
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
            except engine.dead_errors as e:
                finished = True  # nothing left to abort
                raise await engine.died(request_id, e) from e
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
            await engine.abort(request_id)
        await engine.release()
    yield StreamStep([], engine.result(final, request_id, version))


# --- the worker core's streamed call ---------------------------------------------------------


async def open_chat_stream(service: ChatService, body: Any) -> AsyncIterator[bytes]:
    """A `stream=true` chat completion: every check up to the first token runs here (an `ApiError`
    before any byte is sent); returns the SSE events (role chunk, content deltas as the engine
    produces them, `final_chunks`). An admitted call is staged and committed exactly as
    `ChatService.chat_completions` does before its finish chunk (which carries `ng_commit_coords`)."""
    messages, tools, sampling = service.parse_chat(body, streamed=True)
    usage = include_usage(body)
    request_id = new_request_id()
    raw_admission = body.get("ng_capture")
    if raw_admission is None:
        parse_tools = parses_tool_calls(tools, body.get("tool_choice"))
        prompt_ids = service.render_root(messages, tools)
        sampling = service.fit_context(prompt_ids, sampling)
        steps = _plain_steps(service, prompt_ids, sampling, request_id, parse_tools)
        return _sse(service, request_id, steps, content_mode(parse_tools, service.tool_call_parser), usage)
    custody = service.require_custody()
    opening = await custody.open_call(body, raw_admission, messages, tools, sampling, service)
    if opening.replay is not None:
        return _replayed(opening.replay, usage)
    steps = stream_admitted(custody, opening, service, _admitted_steps(service, opening, request_id), request_id)
    return _sse(service, request_id, steps, content_mode(True, service.tool_call_parser), usage)


async def _plain_steps(
    service: ChatService, prompt_ids: list[int], sampling: SamplingRequest, request_id: str, parse_tools: bool
) -> AsyncIterator[Any]:
    steps = _engine_steps(service, prompt_ids, sampling, request_id)
    async with contextlib.aclosing(steps):
        async for step in steps:
            if step.result is None:
                yield step.new_token_ids
                continue
            yield service.plain_reply(step.result, sampling, parse_tools=parse_tools)


def _admitted_steps(service: ChatService, opening: CallOpening, request_id: str) -> AsyncIterator[Any]:
    """The engine's steps for an opened admitted call (its planned prompt and sampling)."""
    assert opening.plan is not None, "a replayed opening has nothing to generate"
    return _engine_steps(service, opening.plan.prompt_ids, opening.plan.sampling, request_id)


async def _engine_steps(
    service: ChatService, prompt_ids: list[int], sampling: SamplingRequest, request_id: str
) -> AsyncIterator[Any]:
    """The engine's steps for one streamed call, engine errors mapped as `ChatService.generate` maps them."""
    started = time.perf_counter()
    first = True
    with service.engine_errors():
        async with contextlib.aclosing(service.engine.generate_stream(prompt_ids, sampling, request_id)) as steps:
            async for step in steps:
                if first:
                    instrumentation.set_call_fact("first_token_s", time.perf_counter() - started)
                    first = False
                if step.result is not None:
                    record_generation(started, prompt_ids, step.result)
                yield step


async def stream_admitted(
    custody: CustodyCore, opening: CallOpening, serving: CallServing, steps: AsyncIterator[Any], request_id: str
) -> AsyncIterator[Any]:
    """Generate an opened call step by step: yields each step's new ids (a list), then the reply
    (a dict, `ng_commit_coords` included) once `custody.finish` staged it as a whole call is.

    A consumer that stops before the reply (the client went away) leaves the call aborted in
    the engine, abandoned in custody (`CLIENT_DISCONNECTED`, with the tokens generated so far,
    recorded served, not staged, its id spoiled): an off-chain outcome, never staged.
    """
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
            _disconnected(custody, opening, generated)
        raise
    except BaseException:
        custody.release(opening)  # not generated to the end: nothing staged under this id
        raise
    finally:
        await steps.aclose()  # aborts an unfinished generation in the engine
    if result is None:
        custody.release(opening)
        raise ApiError("worker_failed", f"request {request_id}: the engine stream ended without a result")
    yield await custody.finish(opening, result, serving)


def _disconnected(custody: CustodyCore, opening: CallOpening, generated: int) -> None:
    custody.abandon(opening, generated, CLIENT_DISCONNECTED)
    LOGGER.warning("client went away mid-stream: rollout=%s call=%s aborted after %d token(s), not staged",
                   *opening.key, generated)


async def _sse(
    service: ChatService, request_id: str, steps: AsyncIterator[Any], mode: str, usage: bool
) -> AsyncIterator[bytes]:
    """SSE events of one stream: `steps` yields new ids (lists), then the finished reply (a dict).

    The role chunk is yielded once the first step is in (generation started), so a consumer
    that stops at any yield finds `steps` running and its close records the call."""
    created = int(time.time())
    model = service.model_name
    streamer = ContentStreamer(_stream_decoder(service, mode), mode)
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


def _stream_decoder(service: ChatService, mode: str) -> Callable[[list[int]], str]:
    tokenizer = service.tokenizer
    eos = tokenizer.eos_token_id
    if mode == "all":
        return lambda ids: generated_text(tokenizer, ids)
    # What `assistant_reply` parses for hermes: special tokens kept, the closing stop token dropped.
    return lambda ids: tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=False)


async def _replayed(reply: dict, usage: bool) -> AsyncIterator[bytes]:
    """A committed reply re-sent as a whole stream (a byte-identical re-send of a streamed call)."""
    for event in replay_chunks(reply, include_usage=usage):
        yield sse_event(event)


# --- the HTTP side: SSE on the wire --------------------------------------------------------------


async def stream_sse(request: web.Request, events: AsyncIterator[bytes]) -> web.StreamResponse:
    """Write `events` as they come, then `data: [DONE]`. The response starts with the first event
    (generation under way): a failure before it is a JSON error, one after it a terminal SSE error
    event (no `[DONE]`). A client gone mid-stream (a write fails, or the connection closes
    while no event is due: checked every `DISCONNECT_POLL_S`) closes `events`, which aborts and
    records the call (`stream_admitted`'s part), and the handler ends quietly."""
    try:
        first = await anext(events)  # generation started: a failure before it is still a JSON error
    except BaseException:
        await events.aclose()
        raise
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    step: asyncio.Future | None = None
    try:
        await response.prepare(request)
        await response.write(first)
        while True:
            step = asyncio.ensure_future(anext(events, None))
            event = await _step_or_gone(request, step)
            if event is None:
                break
            await response.write(event)
        await response.write(SSE_DONE)
    except ApiError as e:
        await response.write(sse_event(e.body()))
    except ConnectionResetError:
        LOGGER.info("client went away mid-stream on %s", request.path)
        return response
    finally:
        if step is not None and not step.done():  # the handler was cancelled (aiohttp: the client went away)
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)  # the step's own cleanup aborts the generation
        await events.aclose()
    await response.write_eof()
    return response


async def _step_or_gone(request: web.Request, step: asyncio.Future) -> bytes | None:
    """The step's event (None at the end); `ConnectionResetError` once the client's connection is
    closed while the step is still waiting (the step is then cancelled by the caller)."""
    while True:
        done, _ = await asyncio.wait({step}, timeout=DISCONNECT_POLL_S)
        if done:
            return step.result()
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the client closed the connection mid-stream")
