"""finalize_rollout over real Gym-staged chains, and the legacy token-echo row builder."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from nemo_gym.token_id_capture.staging.records import ManifestFailure, RolloutManifest

from nemo_rl.token_capture.finalizer import finalize_rollout, legacy_row_from_result, placeholder_for_poisoned
from nemo_rl.token_capture.receipt import assemble_receipt
from nemo_rl.token_capture.rows import Placeholder, PlaceholderReason, RowOrigin, TrainRow

RID = "run-s1-g2-i3-a0"
SLOT = {"group_index": 2, "sample_index": 3}


def _receipt(chains, chain, *, reward=1.0, witness=True, failures=()):
    response_id = chain.terminal.response_id if witness else None
    return assemble_receipt(RID, chain.manifest(failures), chains.run_result(reward, response_id))


# --- capture path -------------------------------------------------------------------------------


def test_root_plus_token_in_chain_verifies_into_the_exact_row(chains):
    chain = chains.build(RID)
    row = finalize_rollout(_receipt(chains, chain), chain.snapshots, **SLOT)

    assert isinstance(row, TrainRow)
    assert row.token_ids == (11, 12, 13, 14, 21, 22, 23, 31, 32, 41, 42) == chain.full_sequence
    assert row.token_mask == (0.0,) * 4 + (1.0,) * 3 + (0.0,) * 2 + (1.0,) * 2
    assert row.generation_logprobs == (0.0,) * 4 + (-0.5, -0.25, -0.125) + (0.0,) * 2 + (-1.0, -0.75)
    assert (row.prompt_len, row.reward, row.origin) == (4, 1.0, RowOrigin.CAPTURE)
    assert row.model_call_ids == ("call0", "call1")
    assert row.weight_versions == (3, 3)
    assert (row.token_in_calls, row.text_root_calls) == (1, 1)
    assert row.terminal_selection == "response_id"
    assert (row.rollout_id, row.group_index, row.sample_index) == (RID, 2, 3)


def test_heuristic_terminal_row_records_its_selection(chains):
    chain = chains.build(RID)
    row = finalize_rollout(_receipt(chains, chain, witness=False), chain.snapshots, **SLOT)

    assert isinstance(row, TrainRow)
    assert row.terminal_selection == "heuristic"
    assert row.token_ids == chain.full_sequence


def test_three_call_chain_counts_two_token_in_calls(chains):
    turns = [
        chains.Turn((1, 2), (3,), (-0.1,)),
        chains.Turn((4,), (5,), (-0.2,)),
        chains.Turn((6,), (7, 8), (-0.3, -0.4)),
    ]
    chain = chains.build(RID, turns)
    row = finalize_rollout(_receipt(chains, chain), chain.snapshots, **SLOT)

    assert (row.token_in_calls, row.text_root_calls, len(row.model_call_ids)) == (2, 1, 3)
    assert row.token_ids == (1, 2, 3, 4, 5, 6, 7, 8)


def test_manifest_failure_row_poisons(chains):
    chain = chains.build(RID)
    receipt = _receipt(chains, chain, failures=[ManifestFailure(model_call_id="x", reason="unresolved_parent")])
    result = finalize_rollout(receipt, chain.snapshots, **SLOT)

    assert result == Placeholder(RID, 2, 3, PlaceholderReason.CAPTURE_POISONED, "unresolved_parent", 1.0, "response_id")
    assert placeholder_for_poisoned(receipt, **SLOT) == result


def test_digest_corrupted_snapshot_is_a_verification_failure(chains):
    chain = chains.build(RID)
    tampered = chain.snapshots[1].model_copy(update={"token_ids_delta": [31, 32, 41, 99]})
    result = finalize_rollout(_receipt(chains, chain), [chain.snapshots[0], tampered], **SLOT)

    assert result == Placeholder(RID, 2, 3, PlaceholderReason.VERIFICATION_FAILED, "corrupt_digest", 1.0, "response_id")


def test_missing_snapshot_is_a_verification_failure(chains):
    chain = chains.build(RID)
    result = finalize_rollout(_receipt(chains, chain), chain.snapshots[:1], **SLOT)

    assert (result.reason, result.detail) == (PlaceholderReason.VERIFICATION_FAILED, "row_count_mismatch")


def test_snapshots_out_of_manifest_order_are_rejected(chains):
    chain = chains.build(RID)
    result = finalize_rollout(_receipt(chains, chain), chain.snapshots[::-1], **SLOT)

    assert (result.reason, result.detail) == (PlaceholderReason.VERIFICATION_FAILED, "snapshot_order_mismatch")


def test_snapshot_of_another_chain_breaks_the_manifest_match(chains):
    chain = chains.build(RID)
    other = chains.build(RID, [chains.Turn((11, 12, 13, 14), (21, 22, 23), (-0.5, -0.25, -0.125)),
                               chains.Turn((31, 32), (41, 43), (-1.0, -0.75))])
    result = finalize_rollout(_receipt(chains, chain), [chain.snapshots[0], other.snapshots[1]], **SLOT)

    assert (result.reason, result.detail) == (PlaceholderReason.VERIFICATION_FAILED, "wrong_digest")


def test_missing_reward_is_a_placeholder_not_a_zero_reward_row(chains):
    chain = chains.build(RID)
    result = finalize_rollout(_receipt(chains, chain, reward=None), chain.snapshots, **SLOT)

    assert (result.reason, result.reward) == (PlaceholderReason.REWARD_MISSING, None)


def test_empty_manifest_placeholder_keeps_its_reason_and_reward(chains):
    empty = assemble_receipt(RID, RolloutManifest(rollout_id=RID), chains.run_result(0.5))
    result = finalize_rollout(empty, (), **SLOT)
    assert (result.reason, result.detail, result.reward) == (PlaceholderReason.EMPTY_MANIFEST, "empty_manifest", 0.5)


# --- legacy path (capture off) ------------------------------------------------------------------


def _echo(prompt, generated, logprobs, item_id="msg_1"):
    return {"id": item_id, "type": "message", "prompt_token_ids": prompt, "generation_token_ids": generated,
            "generation_log_probs": logprobs}


def _legacy(output, reward=1.0):
    result = {"response": {"output": output}, "reward": reward}
    return legacy_row_from_result(result, rollout_id=RID, **SLOT)


def test_legacy_contiguous_calls_become_carry_plus_generation():
    row = _legacy([
        _echo([1, 2], [3], [-0.1], "fc_1"),
        {"type": "function_call_output", "call_id": "fc_1", "output": "42"},
        _echo([1, 2, 3, 4, 5], [6, 7], [-0.2, -0.3], "msg_2"),
    ])

    assert isinstance(row, TrainRow)
    assert row.token_ids == (1, 2, 3, 4, 5, 6, 7)
    assert row.token_mask == (0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0)
    assert row.generation_logprobs == (0.0, 0.0, -0.1, 0.0, 0.0, -0.2, -0.3)
    assert (row.prompt_len, row.model_call_ids, row.weight_versions) == (2, ("fc_1", "msg_2"), (None, None))
    assert row.origin is RowOrigin.LEGACY
    assert (row.token_in_calls, row.text_root_calls, row.terminal_selection) == (0, 0, None)


def test_legacy_noncontiguous_prompt_is_a_placeholder():
    result = _legacy([_echo([1, 2], [3], [-0.1]), _echo([1, 2, 9, 4], [6], [-0.2])])

    assert isinstance(result, Placeholder)
    assert result.reason is PlaceholderReason.LEGACY_NONCONTIGUOUS
    assert result.detail == "call 1 prompt (4 ids) does not extend the 3 ids seen so far"
    assert result.reward == 1.0


def test_legacy_truncated_history_is_noncontiguous():
    result = _legacy([_echo([1, 2], [3], [-0.1]), _echo([1, 2], [6], [-0.2])])
    assert result.reason is PlaceholderReason.LEGACY_NONCONTIGUOUS


def test_legacy_without_echo_is_a_placeholder():
    assert _legacy([{"type": "message", "id": "m"}]).reason is PlaceholderReason.LEGACY_TOKEN_ECHO_MISSING
    no_response = legacy_row_from_result({"reward": 1.0}, rollout_id=RID, **SLOT)
    assert no_response.reason is PlaceholderReason.LEGACY_TOKEN_ECHO_MISSING


def test_legacy_malformed_echo_is_a_placeholder():
    partial = {"prompt_token_ids": [1], "generation_token_ids": [2]}
    assert _legacy([partial]).reason is PlaceholderReason.LEGACY_INVALID_ECHO
    assert _legacy([_echo([1], [2, 3], [-0.1])]).reason is PlaceholderReason.LEGACY_INVALID_ECHO
    assert _legacy([_echo([1], [2], [math.nan])]).reason is PlaceholderReason.LEGACY_INVALID_ECHO
    assert _legacy([_echo([1, -4], [2], [-0.1])]).reason is PlaceholderReason.LEGACY_INVALID_ECHO
    assert _legacy([_echo("12", [2], [-0.1])]).reason is PlaceholderReason.LEGACY_INVALID_ECHO


def test_legacy_without_generated_tokens_or_reward_is_a_placeholder():
    assert _legacy([_echo([1, 2], [], [])]).reason is PlaceholderReason.EMPTY_GENERATION
    assert _legacy([_echo([1, 2], [3], [-0.1])], reward=None).reason is PlaceholderReason.REWARD_MISSING


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 50_000), max_size=6),
            st.lists(st.tuples(st.integers(0, 50_000), st.floats(-20.0, 0.0)), min_size=1, max_size=6),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_legacy_row_is_the_concatenation_of_calls(calls):
    output, sequence, mask = [], [], []
    for k, (tail, generated) in enumerate(calls):
        gen_ids = [t for t, _ in generated]
        output.append(_echo(sequence + tail, gen_ids, [lp for _, lp in generated], f"msg_{k}"))
        sequence = sequence + tail + gen_ids
        mask += [0.0] * len(tail) + [1.0] * len(gen_ids)

    row = _legacy(output)

    assert row.token_ids == tuple(sequence)
    assert row.token_mask == tuple(mask)
    assert row.prompt_len == len(calls[0][0])
    assert [lp for m, lp in zip(row.token_mask, row.generation_logprobs) if m == 1.0] == [
        lp for _, generated in calls for _, lp in generated
    ]
