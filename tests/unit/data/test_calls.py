"""`nemo_rl.data.calls`: the chat-request rules, the rollout-id rule and the served-call record.

The request rules are shared by the worker and the gate: each bad field is named, exactly. Minted
rollout ids pass the one rollout-id rule, and every caller refuses the same ids. The worker marks a
`text` admission over a history with assistant turns as an unresolved continuation; the gate decided
"root" for it by Gym's rule (`assistant_fingerprint` empty means no assistant output), so
`has_assistant_turn` must agree with that rule on every request, or the capture-health figures would
count a root as a miss (or hide a miss). The gate reads the rules without loading torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.fingerprint import assistant_fingerprint
from nemo_gym.token_id_capture.store import validate_rollout_id

from nemo_rl.data.calls import (
    DEFAULT_MAX_ROLLOUT_ID_CHARS,
    MAX_ROLLOUT_ID_CHARS,
    RequestFieldError,
    RolloutIdError,
    ServedCall,
    bearer_status,
    check_chat_request,
    check_rollout_id,
    has_assistant_turn,
    parse_json_body,
    rewrite_json_body,
    rollout_id_for,
)
from nemo_rl.data.errors import RecordInvariantError

L = 2048
USER = {"role": "user", "content": "What is 2 + 2?"}
GOOD = {"model": "tiny", "messages": [USER], "max_tokens": 16}
TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{\"expression\": \"2+2\"}"}}


def _field(body: object) -> tuple[str, str]:
    with pytest.raises(RequestFieldError) as e:
        check_chat_request(body, max_model_len=L)
    return e.value.field, e.value.message


def test_a_good_request_passes_with_tools_calls_parts_and_nulls() -> None:
    check_chat_request(GOOD, max_model_len=L)
    check_chat_request(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                USER,
                {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            ],
            "tools": [TOOL],
            "max_tokens": None,
            "temperature": 0,
            "top_p": 1,
            "seed": 2**63 - 1,
            "n": 1,
            "stream": False,
            "logprobs": True,
            "return_token_ids": True,
            "top_logprobs": 0,
            "required_prefix_token_ids": [],
        },
        max_model_len=L,
    )


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ([1, 2], "body", "request body must be a JSON object, got list"),
        ({}, "messages", "messages must be a non-empty list of messages, got null null"),
        ({"messages": []}, "messages", "messages must be a non-empty list of messages, got list []"),
        ({"messages": "hi"}, "messages", 'messages must be a non-empty list of messages, got str "hi"'),
        ({"messages": [3]}, "messages[0]", "messages[0] must be an object, got int 3"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
         'messages[0].role="robot" must be one of system, developer, user, assistant, tool'),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
         "messages[0].content must be a string, a list of text parts or null, got int"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type",
         'messages[0].content[0].type="image_url" is not supported: this model serves text parts only '
         "(text, input_text, output_text)"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text",
         "messages[0].content[0].text must be a string, got int"),
        ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name",
         "messages[0].name must be a string, got int"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls",
         "messages[0].tool_calls is only allowed on assistant messages"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}]},
         "messages[0].tool_calls[0].function.name", "messages[0].tool_calls[0].function.name must be a non-empty string"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
         "messages[0].tool_calls[0].function.arguments",
         "messages[0].tool_calls[0].function.arguments must be a JSON string or an object, got int"),
        ({**GOOD, "tools": {"a": 1}}, "tools", 'tools must be a list, got dict {"a": 1}'),
        ({**GOOD, "tools": [{"type": "function", "function": {"name": 7}}]}, "tools[0].function.name",
         "tools[0].function.name must be a non-empty string"),
        ({**GOOD, "stream": "yes"}, "stream", 'stream must be a boolean, got str "yes"'),
        ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options",
         "stream_options is only valid with stream=true (fix: drop it)"),
        ({**GOOD, "n": 2}, "n", "n=2 is not supported: n must be 1 (custody is per single choice)"),
        ({**GOOD, "n": True}, "n", "n=true is not supported: n must be 1 (custody is per single choice)"),
        ({**GOOD, "max_tokens": -5}, "max_tokens", "max_tokens=-5 must be at least 1 (fix: ask for 1 or more tokens)"),
        ({**GOOD, "max_tokens": 0}, "max_tokens", "max_tokens=0 must be at least 1 (fix: ask for 1 or more tokens)"),
        ({**GOOD, "max_tokens": True}, "max_tokens", "max_tokens must be an integer, got bool true"),
        ({**GOOD, "max_tokens": "16"}, "max_tokens", 'max_tokens must be an integer, got str "16"'),
        ({**GOOD, "max_tokens": 10**9}, "max_tokens",
         "max_tokens=1000000000 does not fit this model's context: max_model_len=2048 tokens for prompt and "
         "completion together, so max_tokens must be at most 2047 (fix: lower max_tokens)"),
        ({**GOOD, "max_tokens": None, "max_completion_tokens": 2048}, "max_completion_tokens",
         "max_completion_tokens=2048 does not fit this model's context: max_model_len=2048 tokens for prompt and "
         "completion together, so max_completion_tokens must be at most 2047 (fix: lower max_completion_tokens)"),
        ({**GOOD, "temperature": -1}, "temperature", "temperature must be a finite number >= 0, got int -1"),
        ({**GOOD, "temperature": "hot"}, "temperature", 'temperature must be a finite number >= 0, got str "hot"'),
        ({**GOOD, "top_p": 0}, "top_p", "top_p must be a number in (0, 1], got int 0"),
        ({**GOOD, "top_p": 1.5}, "top_p", "top_p must be a number in (0, 1], got float 1.5"),
        ({**GOOD, "seed": 2**64}, "seed", "seed must be a 64-bit integer, got int 18446744073709551616"),
        ({**GOOD, "logprobs": "yes"}, "logprobs", 'logprobs must be a boolean, got str "yes"'),
        ({**GOOD, "top_logprobs": -1}, "top_logprobs", "top_logprobs must be an integer >= 0, got int -1"),
        ({**GOOD, "model": 1}, "model", "model must be a string, got int 1"),
        ({**GOOD, "required_prefix_token_ids": [1, -2]}, "required_prefix_token_ids",
         "required_prefix_token_ids must be a list of token ids (integers >= 0), got list [1, -2]"),
    ],
)
def test_each_bad_field_is_named_with_its_value_and_fix(body: object, field: str, message: str) -> None:
    assert _field(body) == (field, message)


def test_long_values_are_cut_in_messages() -> None:
    field, message = _field({"messages": "x" * 5000})
    assert field == "messages" and message.endswith("...<5002 chars>") and len(message) < 200


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "request body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        (b'{"temperature": NaN}', "request body contains NaN, which is not JSON (fix: send finite numbers)"),
        (b'{"top_p": -Infinity}', "request body contains -Infinity, which is not JSON (fix: send finite numbers)"),
        (b"\xff\xfe\xfa", "request body is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "request body nests JSON too deeply to parse"),
    ],
)
def test_bodies_are_strict_json(raw: bytes, message: str) -> None:
    with pytest.raises(RequestFieldError) as e:
        parse_json_body(raw)
    assert e.value.field == "body" and e.value.message.startswith(message)


def test_control_bearer_is_401_without_403_wrong_and_none_when_right() -> None:
    token = "s3cret-token"
    assert [bearer_status(h, token) for h in (None, "", "Bearer", "Bearer  ", "Basic s3cret-token", "s3cret-token")] == [401] * 6
    assert [bearer_status(h, token) for h in ("Bearer nope", "Bearer s3cret-token2", "Bearer s3crét")] == [403] * 3
    assert [bearer_status(h, token) for h in ("Bearer s3cret-token", "bearer s3cret-token", " Bearer s3cret-token ")] == [None] * 3
    with pytest.raises(ValueError, match="non-empty bearer token"):
        bearer_status("Bearer x", "")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
FIELDS = ["messages", "tools", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "stream",
          "logprobs", "return_token_ids", "top_logprobs", "model", "required_prefix_token_ids"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6))
def test_any_json_either_passes_or_names_a_field_it_contains(extra: dict) -> None:
    body = {**GOOD, **extra}
    try:
        check_chat_request(body, max_model_len=L)
    except RequestFieldError as e:
        top = e.field.split("[")[0].split(".")[0]
        assert top in body or top == "messages"  # a missing messages is named too
        assert e.message and json.dumps({"param": e.field, "message": e.message})


def test_minted_ids_name_the_attempt_and_pass_the_rule() -> None:
    rid = rollout_id_for("grpo-1a2b3c4d", 7, 3, 15, 2)
    assert rid == "grpo-1a2b3c4d-s7-g3-i15-a2"
    assert check_rollout_id(rid) == rid == validate_rollout_id(rid)


def test_a_run_id_that_cannot_start_an_id_fails_at_minting() -> None:
    with pytest.raises(RolloutIdError, match='it starts with "-"'):
        rollout_id_for("-run", 0, 0, 0, 0)
    with pytest.raises(RolloutIdError, match="too long"):
        rollout_id_for("r" * DEFAULT_MAX_ROLLOUT_ID_CHARS, 0, 0, 0, 0)


@pytest.mark.parametrize(
    ("rollout_id", "problem"),
    [
        ("", "the rollout id is empty"),
        ("a" * 129, "rollout id of 129 characters is too long"),
        ("a b", 'rollout id "a b" is not usable: it contains " "'),
        ("_x", 'rollout id "_x" is not usable: it starts with "_"'),
        (7, "the rollout id is a int, not a str"),
    ],
)
def test_the_error_names_the_problem_and_the_rule(rollout_id: object, problem: str) -> None:
    with pytest.raises(RolloutIdError) as e:
        check_rollout_id(rollout_id)
    assert e.value.problem == problem
    assert str(e.value) == f"{problem}; a rollout id is 1..128 ASCII letters, digits, '.', '_' or '-', starting " \
                           "with a letter or digit"


def test_limits_are_bounded_by_the_ceiling() -> None:
    assert check_rollout_id("r" * MAX_ROLLOUT_ID_CHARS, MAX_ROLLOUT_ID_CHARS)
    for bad in (0, MAX_ROLLOUT_ID_CHARS + 1, 1.5):
        with pytest.raises(ValueError, match="a rollout-id limit is an int"):
            check_rollout_id("r", bad)


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_every_id_the_rule_accepts_gym_accepts(rollout_id: str) -> None:
    try:
        check_rollout_id(rollout_id)
    except RolloutIdError:
        return
    assert validate_rollout_id(rollout_id) == rollout_id


_TEXT = st.text(max_size=12)
_TOOL_CALL = st.fixed_dictionaries({
    "id": st.sampled_from(["call_1", "call_2"]), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.just("calculator"),
                                       "arguments": st.sampled_from(['{"expression": "1 + 2"}', "{}", "not json"])}),
})
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]), "content": _TEXT}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("call_1"), "content": _TEXT}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), _TEXT)},
                          optional={"tool_calls": st.lists(_TOOL_CALL, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"), "name": st.just("calculator"),
                           "arguments": st.just("{}")}),
)


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(_MESSAGE, max_size=6))
def test_the_workers_rule_is_gyms_rule_for_assistant_output(messages):
    assert has_assistant_turn(messages) == bool(assistant_fingerprint(messages))


def test_an_empty_assistant_turn_is_still_a_turn():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert has_assistant_turn(history) is True and bool(assistant_fingerprint(history)) is True
    assert has_assistant_turn([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) is False


def test_only_a_text_admission_can_be_an_unresolved_continuation():
    root = ServedCall("r", "c2", None, "text", 3, True, unresolved_continuation=True)
    assert ServedCall.from_wire(root.to_wire()) == root
    with pytest.raises(RecordInvariantError, match="True only for a text admission") as excinfo:
        ServedCall("r", "c2", "c1", "token_in", 3, True, unresolved_continuation=True)
    assert excinfo.value.kind == "served_call"
    with pytest.raises(RecordInvariantError, match="unresolved_continuation is a bool") as excinfo:
        ServedCall("r", "c2", None, "text", 3, True, unresolved_continuation=1)
    assert excinfo.value.kind == "served_call"


def test_the_rules_load_without_torch():
    # The gate and Gym's servers import the rules; only the row codec may pay torch's import
    # (test_staging.py round-trips Gym's golden record through it).
    probe = (
        "import sys\n"
        "from nemo_rl.data import calls\n"
        "calls.check_chat_request({'messages': [{'role': 'user', 'content': 'hi'}]}, max_model_len=8)\n"
        "calls.check_rollout_id(calls.rollout_id_for('run', 0, 0, 0, 0))\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "importing nemo_rl.data.calls and running its rules loaded torch"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=100)
@given(body=st.dictionaries(st.text(max_size=4), _JSON, max_size=4))
def test_rewrite_json_body_returns_the_same_bytes_unless_the_rewrite_changes_the_body(body):
    raw = json.dumps(body).encode()
    assert rewrite_json_body(raw, lambda b: b) is raw
    added = rewrite_json_body(raw, lambda b: {**b, "added": "é"})
    assert added == json.dumps({**body, "added": "é"}, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def test_rewrite_json_body_leaves_bytes_that_are_not_json():
    for raw in (b"{not json", b"\xff\xfe", b""):
        assert rewrite_json_body(raw, lambda b: {"changed": True}) is raw


# --- the staged-row codec under attack: a row that is not exactly the staged record never reads back ----


def _staged_row(chains):
    from nemo_rl.data.calls import record_to_row

    record = next(r for r in chains.build("r-codec").staged if r.parent_call_id is not None)
    return record.staging_key, record_to_row(record)


def _forged(chains, name, forge):
    import torch

    key, row = _staged_row(chains)
    value = row[name]
    row[name] = forge(value, torch) if callable(forge) else forge
    return key, row


@pytest.mark.parametrize(
    ("name", "forge", "message"),
    [
        # a truncated logprob list (len != token ids): Gym's digest recomputation refuses the lengths
        ("generation_log_probs_delta", lambda t, torch: t[:-1], "must have equal lengths"),
        # float/int confusion: ids as floats (the values are equal, the type is not)
        ("token_ids_delta", lambda t, torch: t.to(torch.float64), "valid integer"),
        # a loss mask that covers the call's prompt (carry) tokens: the digest binds the mask
        ("token_mask_delta", lambda t, torch: torch.ones_like(t), "digest does not match"),
        # a negative (out-of-range) id
        ("token_ids_delta", lambda t, torch: torch.cat([t[:-1], torch.tensor([-1])]), "must be non-negative"),
        # a header whose integer field became a float or a bool (JSON has one number type)
        ("header", lambda h, torch: h.replace('"prev_len": 7', '"prev_len": 7.0'), "valid integer"),
        ("header", lambda h, torch: h.replace('"weight_version": 3', '"weight_version": true'), "valid integer"),
    ],
)
def test_a_staged_row_that_is_not_the_record_is_invalid_by_key(chains, name, forge, message):
    from nemo_rl.data.calls import StagedRecordInvalidError, row_to_snapshot

    key, row = _staged_row(chains)
    assert row_to_snapshot(key, row).staging_key == key  # the untouched row reads back
    key, row = _forged(chains, name, forge)
    with pytest.raises(StagedRecordInvalidError, match=f"(?s)under key '{key}' is invalid: .*{message}"):
        row_to_snapshot(key, row)


def test_a_header_with_reordered_fields_is_the_same_record(chains):
    # JSON key order is not content: a re-serialised header reads back as the identical snapshot.
    from nemo_rl.data.calls import HEADER_FIELD, row_to_snapshot

    key, row = _staged_row(chains)
    reordered = dict(row, **{HEADER_FIELD: json.dumps(dict(reversed(json.loads(row[HEADER_FIELD]).items())))})
    assert reordered[HEADER_FIELD] != row[HEADER_FIELD]
    assert row_to_snapshot(key, reordered) == row_to_snapshot(key, row)
