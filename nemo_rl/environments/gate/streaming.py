"""The gate's streamed chat path: relay the worker's SSE chunk by chunk, ledger the call before `[DONE]`.

`streamed_chat(model, request, body, stream)` is Gym's chat dispatch for `stream: true` (Gym's own
body mapping, parent resolution and call intent, in Gym's order); `WorkerStream` opens the worker's
stream under a read deadline and answers a worker error as the gate answers a whole call's.
`ChunkAssembler` folds the chunks into the `chat.completion` the client now holds and keeps the
worker's `ng_commit_coords`, which never reach the client. `relay_stream` forwards every chunk as it
arrives and, on `[DONE]`, commits (Gym's `prepare_response` + `finalize_response`: the ledger row of
a whole call) before it lets `[DONE]` through. Invariants: the client sees `[DONE]` only after the
ledger row is written; a stream that ends otherwise (the worker's error event, a cut connection, a
client gone) never commits, so Gym records the call uncommitted (off-chain). `relay_events` is the
same custody for a typed dialect (`gate.responses`, `gate.messages`): its `EventSequence` builds the
events, the commit comes before its closing events, any other ending is its failure event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from nemo_gym.base_responses_api_model import _request_messages, _validate_chat_params
from nemo_gym.chat_streaming import sanitize_streaming_chat_body
from nemo_gym.openai_utils import NeMoGymChatCompletion
from nemo_gym.token_id_capture.sink import current_capture_context, register_call_intent, resolve_parent
from nemo_rl.data.errors import RecoverableError, error_name
from responses_api_models.vllm_model.app import VLLMModel

DONE = "[DONE]"
SSE_DONE = b"data: [DONE]\n\n"
COORDS_FIELD = "ng_commit_coords"


class StreamRelayError(RecoverableError, ValueError):
    """The worker's stream cannot be relayed: not OpenAI-format SSE (an event that is not JSON, a chunk of
    another shape), or a typed dialect's final reply unlike what was streamed or unconvertible."""


def sse_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def error_event(message: str, err_type: str = "upstream_error", code: int = 502) -> bytes:
    """A terminal SSE error event (Gym's capture middleware treats it as the stream's end)."""
    return sse_event({"error": {"message": message, "type": err_type, "param": None, "code": code}})


class SseSplitter:
    """Cuts SSE bytes into the `data` payloads of complete events (comments and other fields dropped)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data.replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = []
        for event in events:
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode("utf-8"))
        return out

    @property
    def pending(self) -> bytes:
        return self._buffer


class ChunkAssembler:
    """The `chat.completion` a stream of chunks adds up to (see the module contract)."""

    def __init__(self) -> None:
        self.head: dict[str, Any] | None = None
        self.content: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.coords: dict | None = None

    def add(self, chunk: Any) -> dict:
        """Fold one chunk in; returns it without `ng_commit_coords` (what the client gets)."""
        if not isinstance(chunk, dict) or chunk.get("object") != "chat.completion.chunk":
            raise StreamRelayError(f"the worker streamed a {type(chunk).__name__} that is not a chat.completion.chunk")
        if COORDS_FIELD in chunk:
            chunk = dict(chunk)
            self.coords = chunk.pop(COORDS_FIELD)
        if self.head is None:
            self.head = {"id": chunk["id"], "created": chunk["created"], "model": chunk["model"]}
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                self._merge_call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return chunk

    def _merge_call(self, call: dict) -> None:
        slot = self.tool_calls.setdefault(int(call["index"]), {"id": None, "type": "function",
                                                               "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        function = call.get("function") or {}
        slot["function"]["name"] += function.get("name") or ""
        slot["function"]["arguments"] += function.get("arguments") or ""

    def completion(self) -> dict:
        """The assembled completion (with `ng_commit_coords` when the worker sent them)."""
        if self.head is None or self.finish_reason is None:
            raise StreamRelayError("the worker's stream ended before a chunk with a finish_reason")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        out: dict[str, Any] = {
            **self.head,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason, "logprobs": None}],
        }
        if self.usage is not None:
            out["usage"] = self.usage
        if self.coords is not None:
            out[COORDS_FIELD] = self.coords
        return out


CUT_OFF = "the vLLM worker's stream ended before data: [DONE]; the call is not committed"


async def worker_stream(upstream: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, dict]]:
    """The worker's chat SSE as `("chunk", chunk)` per chunk (its coordinates kept aside), then either
    `("done", completion)` on `[DONE]` or `("error", chunk)` for the worker's own terminal error event;
    it ends without either when the stream was cut. Raises `StreamRelayError` for a non-JSON event."""
    splitter, assembler = SseSplitter(), ChunkAssembler()
    async for data in upstream:
        for payload in splitter.feed(data):
            if payload == DONE:
                yield "done", assembler.completion()
                return
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError as e:
                raise StreamRelayError(f"the worker streamed an event that is not JSON: {payload[:200]!r}") from e
            if isinstance(chunk, dict) and chunk.get("error") is not None:
                yield "error", chunk
                return
            yield "chunk", assembler.add(chunk)


async def relay_stream(
    upstream: AsyncIterator[bytes], commit: Callable[[dict], Awaitable[None]]
) -> AsyncIterator[bytes]:
    """Forward the worker's SSE bytes as events (module contract); `commit(completion)` before `[DONE]`."""
    async for kind, value in worker_stream(upstream):
        if kind == "done":
            await commit(value)
            yield SSE_DONE
            return
        yield sse_event(value)  # a chunk, or the worker's own terminal error: passed on, nothing committed
        if kind == "error":
            return
    yield error_event(CUT_OFF)


# --- typed event streams (Responses, Anthropic Messages): one skeleton, events built per dialect --


def tool_call_delta(call: dict, started: bool) -> tuple[int, dict, str]:
    """A streamed tool-call delta's index, function and argument pieces; the first delta of a call
    (`started` False) must name its id and function, as the typed events open a block with them."""
    index = int(call["index"])
    function = call.get("function") or {}
    if not started and (not call.get("id") or not function.get("name")):
        raise StreamRelayError(f"the worker's tool call {index} started without an id and a name: {call}")
    return index, function, function.get("arguments") or ""


def typed_sse(payload: dict) -> bytes:
    """One typed SSE event: `event: <type>` and its JSON `data` (the lines Gym's capture reads)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode("utf-8")


class EventSequence(Protocol):
    """One streamed call's events in a typed dialect, built from the worker's chat chunks."""

    def on_chunk(self, chunk: dict) -> list[dict]: ...  # the events one client-side chunk adds

    def settle(self, final: dict) -> dict: ...  # `final` given the streamed ids; StreamRelayError if it differs

    def closing(self, final: dict) -> list[dict]: ...  # the events after the commit, the terminal one last

    def failed(self, message: str) -> dict: ...  # the terminal event of a stream that did not finish


async def relay_events(
    upstream: AsyncIterator[bytes], events: EventSequence, to_final: Callable[[dict], dict],
    commit: Callable[[dict], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """Typed events from the worker's chat SSE; on `[DONE]`: `to_final(completion)`, settle,
    `commit(final)`, then the closing events. Any other ending is `events.failed`, nothing committed."""
    async for kind, value in worker_stream(upstream):
        if kind == "done":
            final = events.settle(to_final(value))
            await commit(final)
            for event in events.closing(final):
                yield typed_sse(event)
            return
        if kind == "error":
            error = value["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            yield typed_sse(events.failed(f"the vLLM worker's stream failed: {message}; not committed"))
            return
        for event in events.on_chunk(value):
            yield typed_sse(event)
    yield typed_sse(events.failed(CUT_OFF))


# --- the dispatch: Gym's steps, then the worker's stream relayed ----------------------------------

Relay = Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]  # the worker's SSE bytes -> the client's events
Refused = Callable[[int, bytes], tuple[int, Any]]  # a worker error (status, body) -> the gate's (status, JSON)


@dataclass(frozen=True)
class WorkerStream:
    """Opens a streamed call to the worker: `read_timeout_s` to connect and between two reads; a worker
    error is answered `refused(status, body)` (the gate's mapping of a whole call's error)."""

    read_timeout_s: float
    refused: Refused

    async def relay(self, client: Any, upstream_body: dict, relay: Relay, broke_off: Callable[[str], bytes]) -> Any:
        """POST the streamed request to the worker; `relay(worker bytes)` is the client's events."""
        deadline = self.read_timeout_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=deadline, sock_read=deadline)
        session = aiohttp.ClientSession(timeout=timeout)
        headers = {**client.default_headers, "Authorization": f"Bearer {client.api_key}"}
        try:
            upstream = await session.post(f"{client.base_url}/chat/completions", json=upstream_body, headers=headers)
            if upstream.status != 200:
                status, payload = self.refused(upstream.status, await upstream.read())
                await session.close()
                return JSONResponse(content=payload, status_code=status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            await session.close()
            message = f"the vLLM worker at {client.base_url} did not start the stream: {error_name(e)}: {e}"
            return JSONResponse(content={"error": {"message": message, "type": "upstream_unavailable", "param": None,
                                                   "code": 502}}, status_code=502)

        async def events():
            try:
                async for event in relay(upstream.content.iter_any()):
                    yield event
            except (StreamRelayError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                yield broke_off(f"the vLLM worker's stream broke off: {error_name(e)}: {e}; not committed")
            finally:
                upstream.release()
                await session.close()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def admit(params: Any) -> None:
    """Gym's steps before a dispatch, in Gym's order: resolve the parent, register the call's intent."""
    if current_capture_context() is not None:
        await resolve_parent(_request_messages(params))
        await register_call_intent()


def worker_body(model: VLLMModel, request: Request, chat_params: dict, include_usage: bool) -> dict:
    """The worker's streamed chat request: Gym's preprocessing (admission, model name), `stream: true`."""
    upstream_body = model._preprocess_chat_completion_create_params(request, chat_params)
    upstream_body["stream"] = True
    if include_usage:
        upstream_body["stream_options"] = {"include_usage": True}
    return upstream_body


def prepared(model: VLLMModel, completion: dict) -> dict:
    """`completion` after Gym's `prepare_response` (which takes `ng_commit_coords` off), as Gym's whole call."""
    if model._external_capture_handler is not None:
        model._external_capture_handler.prepare_response(completion)
    return completion


async def stream_events(model: VLLMModel, request: Request, stream: WorkerStream, upstream_body: dict,
                        events: EventSequence, to_final: Callable[[dict], dict]) -> Any:
    """The worker's stream relayed as `events` (`relay_events`), committed by Gym's `_finalize_served_response`."""

    def relay(upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return relay_events(upstream, events, to_final, model._finalize_served_response)

    def failed(message: str) -> bytes:
        return typed_sse(events.failed(message))

    return await stream.relay(model._resolve_client(request), upstream_body, relay, failed)


async def streamed_chat(model: VLLMModel, request: Request, body: dict, stream: WorkerStream) -> Any:
    """Gym's chat dispatch for a `stream: true` body: the worker streams and the gate relays (no buffering)."""
    cleaned, include_usage = sanitize_streaming_chat_body(body)
    params = _validate_chat_params(cleaned)  # Gym's own 422 for a body its model refuses
    await admit(params)
    upstream_body = worker_body(model, request, params.model_dump(exclude_unset=True), include_usage)

    async def commit(completion: dict) -> None:  # Gym's commit of a finished call
        await model._finalize_served_response(NeMoGymChatCompletion.model_validate(prepared(model, completion)))

    def relay(upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return relay_stream(upstream, commit)

    return await stream.relay(model._resolve_client(request), upstream_body, relay, error_event)
