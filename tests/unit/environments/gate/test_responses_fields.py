"""The Responses API's top-level fields on the capture route: each accepted value and each refusal, exactly.

`SDK_BODY` is the OpenAI Agents SDK 0.24.0's first `/v1/responses` body as it went over the wire
(`examples/harness/agents_sdk_driver.py --log-requests`, `OpenAIResponsesModel`, the calculator tool).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl.data.calls import RequestFieldError
from nemo_rl.environments.gate.app import body_normalizer, normalize_chat_post
from nemo_rl.environments.gate.responses_fields import (
    RESPONSES_FIELD_RULES,
    normalize_responses_body,
    normalize_responses_post,
    normalize_responses_request,
)

SDK_BODY = json.loads((Path(__file__).parent / "data" / "agents_sdk_0_24_first_responses_call.json").read_text())
BASE = {"model": "tiny", "input": [{"role": "user", "content": "What is 2 + 3?"}], "max_output_tokens": 8}


def test_the_sdk_sends_include_empty_and_nothing_else_outside_the_model_input() -> None:
    assert sorted(SDK_BODY) == ["include", "input", "instructions", "max_output_tokens", "model", "temperature", "tools"]
    assert SDK_BODY["include"] == []


def test_the_sdk_body_loses_only_include() -> None:
    out = normalize_responses_request(SDK_BODY)
    assert out == {k: v for k, v in SDK_BODY.items() if k != "include"}
    assert SDK_BODY["include"] == []  # the caller's body is not mutated


# (field, value, kept in the body after normalisation?)
ACCEPTED = [
    ("include", [], False),
    ("include", ["reasoning.encrypted_content"], False),
    ("store", False, False),
    ("parallel_tool_calls", True, False),
    ("parallel_tool_calls", False, False),  # not enforced: every call the model wrote is returned
    ("truncation", "disabled", False),
    ("reasoning", {"effort": "low"}, True),
    ("reasoning", {"effort": "low", "summary": None}, True),
    ("metadata", {"run": "7"}, False),
    ("prompt_cache_key", "agent-1", False),
    ("prompt_cache_retention", "24h", False),
    ("service_tier", "auto", False),
    ("service_tier", "default", False),
    ("user", "u-1", False),
    ("safety_identifier", "s-1", False),
    ("text", {"format": {"type": "text"}}, False),
    ("text", {}, False),
    ("background", False, False),
    ("previous_response_id", None, False),
    ("store", None, False),
]


@pytest.mark.parametrize(("field", "value", "kept"), ACCEPTED)
def test_an_accepted_field_is_kept_or_dropped_exactly(field: str, value, kept: bool) -> None:
    out = normalize_responses_request({**BASE, field: value})
    assert out == ({**BASE, field: value} if kept else BASE)


# (field, value, the refusal's message after "has no faithful meaning on the capture route (accepted: ...); fix: ")
REFUSED = [
    ("include", ["message.output_text.logprobs"], "omit the other include values"),
    ("include", ["file_search_call.results", "reasoning.encrypted_content"], "omit the other include values"),
    ("include", "reasoning.encrypted_content", "omit the other include values"),
    ("store", True, "send store=false or omit it"),
    ("parallel_tool_calls", "no", "send a boolean or omit it"),
    ("truncation", "auto", "send truncation='disabled' or omit it"),
    ("reasoning", {"effort": "low", "summary": "auto"}, "omit reasoning.summary / generate_summary"),
    ("reasoning", "high", "omit reasoning.summary / generate_summary"),
    ("metadata", "x", "send metadata as a JSON object"),
    ("service_tier", "priority", "send service_tier='auto' or omit it"),
    ("text", {"format": {"type": "json_schema", "name": "n", "schema": {}}}, "omit text.format json_schema"),
    ("text", {"format": {"type": "json_object"}}, "omit text.format json_schema"),
    ("text", {"verbosity": "low"}, "omit text.format json_schema"),
    ("background", True, "omit background"),
    ("previous_response_id", "resp_1", "send the whole history in `input`"),
    ("conversation", "conv_1", "send the whole history in `input`: the gate stores no conversations"),
    ("max_tool_calls", 3, "bound the tool loop in the harness"),
    ("prompt", {"id": "pmpt_1"}, "send the prompt's text as instructions and input"),
    ("context_management", [{"type": "compaction"}], "compact the history in the harness"),
]


@pytest.mark.parametrize(("field", "value", "fix"), REFUSED)
def test_a_refused_field_names_the_field_the_value_and_the_fix(field: str, value, fix: str) -> None:
    with pytest.raises(RequestFieldError) as caught:
        normalize_responses_request({**BASE, field: value})
    error = caught.value
    assert error.field == field
    assert error.message.startswith(
        f"Responses field {field}={json.dumps(value)} has no faithful meaning on the capture route (accepted: ")
    assert f"; fix: {fix}" in error.message


def test_every_rule_is_tested_both_ways_or_refuses_every_value() -> None:
    accepted = {field for field, value, _ in ACCEPTED if value is not None}
    refused = {field for field, _, _ in REFUSED}
    always_refused = {"previous_response_id", "conversation", "max_tool_calls", "prompt", "context_management"}
    for rule in RESPONSES_FIELD_RULES:
        assert rule.field in refused or rule.field in {"prompt_cache_key", "prompt_cache_retention", "user",
                                                        "safety_identifier"}, rule.field
        assert rule.field in accepted or rule.field in always_refused, rule.field


def test_a_body_without_listed_fields_is_the_same_object() -> None:
    assert normalize_responses_request(BASE) is BASE
    raw = json.dumps(BASE).encode()
    assert normalize_responses_body(raw) is raw
    assert normalize_responses_body(b"{not json") == b"{not json"
    assert normalize_responses_request([1]) == [1]


def test_the_body_rewrite_drops_the_field_and_keeps_the_input_bytes_meaning() -> None:
    raw = json.dumps(SDK_BODY).encode()
    assert json.loads(normalize_responses_body(raw)) == {k: v for k, v in SDK_BODY.items() if k != "include"}
    with pytest.raises(RequestFieldError):
        normalize_responses_body(json.dumps({**BASE, "store": True}).encode())


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/ng-rollout/r1/training-token-capture/v1/responses", normalize_responses_post),
        ("POST", "/v1/responses", normalize_responses_post),
        ("POST", "/ng-rollout/r1/training-token-capture/v1/chat/completions", normalize_chat_post),
        ("GET", "/v1/responses", None),
        ("POST", "/v1/messages", None),
    ],
)
def test_the_gate_rewrites_chat_and_responses_posts_only(method: str, path: str, expected) -> None:
    assert body_normalizer({"type": "http", "method": method, "path": path}) is expected


def test_both_post_rewrites_also_drop_a_null_required_prefix() -> None:
    raw = json.dumps({**SDK_BODY, "required_prefix_token_ids": None}).encode()
    assert json.loads(normalize_responses_post(raw)) == {k: v for k, v in SDK_BODY.items() if k != "include"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "required_prefix_token_ids": []}
    assert json.loads(normalize_chat_post(json.dumps(chat).encode())) == {k: v for k, v in chat.items()
                                                                          if k != "required_prefix_token_ids"}
