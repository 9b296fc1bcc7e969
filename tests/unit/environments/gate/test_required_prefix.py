"""`required_prefix_token_ids` at our capture gate (Gym's compaction agent sends it on every call).

Pure rules first, then the in-process gate in front of our real worker endpoint (the stack of
test_guard.py): null or [] is served and ledgered exactly as without the field; a bad value or a
non-empty prefix is a 400 naming the field, the value and the fix, with nothing generated or ledgered.
"""

from __future__ import annotations

import json

import pytest

from nemo_gym.openai_utils import NeMoGymResponseCreateParamsNonStreaming
from nemo_rl.data.calls import RequestFieldError
from nemo_rl.environments.gate.required_prefix import (
    FIELD,
    check_required_prefix,
    drop_empty_required_prefix,
    drop_empty_required_prefix_bytes,
)
from tests.unit.environments.gate.test_guard import BEARER, CHAT, RESPONSES, Stack, chat_path, stack, tokenizer  # noqa: F401

RESPONSES_PATH = "/ng-rollout/{}/training-token-capture/v1/responses"


@pytest.mark.parametrize("body", [{}, {FIELD: None}, {FIELD: []}])
def test_absent_null_and_empty_mean_no_requirement(body: dict) -> None:
    check_required_prefix(body)
    assert FIELD not in drop_empty_required_prefix(body)


def test_the_dropped_body_passes_gyms_request_model_which_refuses_the_field() -> None:
    body = {**RESPONSES, FIELD: None}
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        NeMoGymResponseCreateParamsNonStreaming.model_validate(body)
    NeMoGymResponseCreateParamsNonStreaming.model_validate(drop_empty_required_prefix(body))


@pytest.mark.parametrize(
    ("value", "shown"), [("abc", '"abc"'), ([1, -2], "[1, -2]"), ([True], "[true]"), ({"ids": [1]}, '{"ids": [1]}')]
)
def test_a_malformed_value_is_refused_naming_it_and_the_fix(value, shown: str) -> None:
    with pytest.raises(RequestFieldError) as e:
        check_required_prefix({FIELD: value})
    assert e.value.field == FIELD
    assert e.value.message == (
        f"{FIELD} must be null or a list of token ids (integers >= 0), got {shown}; fix: send null (no prefix requirement)"
    )


def test_a_non_empty_prefix_is_refused_naming_its_length_and_the_fix() -> None:
    with pytest.raises(RequestFieldError) as e:
        check_required_prefix({FIELD: [5, 6, 7]})
    assert e.value.field == FIELD
    assert e.value.message.startswith(f"{FIELD} holds 3 ids: an exact physical prefix read from a token echo")
    assert e.value.message.endswith("fix: send null, e.g. simple_agent_with_compaction with "
                                    "context_history.enabled=false (its default)")


def test_raw_bodies_change_only_when_the_field_is_null_or_empty() -> None:
    untouched = [json.dumps(RESPONSES).encode(), json.dumps({**RESPONSES, FIELD: [1]}).encode(), b"{not json " + FIELD.encode()]
    for raw in untouched:
        assert drop_empty_required_prefix_bytes(raw) is raw
    dropped = drop_empty_required_prefix_bytes(json.dumps({**RESPONSES, FIELD: None}).encode())
    assert json.loads(dropped) == RESPONSES
    assert drop_empty_required_prefix({FIELD: [2]}) == {FIELD: [2]}


async def _manifest(stack: Stack, rollout_id: str) -> dict:
    resp = await stack.gate.get(f"/training-token-capture/control/rollouts/{rollout_id}/manifest",
                                headers={"Authorization": f"Bearer {BEARER}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_null_and_empty_prefixes_are_served_and_ledgered_like_requests_without_it(stack: Stack) -> None:
    responses = await stack.gate.post(RESPONSES_PATH.format("p1"), json={**RESPONSES, FIELD: None})
    chat = await stack.gate.post(chat_path("p2"), json={**CHAT, FIELD: []})
    assert (responses.status_code, chat.status_code) == (200, 200), (responses.text, chat.text)
    assert chat.json()["choices"][0]["message"]["content"] == "The answer is 17."
    for rollout_id in ("p1", "p2"):
        manifest = await _manifest(stack, rollout_id)
        assert [r["mode"] for r in manifest["records"]] == ["text"] and manifest["failures"] == []
    assert len(stack.staging.records) == 2 and len(stack.engine.prompts) == 2


@pytest.mark.parametrize(
    ("path", "body", "start"),
    [
        (RESPONSES_PATH.format("p3"), {**RESPONSES, FIELD: [3, 4]}, f"{FIELD} holds 2 ids"),
        (chat_path("p3"), {**CHAT, FIELD: [9]}, f"{FIELD} holds 1 ids"),
        (RESPONSES_PATH.format("p3"), {**RESPONSES, FIELD: "3,4"}, f'{FIELD} must be null or a list of token ids'),
        (chat_path("p3"), {**CHAT, FIELD: [-1]}, f"{FIELD} must be null or a list of token ids"),
    ],
)
async def test_refused_prefixes_are_400_naming_the_field_and_nothing_is_generated(stack: Stack, path, body, start) -> None:
    resp = await stack.gate.post(path, json=body)
    error = resp.json()["error"]
    assert (resp.status_code, error["type"], error["param"]) == (400, "invalid_request", FIELD)
    assert error["message"].startswith(start) and "fix: send null" in error["message"]
    assert stack.engine.prompts == [] and stack.staging.records == {} and stack.ledger() == {}
