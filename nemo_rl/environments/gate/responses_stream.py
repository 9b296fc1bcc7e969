"""The gate's streamed Responses path: Responses API events built from the worker's chat chunks as they come.

`ResponsesEvents` turns each `chat.completion.chunk` the worker streams into the Responses events
the official client and the Agents SDK parse (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`); `settle(final)` checks the final response (built by
Gym's converter from the assembled completion) against what was streamed and gives it the streamed
message id; `closing(final)` is the done events and `response.completed` (`response.incomplete`
for a cut reply) carrying the whole response. `relay_responses_stream` runs them: on the worker's
`[DONE]` it converts, settles and commits (Gym's ledger row) before any closing event. Invariants:
the client sees the terminal event only after the ledger row is written; streamed text and
arguments equal the final response's; any other ending is a `response.failed` and commits nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from nemo_rl.environments.gate.streaming import CUT_OFF, StreamRelayError, worker_stream

Skeleton = Callable[[dict], dict]  # first chunk -> the response object before any output (Gym's conversion)


def responses_sse(payload: dict) -> bytes:
    """One Responses SSE event: `event: <type>` and its JSON `data` (the lines Gym's capture reads)."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n".encode("utf-8")


class ResponsesEvents:
    """The Responses event sequence of one streamed call (see the module contract)."""

    def __init__(self, skeleton: Skeleton, message_id: str,
                 namespaces: Mapping[str, tuple[str, str]] | None = None) -> None:
        self._skeleton = skeleton
        self._message_id = message_id
        self._namespaces = dict(namespaces or {})  # flattened tool name -> (namespace, name), Gym's map
        self._sequence = 0
        self.response: dict | None = None  # the in-progress response once the first chunk came
        self.items: list[dict] = []  # streamed output items, in output order
        self._by_call_index: dict[int, int] = {}  # the chat tool call's index -> its output index

    def _event(self, event_type: str, **fields: Any) -> dict:
        event = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def on_chunk(self, chunk: dict) -> list[dict]:
        """The events one client-side chat chunk (custody fields already removed) adds."""
        out: list[dict] = []
        if self.response is None:
            self.response = {**self._skeleton(chunk), "status": "in_progress", "output": [], "usage": None,
                             "incomplete_details": None}
            out += [self._event("response.created", response=self.response),
                    self._event("response.in_progress", response=self.response)]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
        return out

    def _text(self, text: str) -> list[dict]:
        out: list[dict] = []
        if not self.items or self.items[0]["type"] != "message":
            if self.items:
                raise StreamRelayError("the worker streamed content after a tool call; the Responses output puts the "
                                       "message first, so this stream cannot be relayed in order")
            item = {"id": self._message_id, "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            self.items.append({**item, "text": ""})
            out += [self._event("response.output_item.added", output_index=0, item=item),
                    self._event("response.content_part.added", item_id=self._message_id, output_index=0,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
        self.items[0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self._message_id, output_index=0,
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _call(self, call: dict) -> list[dict]:
        out: list[dict] = []
        index = int(call["index"])
        function = call.get("function") or {}
        if index not in self._by_call_index:
            if not call.get("id") or not function.get("name"):
                raise StreamRelayError(f"the worker's tool call {index} started without an id and a name: {call}")
            item = {"id": call["id"], "type": "function_call", "call_id": call["id"], "name": function["name"],
                    "arguments": "", "status": "in_progress"}
            if function["name"] in self._namespaces:  # as Gym's restore_namespace_tool_calls names it
                item["namespace"], item["name"] = self._namespaces[function["name"]]
            self._by_call_index[index] = len(self.items)
            self.items.append(dict(item))
            out.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        at = self._by_call_index[index]
        pieces = function.get("arguments") or ""
        if pieces:
            self.items[at]["arguments"] += pieces
            out.append(self._event("response.function_call_arguments.delta", item_id=self.items[at]["id"],
                                   output_index=at, delta=pieces))
        return out

    def settle(self, final: dict) -> dict:
        """`final` with the streamed message id; raises `StreamRelayError` if it differs from the stream."""
        output = [dict(item) for item in final.get("output") or []]
        streamed = [item["type"] for item in self.items]
        kinds = [item.get("type") for item in output]
        opened_at_end = not self.items and kinds == ["message"]  # an empty reply: nothing was streamed
        if kinds != streamed and not opened_at_end:
            raise StreamRelayError(f"the final response's output {kinds} is not the streamed output {streamed}")
        for item, seen in zip(output, self.items):
            if item["type"] == "message":
                if _message_text(item) != seen["text"]:
                    raise StreamRelayError("the final response's text is not the text streamed")
                item["id"] = seen["id"]
            elif (item.get("call_id"), item.get("name"), item.get("arguments")) != (
                    seen["call_id"], seen["name"], seen["arguments"]):
                raise StreamRelayError(f"the final response's function call {item.get('call_id')} is not the one streamed")
        return {**final, "output": output}

    def closing(self, final: dict) -> list[dict]:
        """The done events of every output item, then the terminal event carrying `final` (settled)."""
        out: list[dict] = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                if index >= len(self.items):  # the empty reply's message, opened only now
                    opened = {**item, "status": "in_progress", "content": []}
                    out += [self._event("response.output_item.added", output_index=index, item=opened),
                            self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                        content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
                for part_index, part in enumerate(item.get("content") or []):
                    if part.get("type") == "output_text":
                        out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                               content_index=part_index, text=part["text"], logprobs=[]))
                    out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                           content_index=part_index, part=part))
            elif item["type"] == "function_call":
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, name=item["name"], arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        terminal = "response.incomplete" if final.get("status") == "incomplete" else "response.completed"
        out.append(self._event(terminal, response=final))
        return out

    def failed(self, message: str) -> dict:
        """The terminal `response.failed` of a stream that did not finish (nothing committed)."""
        base = self.response or {"id": f"resp_{self._message_id}", "object": "response", "output": []}
        return self._event("response.failed", response={**base, "status": "failed",
                                                        "error": {"code": "server_error", "message": message}})


def _message_text(item: dict) -> str:
    return "".join(part.get("text") or "" for part in item.get("content") or [] if part.get("type") == "output_text")


async def relay_responses_stream(
    upstream: AsyncIterator[bytes],
    events: ResponsesEvents,
    to_response: Callable[[dict], dict],
    commit: Callable[[dict], Awaitable[None]],
) -> AsyncIterator[bytes]:
    """Responses events from the worker's chat SSE; on `[DONE]`: `to_response(completion)`, settle,
    `commit(final)`, then the closing events (module contract)."""
    async for kind, value in worker_stream(upstream):
        if kind == "done":
            final = events.settle(to_response(value))
            await commit(final)
            for event in events.closing(final):
                yield responses_sse(event)
            return
        if kind == "error":
            error = value["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            yield responses_sse(events.failed(f"the vLLM worker's stream failed: {message}; not committed"))
            return
        for event in events.on_chunk(value):
            yield responses_sse(event)
    yield responses_sse(events.failed(CUT_OFF))
