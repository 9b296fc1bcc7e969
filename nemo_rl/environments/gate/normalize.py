"""Make an assistant turn echoed by the official `openai` client acceptable to Gym's gate.

`normalize_chat_request(body)` is pure: it returns `body` itself when nothing needs to change,
else a copy without the response-only fields (when null or empty) and the echoed null fields
of `role: assistant` messages. The field sets are derived from the installed SDK's types at
import time, not written out by hand, so an SDK upgrade that adds one is handled.
Invariant: nothing Gym's lineage fingerprint or context digest reads is touched (role, content,
tool calls, tool results); `content: null` is kept, and a body that is not a dict with a list
of `messages` is returned unchanged.
Which fields, and why: docs/design-docs/token-capture-receipts.md, "Request normalisation".
"""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat import ChatCompletionAssistantMessageParam, ChatCompletionMessage
from openai.types.chat.chat_completion_message_custom_tool_call import ChatCompletionMessageCustomToolCall
from openai.types.chat.chat_completion_message_custom_tool_call_param import (
    ChatCompletionMessageCustomToolCallParam,
)
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_message_function_tool_call_param import (
    ChatCompletionMessageFunctionToolCallParam,
)
from pydantic import BaseModel


def _request_keys(typed_dict: type) -> frozenset[str]:
    return frozenset(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def response_only_fields(response_model: type[BaseModel], request_typed_dict: type) -> frozenset[str]:
    """Fields the SDK parses from a response but does not declare for a request."""
    return frozenset(response_model.model_fields) - _request_keys(request_typed_dict)


def echoed_null_fields(response_model: type[BaseModel], request_typed_dict: type) -> frozenset[str]:
    """Shared fields that the response model defaults to null, so `model_dump()` echoes them as null."""
    shared = frozenset(response_model.model_fields) & _request_keys(request_typed_dict)
    return frozenset(name for name in shared if response_model.model_fields[name].default is None)


RESPONSE_ONLY_MESSAGE_FIELDS = response_only_fields(ChatCompletionMessage, ChatCompletionAssistantMessageParam)
# `content: null` is the canonical tool-call-only turn (Gym's own echo keeps it), so it is never dropped.
ECHOED_NULL_MESSAGE_FIELDS = echoed_null_fields(ChatCompletionMessage, ChatCompletionAssistantMessageParam) - {
    "content"
}
RESPONSE_ONLY_TOOL_CALL_FIELDS: dict[str, frozenset[str]] = {
    "function": response_only_fields(ChatCompletionMessageFunctionToolCall, ChatCompletionMessageFunctionToolCallParam),
    "custom": response_only_fields(ChatCompletionMessageCustomToolCall, ChatCompletionMessageCustomToolCallParam),
}


def _is_empty(value: Any) -> bool:
    return value is None or value == []


def _normalize_tool_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    drop = {k for k in RESPONSE_ONLY_TOOL_CALL_FIELDS.get(call.get("type"), ()) if k in call and _is_empty(call[k])}
    return {k: v for k, v in call.items() if k not in drop} if drop else call


def _normalize_assistant(message: dict) -> dict:
    drop = {k for k in RESPONSE_ONLY_MESSAGE_FIELDS if k in message and _is_empty(message[k])}
    drop |= {k for k in ECHOED_NULL_MESSAGE_FIELDS if k in message and message[k] is None}
    out = {k: v for k, v in message.items() if k not in drop} if drop else message
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        new_calls = [_normalize_tool_call(call) for call in calls]
        if any(new is not old for new, old in zip(new_calls, calls)):
            out = {**out, "tool_calls": new_calls}
    return out


def normalize_chat_request(body: Any) -> Any:
    """`body` without the response-only fields the openai client echoes (see the module contract)."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return body
    messages = body["messages"]
    normalized = [
        _normalize_assistant(m) if isinstance(m, dict) and m.get("role") == "assistant" else m for m in messages
    ]
    if all(new is old for new, old in zip(normalized, messages)):
        return body
    return {**body, "messages": normalized}


def normalize_chat_body(raw: bytes) -> bytes:
    """The raw request bytes after `normalize_chat_request`; the same object when nothing changed.

    Bytes that are not JSON are returned unchanged, and Gym answers them as it would.
    """
    try:
        body = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return raw
    normalized = normalize_chat_request(body)
    if normalized is body:
        return raw
    return json.dumps(normalized, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
