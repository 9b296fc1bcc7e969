"""Streamed chat completions of the worker (pure): content deltas, OpenAI chunks, SSE framing.

`ContentStreamer` turns sampled ids into content deltas as they are produced, decoded the way the
finished reply will be (`chat.assistant_reply`): no tool parsing streams all text; the `hermes`
parser streams the text before `<tool_call>` (a possible start of the tag is held back); any
other parser streams content only once generation ends. `final_chunks` turns the finished reply
(the non-streamed `ChatService` reply, `ng_commit_coords` included) into the closing chunks: the
content not yet streamed, tool calls in OpenAI's streamed shape, the finish chunk carrying
`ng_commit_coords`, and the usage chunk when asked. Invariant: the concatenated content deltas
equal the finished reply's content (`StreamConsistencyError` otherwise, never a silent rewrite).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nemo_rl.data.errors import FatalError

SSE_DONE = b"data: [DONE]\n\n"
HERMES_TOOL_START = "<tool_call>"
CHUNK_OBJECT = "chat.completion.chunk"


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
