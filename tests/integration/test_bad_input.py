"""Bad input through the real stack: our capture gate in front of a real vLLM CPU worker.

One stack start (`reliability_probe`, shared with `test_loopback.py`). Every bad request is a
named 4xx (the 5 MB message a 413 at the gate, before forwarding), nothing is ledgered or staged
for it, the start-up window answers 503 with a reason, the control routes need the per-run
bearer, the tokens appear in no log, and after shutdown nothing listens.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

GATE = {
    "malformed_json": (400, "invalid_json", "body"),
    "not_an_object": (400, "invalid_request", "body"),
    "missing_messages": (400, "invalid_request", "messages"),
    "wrong_type_messages": (400, "invalid_request", "messages"),
    "wrong_type_content": (400, "invalid_request", "messages[0].content"),
    "negative_max_tokens": (400, "invalid_request", "max_tokens"),
    "huge_max_tokens": (400, "invalid_request", "max_tokens"),
    "string_max_tokens": (400, "invalid_request", "max_tokens"),
    "stream_not_boolean": (400, "invalid_request", "stream"),
    "stream_options_without_stream": (400, "invalid_request", "stream_options"),
    "n_2": (400, "invalid_request", "n"),
    "forged_admission": (400, "invalid_request", "ng_capture"),
    "five_mb_message": (413, "request_too_large", "body"),
    "rollout_id_space": (400, "invalid_rollout_id", "rollout_id"),
    "rollout_id_overlong": (400, "invalid_rollout_id", "rollout_id"),
    "rollout_id_traversal": (400, "invalid_rollout_id", "rollout_id"),
    "responses_negative": (400, "invalid_request", "max_output_tokens"),
    "responses_huge": (400, "invalid_request", "max_output_tokens"),
}
WORKER = {
    "malformed_json": (400, "invalid_json", "body"),
    "negative_max_tokens": (400, "invalid_request", "max_tokens"),
    "huge_max_tokens": (400, "invalid_request", "max_tokens"),
    "five_mb_message": (400, "context_length_exceeded", "messages"),
    "oversized_body": (413, "request_too_large", "body"),
    "invalid_admission": (400, "invalid_capture_admission", "ng_capture.prev_len"),
    "duplicate_model_call_id": (409, "duplicate_model_call_id", "ng_capture.model_call_id"),
    "prefix_hash_disagrees": (409, "prefix_mismatch", "ng_capture.staging_chain"),
    "prefix_len_disagrees": (409, "prefix_mismatch", "ng_capture.staging_chain"),
    "inline_prefix_outside_vocab": (400, "invalid_capture_admission", "ng_capture.required_prefix_token_ids"),
    # A chain naming a key that was never staged is what a lost staging store looks like: 503, named.
    "unknown_staging_key": (503, "staging_unavailable", "ng_capture.staging_chain"),
}
CONTEXT_LIMIT = ("max_tokens=1000000000 does not fit this model's context: max_model_len=2048 tokens for prompt and "
                 "completion together, so max_tokens must be at most 2047 (fix: lower max_tokens)")


def _answers(cases: dict) -> dict:
    return {name: (a.get("status"), a.get("type"), a.get("param")) for name, a in cases.items()}


def test_every_bad_request_at_the_gate_is_a_named_4xx(reliability_probe):
    assert reliability_probe["good_gate_call"]["status"] == 200, reliability_probe["good_gate_call"]
    assert _answers(reliability_probe["gate_cases"]) == GATE
    assert reliability_probe["gate_cases"]["huge_max_tokens"]["message"] == CONTEXT_LIMIT


def test_every_bad_request_at_the_worker_is_named(reliability_probe):
    assert reliability_probe["good_worker_call"]["status"] == 200, reliability_probe["good_worker_call"]
    assert _answers(reliability_probe["worker_cases"]) == WORKER
    assert reliability_probe["worker_cases"]["huge_max_tokens"]["message"] == CONTEXT_LIMIT


def test_nothing_is_ledgered_or_staged_for_a_refused_request(reliability_probe):
    integrity = reliability_probe["integrity"]
    assert integrity["manifest_records"] == {"good-1": ["text"], "bad-1": [], "bad-2": [], "startup-1": []}
    assert integrity["manifest_failures"] == {"good-1": 0, "bad-1": 0, "bad-2": 0, "startup-1": 0}
    # Exactly the two served admitted calls are staged: the good gate call and the direct root.
    assert integrity["staged_keys"] == sorted([integrity["good_call_key"], "direct-1/c1"])
    state = integrity["worker_state"]
    assert state["status"] == 200 and state["type"] is None


def test_the_start_up_window_answers_503_with_a_reason(reliability_probe):
    startup = reliability_probe["startup"]
    assert (startup["worker_chat"]["status"], startup["worker_chat"]["type"]) == (503, "worker_starting")
    assert (startup["worker_health"]["status"], startup["worker_health"]["type"]) == (503, "worker_starting")
    assert (startup["gate_chat"]["status"], startup["gate_chat"]["type"]) == (503, "upstream_unavailable")


def test_control_routes_need_the_per_run_bearer(reliability_probe):
    control = {name: (a["status"], a["type"]) for name, a in reliability_probe["control"].items()}
    assert control == {
        "worker_none": (401, "control_auth_required"),
        "worker_wrong": (403, "control_auth_invalid"),
        "worker_right": (200, None),
        "gate_none": (401, "control_auth_required"),
        "gate_wrong": (403, "control_auth_invalid"),
        "gate_right": (200, None),
    }


def test_no_token_appears_in_any_log_of_the_run(reliability_probe):
    leaks = reliability_probe["token_leaks"]
    assert leaks["files_scanned"] > 0
    assert leaks["hits"] == {"gate_bearer": [], "worker_control_token": []}


def test_after_shutdown_nothing_answers(reliability_probe):
    after = reliability_probe["after_shutdown"]
    assert set(after["worker"]) == {"refused"} and set(after["gate"]) == {"refused"}
