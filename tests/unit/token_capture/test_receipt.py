"""assemble_receipt: witness terminal, heuristic fallback, fail-closed poisoning, reward."""

from __future__ import annotations

import pytest
from nemo_gym.token_id_capture.staging.records import ManifestFailure, RolloutManifest

from nemo_rl.token_capture.receipt import assemble_receipt, poison_reason, reward_of
from nemo_rl.token_capture.rows import PlaceholderReason

RID = "run-s0-g0-i0-a0"


def test_response_id_witness_names_the_terminal(chains):
    chain = chains.build(RID)
    receipt = assemble_receipt(RID, chain.manifest(), chains.run_result(1.0, chain.terminal.response_id))

    assert receipt.capture_poisoned is False
    assert receipt.failure_reason is None
    assert receipt.terminal_model_call_id == "call1"
    assert receipt.terminal_selection == "response_id"
    assert receipt.reward == 1.0
    assert [r.model_call_id for r in receipt.manifest] == ["call0", "call1"]


def test_no_witness_falls_back_to_the_heuristic_walk(chains):
    chain = chains.build(RID)
    receipt = assemble_receipt(RID, chain.manifest(), chains.run_result(0.0, response_id=None))

    assert receipt.capture_poisoned is False
    assert receipt.terminal_model_call_id == "call1"
    assert receipt.terminal_selection == "heuristic"
    assert receipt.terminal_attribution_reason == "response_has_no_id,response_has_no_output,heuristic=selected"


def test_witness_beats_the_walk_on_a_stale_chain_from_a_reused_id(chains):
    # A reused rollout id appends a second chain to the old ledger; the walk prefers the older
    # root (admitted first), only the response-id witness names the chain that was scored.
    old = chains.build(RID, call_prefix="old", admitted_at_base=1.0)
    new = chains.build(RID, call_prefix="new", admitted_at_base=50.0)
    manifest = RolloutManifest(rollout_id=RID, records=[*old.records, *new.records])

    by_witness = assemble_receipt(RID, manifest, chains.run_result(1.0, new.terminal.response_id))
    by_walk = assemble_receipt(RID, manifest, chains.run_result(1.0, None))

    assert (by_witness.terminal_model_call_id, by_witness.terminal_selection) == ("new1", "response_id")
    assert (by_walk.terminal_model_call_id, by_walk.terminal_selection) == ("old1", "heuristic")


def test_any_manifest_failure_poisons_but_keeps_the_attribution(chains):
    chain = chains.build(RID)
    failures = [
        ManifestFailure(model_call_id="c9", reason="worker_capture_failed"),
        ManifestFailure(model_call_id="c9", reason="request_finished_without_staged_coordinates"),
    ]
    receipt = assemble_receipt(RID, chain.manifest(failures), chains.run_result(1.0, chain.terminal.response_id))

    assert receipt.capture_poisoned is True
    assert receipt.failure_reason == "worker_capture_failed"
    assert receipt.terminal_model_call_id == "call1"
    assert receipt.terminal_selection == "response_id"
    assert receipt.reward == 1.0
    assert poison_reason(receipt) is PlaceholderReason.CAPTURE_POISONED


def test_empty_manifest_is_a_typed_outcome(chains):
    receipt = assemble_receipt(RID, RolloutManifest(rollout_id=RID), chains.run_result(1.0, "chatcmpl-x"))

    assert receipt.capture_poisoned is True
    assert receipt.failure_reason == "empty_manifest"
    assert receipt.terminal_selection is None
    assert receipt.manifest == []
    assert poison_reason(receipt) is PlaceholderReason.EMPTY_MANIFEST


def test_failures_without_records_are_capture_poisoned_not_empty(chains):
    failure = ManifestFailure(model_call_id="c0", reason="worker_response_missing_commit_coordinates")
    manifest = RolloutManifest(rollout_id=RID, failures=[failure])
    receipt = assemble_receipt(RID, manifest, chains.run_result(1.0))

    assert receipt.failure_reason == "worker_response_missing_commit_coordinates"
    assert poison_reason(receipt) is PlaceholderReason.CAPTURE_POISONED


def test_ambiguous_branches_without_witness_fail_terminal_selection(chains):
    base = chains.build(RID, turns=[chains.Turn((1, 2), (3,), (-0.5,))])
    root = base.records[0]
    children = [
        root.model_copy(update={"model_call_id": f"child{k}", "parent_call_id": "call0", "mode": "token_in",
                                "prev_len": root.cum_len, "cum_len": root.cum_len + 2, "delta_len": 2,
                                "staging_key": f"{RID}/child{k}", "response_id": f"chatcmpl-child{k}"})
        for k in range(2)
    ]
    manifest = RolloutManifest(rollout_id=RID, records=[root, *children])
    receipt = assemble_receipt(RID, manifest, chains.run_result(1.0, None))

    assert receipt.capture_poisoned is True
    assert receipt.failure_reason == "terminal_selection_failed:ambiguous_terminal"
    assert receipt.terminal_model_call_id is None
    assert receipt.terminal_selection == "heuristic"
    assert poison_reason(receipt) is PlaceholderReason.TERMINAL_SELECTION_FAILED


def test_manifest_of_another_rollout_poisons_and_drops_its_records(chains):
    chain = chains.build("someone-else")
    receipt = assemble_receipt(RID, chain.manifest(), chains.run_result(1.0, chain.terminal.response_id))

    assert receipt.capture_poisoned is True
    assert receipt.failure_reason == "manifest_rollout_mismatch:someone-else"
    assert receipt.manifest == []


def test_duplicate_call_ids_poison(chains):
    chain = chains.build(RID)
    manifest = RolloutManifest(rollout_id=RID, records=[chain.records[0], chain.records[0]])
    receipt = assemble_receipt(RID, manifest, chains.run_result(1.0))

    assert (receipt.capture_poisoned, receipt.failure_reason, receipt.manifest) == (True, "duplicate_model_call_id", [])


@pytest.mark.parametrize(
    ("result", "expected"),
    [({"reward": 1}, 1.0), ({"reward": 0.25}, 0.25), ({}, None), ({"reward": None}, None),
     ({"reward": True}, None), ({"reward": "1.0"}, None), ({"reward": float("nan")}, None),
     ({"reward": float("inf")}, None)],
)
def test_reward_is_a_finite_number_or_none(result, expected):
    assert reward_of(result) == expected


def test_missing_reward_leaves_the_receipt_unpoisoned_with_reward_none(chains):
    chain = chains.build(RID)
    receipt = assemble_receipt(RID, chain.manifest(), chains.run_result(None, chain.terminal.response_id))

    assert (receipt.capture_poisoned, receipt.reward) == (False, None)
