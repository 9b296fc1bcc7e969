"""`normalize_chat_request` against the real openai SDK types and Gym's real request model."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from pydantic import ValidationError

from nemo_gym.openai_utils import (
    NeMoGymChatCompletionCreateParamsNonStreaming,
    NeMoGymResponseCreateParamsNonStreaming,
)
from nemo_gym.token_id_capture.fingerprint import assistant_fingerprint, conversation_digest
from nemo_rl.environments.gate.app import (
    ECHOED_NULL_MESSAGE_FIELDS,
    RESPONSE_ONLY_MESSAGE_FIELDS,
    RESPONSE_ONLY_TOOL_CALL_FIELDS,
    NormalizeChatRequestMiddleware,
    normalize_chat_body,
    normalize_chat_request,
)

TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
}
PLAIN_ASSISTANT = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
SYSTEM = {"role": "system", "content": "You are a calculator agent."}
USER = {"role": "user", "content": "What is 2+2?"}
TOOL = {"role": "tool", "tool_call_id": "call_1", "content": "4"}


def _sdk_message() -> Any:
    """The `ChatCompletionMessage` the openai client parses from a gate reply with a tool call."""
    completion = ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "tiny",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": PLAIN_ASSISTANT}],
        }
    )
    return completion.choices[0].message


def _body(assistant: dict) -> dict:
    return {"model": "tiny", "messages": [SYSTEM, USER, assistant, TOOL], "temperature": 1.0}


def _validates(body: dict) -> bool:
    try:
        NeMoGymChatCompletionCreateParamsNonStreaming.model_validate(body)
    except ValidationError:
        return False
    return True


def test_the_normalised_fields_are_derived_from_the_installed_sdk() -> None:
    assert openai.__version__ == "2.44.0"
    assert RESPONSE_ONLY_MESSAGE_FIELDS == {"annotations"}
    assert ECHOED_NULL_MESSAGE_FIELDS == {"audio", "function_call", "refusal", "tool_calls"}
    assert RESPONSE_ONLY_TOOL_CALL_FIELDS == {"function": frozenset(), "custom": frozenset()}


def test_an_sdk_echo_fails_gyms_request_model_before_and_passes_after() -> None:
    echoed = _sdk_message().model_dump()
    assert set(echoed) == {"content", "refusal", "role", "annotations", "audio", "function_call", "tool_calls"}
    body = _body(echoed)

    with pytest.raises(ValidationError) as info:
        NeMoGymChatCompletionCreateParamsNonStreaming.model_validate(body)
    forbidden = {e["loc"][-1] for e in info.value.errors() if "AssistantMessageParam" in str(e["loc"])}
    normalized = normalize_chat_request(body)

    assert forbidden == {"annotations"}
    assert normalized["messages"][2] == PLAIN_ASSISTANT
    assert _validates(normalized)
    # Everything but the echoed assistant turn is the very same object, and the input is not mutated.
    assert [a is b for a, b in zip(normalized["messages"], body["messages"])] == [True, True, False, True]
    assert body["messages"][2] == echoed


def test_a_json_mode_echo_of_a_text_turn_is_normalised_too() -> None:
    message = _sdk_message().model_copy(update={"content": "Let me check.", "tool_calls": None})
    echoed = message.model_dump(mode="json")
    normalized = normalize_chat_request(_body(echoed))
    assert normalized["messages"][2] == {"role": "assistant", "content": "Let me check."}
    assert _validates(normalized)


def test_normalisation_keeps_the_lineage_fingerprint_and_context_digest() -> None:
    plain = _body(PLAIN_ASSISTANT)
    echoed = _body(_sdk_message().model_dump())
    # Gym's ledger row for the served turn holds it as a Responses output item.
    served_items = [SYSTEM, USER, {"type": "function_call", "call_id": "call_1", "name": "calculator",
                                   "arguments": '{"expression": "2+2"}'}]

    assert normalize_chat_request(plain) is plain
    normalized = normalize_chat_request(echoed)["messages"]
    assert assistant_fingerprint(normalized) == assistant_fingerprint(plain["messages"])
    assert assistant_fingerprint(normalized[:3]) == assistant_fingerprint(served_items)
    assert conversation_digest(normalized) == conversation_digest(plain["messages"])


@pytest.mark.parametrize(
    "assistant",
    [
        {**PLAIN_ASSISTANT, "refusal": "I cannot.", "audio": {"id": "a1"}},
        {**PLAIN_ASSISTANT, "annotations": [{"type": "url_citation"}]},
        {**PLAIN_ASSISTANT, "name": "helper", "reasoning_content": None},
        {"role": "assistant", "content": None},
    ],
    ids=["non-null-shared", "non-empty-annotations", "request-only-fields", "content-null"],
)
def test_values_that_are_not_null_echoes_are_left_alone(assistant: dict) -> None:
    body = _body(assistant)
    assert normalize_chat_request(body) is body


def test_only_assistant_messages_are_touched() -> None:
    body = {"messages": [{"role": "user", "content": "hi", "annotations": None}], "annotations": None}
    assert normalize_chat_request(body) is body
    for odd in (None, [], "text", {"model": "m"}, {"messages": "nope"}):
        assert normalize_chat_request(odd) is odd


def test_raw_bodies_are_rewritten_only_when_needed() -> None:
    bad = b'{"messages": [ not json'
    plain = json.dumps(_body(PLAIN_ASSISTANT)).encode()
    echoed = json.dumps(_body(_sdk_message().model_dump())).encode()
    assert normalize_chat_body(bad) is bad
    assert normalize_chat_body(b"\xff\xfe") == b"\xff\xfe"
    assert normalize_chat_body(plain) is plain
    assert json.loads(normalize_chat_body(echoed)) == _body(PLAIN_ASSISTANT)


def test_the_responses_route_accepts_an_sdk_echo_without_normalisation() -> None:
    response = Response.model_validate(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 1,
            "model": "tiny",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "output": [
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "."}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "calculator",
                 "arguments": '{"expression": "2+2"}', "status": "completed"},
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "4", "annotations": [], "logprobs": None}]},
            ],
        }
    )
    echoed = [item.model_dump() for item in response.output]
    tool = {"type": "function_call_output", "call_id": "call_1", "output": "4"}
    NeMoGymResponseCreateParamsNonStreaming.model_validate({"model": "tiny", "input": [USER, *echoed, tool]})


# --- the ASGI middleware ----------------------------------------------------------------------


async def _through_middleware(path: str, chunks: list[bytes], method: str = "POST") -> tuple[bytes, dict]:
    seen: dict[str, Any] = {}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        seen["body"], seen["headers"] = body, dict(scope["headers"])

    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict:
        return messages.pop(0)

    total = sum(len(c) for c in chunks)
    scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-length", str(total).encode())]}
    await NormalizeChatRequestMiddleware(app)(scope, receive, lambda message: None)
    return seen["body"], seen["headers"]


async def test_the_middleware_normalises_chunked_chat_posts_and_fixes_content_length() -> None:
    raw = json.dumps(_body(_sdk_message().model_dump())).encode()
    body, headers = await _through_middleware(
        "/ng-rollout/r1/training-token-capture/v1/chat/completions", [raw[:50], raw[50:]]
    )
    assert json.loads(body) == _body(PLAIN_ASSISTANT)
    assert headers[b"content-length"] == str(len(body)).encode()


@pytest.mark.parametrize(
    ("path", "method", "raw"),
    [
        ("/v1/chat/completions", "POST", b"{not json"),
        ("/v1/responses", "POST", json.dumps(_body({**PLAIN_ASSISTANT, "annotations": None})).encode()),
        ("/v1/chat/completions", "GET", json.dumps(_body({**PLAIN_ASSISTANT, "annotations": None})).encode()),
    ],
    ids=["bad-json", "other-route", "not-a-post"],
)
async def test_the_middleware_passes_other_requests_through_byte_for_byte(path: str, method: str, raw: bytes) -> None:
    body, headers = await _through_middleware(path, [raw], method)
    assert (body, headers[b"content-length"]) == (raw, str(len(raw)).encode())
