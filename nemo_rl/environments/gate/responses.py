"""The gate's Responses API (and Anthropic Messages) route beyond Gym's own dispatch; chat needs none of it.

`responses_chat_request` is the chat request a `/v1/responses` or `/v1/messages` body becomes (Gym's
models and converter; the guard checks it). `streamed_responses` is Gym's Responses dispatch for
`stream: true`: `ResponsesEvents` turns each `chat.completion.chunk` the worker streams into the
Responses events the official client and the Agents SDK parse; on the worker's `[DONE]` the shared
relay (`streaming.relay_events`) converts the assembled completion (Gym's converter), `settle`s it against
what was streamed (giving it the streamed message id), commits it (Gym's ledger row) and only then
sends the done events and `response.completed` (`response.incomplete` for a cut reply). Invariants:
the client sees the terminal event only after the ledger row is written; streamed text and
arguments equal the final response's; any other ending is a `response.failed` and commits nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from uuid import uuid4

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from nemo_gym.anthropic_utils import NeMoGymAnthropicMessageCreateParamsNonStreaming
from nemo_gym.base_responses_api_model import _ANTHROPIC_CONVERTER
from nemo_gym.openai_utils import NeMoGymChatCompletion, NeMoGymResponse, NeMoGymResponseCreateParamsNonStreaming
from nemo_gym.responses_streaming import (
    NamespaceMap,
    restore_namespace_tool_calls,
    sanitize_streaming_responses_body,
    validate_streaming_responses_params,
)
from nemo_rl.environments.gate.streaming import (
    StreamRelayError,
    WorkerStream,
    admit,
    prepared,
    stream_events,
    tool_call_delta,
    worker_body,
)
from responses_api_models.vllm_model.app import VLLMModel

# What Gym's converters raise for input they cannot map (the guard's refusal, a relay's failure).
CONVERTER_ERRORS = (ValueError, TypeError, KeyError, NotImplementedError)
Skeleton = Callable[[dict], dict]  # first chunk -> the response object before any output (Gym's conversion)


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
        index, function, pieces = tool_call_delta(call, int(call["index"]) in self._by_call_index)
        if index not in self._by_call_index:
            item = {"id": call["id"], "type": "function_call", "call_id": call["id"], "name": function["name"],
                    "arguments": "", "status": "in_progress"}
            if function["name"] in self._namespaces:  # as Gym's restore_namespace_tool_calls names it
                item["namespace"], item["name"] = self._namespaces[function["name"]]
            self._by_call_index[index] = len(self.items)
            self.items.append(dict(item))
            out.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        at = self._by_call_index[index]
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


# --- the dispatch: Gym's models and converter around the worker's chat stream ----------------------


def streamed_responses_params(body: dict) -> tuple[NeMoGymResponseCreateParamsNonStreaming, NamespaceMap]:
    """A `stream: true` Responses body as Gym's streaming dialect maps it, and the namespace tools it
    flattened (raises ValidationError)."""
    cleaned, namespaces = sanitize_streaming_responses_body(body)
    return validate_streaming_responses_params(cleaned), namespaces


def responses_chat_request(model: VLLMModel, kind: str, body: dict) -> dict:
    """The chat request the worker would get for a `responses` or `messages` body (the guard checks it).

    Raises pydantic's ValidationError (Gym's request model refuses the body) or the error Gym's
    converter raises; a streamed Responses body is first mapped from the streaming dialect by Gym's
    own functions (as `streamed_responses` serves it), a streamed Messages body is checked without
    its `stream` flag (the only field Gym's Messages model lacks; as `gate.messages` serves it).
    """
    if kind == "responses" and body.get("stream") is True:
        params, _ = streamed_responses_params(body)
    elif kind == "responses":
        params = NeMoGymResponseCreateParamsNonStreaming.model_validate(body)
    else:
        unflagged = {k: v for k, v in body.items() if k != "stream"} if body.get("stream") is True else body
        NeMoGymAnthropicMessageCreateParamsNonStreaming.model_validate(unflagged)
        params = _ANTHROPIC_CONVERTER.anthropic_request_to_responses(unflagged)
    chat = model._converter.responses_to_chat_completion_create_params(params)
    return chat.model_dump(exclude_unset=True, mode="json")


def skeleton_completion(first: dict) -> dict:
    """The empty completion Gym's converter turns into the in-progress response of a stream."""
    return {"id": first["id"], "created": first["created"], "model": first["model"], "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]}


def gym_response(model: VLLMModel, params: NeMoGymResponseCreateParamsNonStreaming,
                 completion: dict) -> NeMoGymResponse:
    """Gym's conversion of a chat completion to its Responses object, as `VLLMModel.responses` returns it."""
    return model._converter.chat_completion_to_response(
        responses_create_params=params, chat_completion=NeMoGymChatCompletion.model_validate(completion),
        preserve_envelope_id=model._preserve_envelope_id())


def response_of(model: VLLMModel, params: NeMoGymResponseCreateParamsNonStreaming, completion: dict,
                namespaces: NamespaceMap) -> dict:
    """Gym's Responses object as its streamed path serves it (namespace tools' calls under their
    client-visible names)."""
    out = gym_response(model, params, completion).model_dump(mode="json", by_alias=True)
    return {**out, "output": restore_namespace_tool_calls(out.get("output") or [], namespaces)}


async def admitted_upstream(model: VLLMModel, request: Request,
                            params: NeMoGymResponseCreateParamsNonStreaming) -> dict:
    """Admit `params`, then the worker's chat body for them as Gym's `responses()` builds it (with usage:
    the final reply carries it). Sets `params.model` to the served model, as Gym does."""
    await admit(params)
    chat_params = model._converter.responses_to_chat_completion_create_params(params)
    params.model = model.config.model  # as Gym's responses() does
    return worker_body(model, request, chat_params.model_dump(exclude_unset=True), include_usage=True)


async def streamed_responses(model: VLLMModel, request: Request, body: dict, stream: WorkerStream) -> Any:
    """Gym's Responses dispatch for a `stream: true` body: events built from the worker's chat stream as
    it comes, the call committed as Gym commits a whole one."""
    try:
        params, namespaces = streamed_responses_params(body)  # Gym's own mapping of the streaming dialect
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e
    upstream_body = await admitted_upstream(model, request, params)
    events = ResponsesEvents(lambda first: response_of(model, params, skeleton_completion(first), {}),
                             message_id=f"msg_{uuid4().hex}", namespaces=namespaces)

    def to_response(completion: dict) -> dict:
        return response_of(model, params, prepared(model, completion), namespaces)

    return await stream_events(model, request, stream, upstream_body, events, to_response)
