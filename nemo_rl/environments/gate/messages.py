"""The gate's streamed Anthropic Messages route (`/v1/messages`, `stream: true`), token by token with custody.

`streamed_messages` maps the body as Gym's `messages()` does (Gym's `_ANTHROPIC_CONVERTER`, then its
Responses-to-chat conversion) and streams the worker's chat chunks; `MessagesEvents` turns them into
the Anthropic events the `anthropic` client parses: `message_start`, per block `content_block_start`,
`content_block_delta` (`text_delta`; `input_json_delta` with the worker's argument pieces) and
`content_block_stop`. On the worker's `[DONE]` the shared relay (`streaming.relay_events`) converts
the assembled completion as Gym's buffered route would, `settle`s it against what was streamed (it
keeps the streamed id), commits it (Gym's ledger row) and only then sends the last block's stop,
`message_delta` (stop reason, usage) and `message_stop`. Invariants: the client sees `message_stop`
only after the ledger row is written; the streamed text and arguments are the final message's; any
other ending is an `error` event and commits nothing. Event fields: docs/guides/token-capture.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import Request

from nemo_gym.base_responses_api_model import _ANTHROPIC_CONVERTER
from nemo_rl.data.errors import error_name
from nemo_rl.environments.gate.responses import CONVERTER_ERRORS, admitted_upstream, gym_response, skeleton_completion
from nemo_rl.environments.gate.streaming import StreamRelayError, WorkerStream, prepared, stream_events, tool_call_delta
from responses_api_models.vllm_model.app import VLLMModel

Shell = Callable[[dict], dict]  # first chunk -> the message Gym's converter makes of the empty completion



class MessagesEvents:
    """The Anthropic event sequence of one streamed call (see the module contract)."""

    def __init__(self, shell: Shell) -> None:
        self._shell = shell
        self.message: dict | None = None  # the `message_start` message once the first chunk came
        self.blocks: list[dict] = []  # streamed blocks in order: text (`text`) or tool_use (`id`, `name`, `json`)
        self._open: int | None = None  # the block that is started and not yet stopped
        self._by_call_index: dict[int, int] = {}  # the chat tool call's index -> its block index

    def on_chunk(self, chunk: dict) -> list[dict]:
        """The events one client-side chat chunk (custody fields already removed) adds."""
        out: list[dict] = []
        if self.message is None:
            shell = self._shell(chunk)
            self.message = {**shell, "content": [], "stop_reason": None, "stop_sequence": None,
                            "usage": {"input_tokens": 0, "output_tokens": 0}}
            out.append({"type": "message_start", "message": self.message})
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
        return out

    def _start(self, block: dict, shell: dict) -> list[dict]:
        out = self._stop_open()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        out.append({"type": "content_block_start", "index": self._open, "content_block": shell})
        return out

    def _stop_open(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

    def _text(self, text: str) -> list[dict]:
        out: list[dict] = []
        if not self.blocks:
            out += self._start({"type": "text", "text": ""}, {"type": "text", "text": ""})
        elif self.blocks[-1]["type"] != "text":
            raise StreamRelayError("the worker streamed content after a tool call; Gym's message puts the text "
                                   "block first, so this stream cannot be relayed in order")
        self.blocks[0]["text"] += text
        out.append({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})
        return out

    def _call(self, call: dict) -> list[dict]:
        out: list[dict] = []
        index, function, pieces = tool_call_delta(call, int(call["index"]) in self._by_call_index)
        if index not in self._by_call_index:
            self._by_call_index[index] = len(self.blocks)
            out += self._start({"type": "tool_use", "id": call["id"], "name": function["name"], "json": ""},
                               {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
        at = self._by_call_index[index]
        if pieces:
            if at != self._open:
                raise StreamRelayError(f"the worker streamed arguments of tool call {index} after the next block "
                                       "started; Anthropic blocks stream one at a time")
            self.blocks[at]["json"] += pieces
            out.append({"type": "content_block_delta", "index": at,
                        "delta": {"type": "input_json_delta", "partial_json": pieces}})
        return out

    def settle(self, final: dict) -> dict:
        """`final` with the streamed message id; raises `StreamRelayError` if it differs from the stream."""
        assert self.message is not None, "the worker's [DONE] comes after its first chunk"
        content = [dict(block) for block in final.get("content") or []]
        kinds, streamed = [b.get("type") for b in content], [b["type"] for b in self.blocks]
        opened_at_end = not self.blocks and content == [{"type": "text", "text": ""}]  # the empty reply
        if kinds != streamed and not opened_at_end:
            raise StreamRelayError(f"the final message's content {kinds} is not the streamed content {streamed}")
        for block, seen in zip(content, self.blocks):
            if block["type"] == "text" and block.get("text") != seen["text"]:
                raise StreamRelayError("the final message's text is not the text streamed")
            if block["type"] == "tool_use" and (block.get("id"), block.get("name"), block.get("input")) != (
                    seen["id"], seen["name"], _arguments(seen["json"])):
                raise StreamRelayError(f"the final message's tool_use {block.get('id')} is not the one streamed")
        return {**final, "id": self.message["id"], "content": content}

    def closing(self, final: dict) -> list[dict]:
        """The last block's stop (the empty reply's block opened only now), `message_delta`, `message_stop`."""
        out = self._stop_open()
        if not self.blocks:
            for index, block in enumerate(final["content"]):
                out += [{"type": "content_block_start", "index": index, "content_block": block},
                        {"type": "content_block_stop", "index": index}]
        usage = final.get("usage") or {}
        out.append({"type": "message_delta",
                    "delta": {"stop_reason": final.get("stop_reason"), "stop_sequence": final.get("stop_sequence")},
                    "usage": {"input_tokens": usage.get("input_tokens", 0),
                              "output_tokens": usage.get("output_tokens", 0)}})
        out.append({"type": "message_stop"})
        return out

    def failed(self, message: str) -> dict:
        """The terminal Anthropic `error` event of a stream that did not finish (nothing committed)."""
        return {"type": "error", "error": {"type": "api_error", "message": message}}


def _arguments(streamed: str) -> Any:
    """The tool input the streamed argument text parses to, as Gym's converter reads it (`{}` when empty)."""
    try:
        return json.loads(streamed or "{}")
    except json.JSONDecodeError as e:
        raise StreamRelayError(f"the streamed tool arguments are not JSON: {streamed[:200]!r}") from e


async def streamed_messages(model: VLLMModel, request: Request, body: dict, stream: WorkerStream) -> Any:
    """Gym's Messages route for a `stream: true` body: Anthropic events from the worker's chat stream as it
    comes, the call committed as Gym commits a whole one."""
    unflagged = {k: v for k, v in body.items() if k != "stream"}
    params = _ANTHROPIC_CONVERTER.anthropic_request_to_responses(unflagged)  # as Gym's messages() maps it
    upstream_body = await admitted_upstream(model, request, params)

    def message_of(completion: dict) -> dict:  # Gym's buffered route: completion -> Responses -> Anthropic
        response = gym_response(model, params, completion)
        return _ANTHROPIC_CONVERTER.responses_to_anthropic_response(response, model=body.get("model") or response.model)

    def to_message(completion: dict) -> dict:
        completion = prepared(model, completion)
        try:
            return message_of(completion)
        except CONVERTER_ERRORS as e:
            raise StreamRelayError(f"Gym's converter refused the finished reply: {error_name(e)}: {e}") from e

    events = MessagesEvents(lambda first: message_of(skeleton_completion(first)))
    return await stream_events(model, request, stream, upstream_body, events, to_message)
