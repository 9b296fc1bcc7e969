"""The judge's choose_terminal (declared > witnesses > heuristic > mask) over real staged forests, and reward_of.

(`assemble_receipt` and `poison_reason` are gone: poisoning, empty manifests and foreign or duplicate
manifests are the judge's verdicts now, tested in test_judge.py.)
"""

from __future__ import annotations

import pytest
from nemo_gym.token_id_capture import delivery
from nemo_gym.token_id_capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint

from nemo_rl.data.rows import PlaceholderReason
from nemo_rl.token_capture import judge as judge_module
from nemo_rl.token_capture.judge import (
    TERMINAL_CALL_KEY,
    TERMINAL_OUTPUT_FINGERPRINT_KEY,
    TERMINAL_OUTPUT_TEXT_KEY,
    TERMINAL_RESPONSE_ID_KEY,
    TerminalChoice,
    UnknownAttributionMethodError,
    choose_terminal,
    reward_of,
)

RID = "run-s0-g0-i0-a0"
R = PlaceholderReason


def test_declaration_keys_are_gyms():
    assert (TERMINAL_RESPONSE_ID_KEY, TERMINAL_CALL_KEY) == (delivery.TERMINAL_RESPONSE_ID_KEY, delivery.TERMINAL_CALL_KEY)


def test_response_id_witness_names_the_terminal(chains):
    chain = chains.build(RID)
    choice = choose_terminal(chain.records, chains.run_result(1.0, chain.terminal.response_id))

    assert choice == TerminalChoice("call1", "response_id", "response_has_no_output")


def test_no_witness_falls_back_to_the_heuristic_walk(chains):
    chain = chains.build(RID)
    choice = choose_terminal(chain.records, chains.run_result(0.0, response_id=None))

    assert choice == TerminalChoice("call1", "heuristic", "response_has_no_id,response_has_no_output,heuristic=selected")


def test_no_response_object_falls_back_to_the_walk(chains):
    chain = chains.build(RID)
    choice = choose_terminal(chain.records, {"reward": 1.0})

    assert choice == TerminalChoice("call1", "heuristic", "no_response_object,heuristic=selected")


def test_witness_names_the_new_chain_and_the_walk_refuses_two_rooted_chains(chains):
    # A reused rollout id (or a compaction) leaves two roots with descendants; admission order cannot
    # tell which chain was scored: only a witness may choose, the walk refuses.
    old = chains.build(RID, call_prefix="old", admitted_at_base=1.0)
    new = chains.build(RID, call_prefix="new", admitted_at_base=50.0)
    records = [*old.records, *new.records]

    by_witness = choose_terminal(records, chains.run_result(1.0, new.terminal.response_id))
    by_walk = choose_terminal(records, chains.run_result(1.0, None))

    assert (by_witness.call_id, by_witness.selection, by_witness.rejection) == ("new1", "response_id", None)
    assert by_walk == TerminalChoice(
        None, "heuristic", "response_has_no_id,response_has_no_output,heuristic=ambiguous_roots",
        R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:ambiguous_roots")


def test_declared_response_id_wins_and_never_falls_back(chains):
    chain = chains.build(RID)
    declared = {**chains.run_result(1.0, None), TERMINAL_RESPONSE_ID_KEY: chain.records[0].response_id}
    unmatched = {**chains.run_result(1.0, chain.terminal.response_id), TERMINAL_RESPONSE_ID_KEY: "chatcmpl-gone"}

    assert choose_terminal(chain.records, declared) == TerminalChoice(
        "call0", "declared", "response_has_no_id,response_has_no_output")
    assert choose_terminal(chain.records, unmatched) == TerminalChoice(
        None, "declared", "declared_terminal_not_captured", R.TERMINAL_DECLARED_UNMATCHED,
        "terminal_response_id='chatcmpl-gone': declared_terminal_not_captured")


def test_explicit_call_id_is_a_declaration(chains):
    chain = chains.build(RID)
    result = {**chains.run_result(1.0, None), TERMINAL_CALL_KEY: "call0"}

    assert choose_terminal(chain.records, result) == TerminalChoice(
        "call0", "declared", "response_has_no_id,response_has_no_output")


@pytest.mark.parametrize("witness", ["response_id", "heuristic"])
def test_an_explicit_call_id_that_was_not_captured_masks_and_never_falls_back(chains, witness):
    # Without the declaration, the response id (or the heuristic walk) would name call1.
    chain = chains.build(RID)
    scored = chain.terminal.response_id if witness == "response_id" else None
    result = {**chains.run_result(1.0, scored), TERMINAL_CALL_KEY: "call-served-without-custody"}

    assert choose_terminal(chain.records, chains.run_result(1.0, scored)).call_id == "call1"
    assert choose_terminal(chain.records, result) == TerminalChoice(
        None, "declared", "explicit_terminal_not_captured", R.DECLARED_TERMINAL_UNCAPTURED,
        "_ng_terminal_model_call_id='call-served-without-custody' names no committed call")


def test_witnesses_naming_different_sequences_mask_and_count(chains):
    chain = chains.build(RID)
    result = {**chains.run_result(1.0, chain.records[0].response_id), TERMINAL_CALL_KEY: "call1"}

    trail = "response_has_no_output,witness_disagreement[explicit=call1;response_id=call0]"
    assert choose_terminal(chain.records, result) == TerminalChoice(
        None, None, trail, R.TERMINAL_WITNESS_DISAGREEMENT, trail, witness_disagreement=True)


def test_content_witness_maps_to_content(chains):
    chain = chains.build(RID)
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "42"}]}]
    fingerprint = assistant_fingerprint(output)
    terminal = chain.terminal.model_copy(update={"output_fingerprint": fingerprint,
                                                 "fingerprint_version": FINGERPRINT_VERSION})
    result = {"reward": 1.0, "response": {"output": output}}

    assert choose_terminal([chain.records[0], terminal], result) == TerminalChoice(
        "call1", "content", "response_has_no_id")


def test_identical_retries_named_by_one_witness_are_one_answer(trees):
    turn = trees.Turn((1, 2), (3,), (-0.5,))
    tree = trees.build(RID, [trees.Call("c0", None, turn), trees.Call("a", "c0", trees.Turn((4,), (5,), (-0.1,))),
                             trees.Call("b", "c0", trees.Turn((4,), (5,), (-0.1,)))])
    by_id = tree.by_id

    assert choose_terminal(tree.records, trees.run_result(1.0, by_id["b"].response_id)).call_id == "b"
    # The walk does not collapse identical leaves: two childless siblings are ambiguous.
    walk = choose_terminal(tree.records, trees.run_result(1.0, None))
    assert (walk.call_id, walk.rejection, walk.detail) == (
        None, R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:ambiguous_terminal")


def test_ambiguous_branches_without_witness_fail_terminal_selection(trees):
    tree = trees.build(RID, [trees.Call("call0", None, trees.Turn((1, 2), (3,), (-0.5,))),
                             trees.Call("child0", "call0", trees.Turn((4,), (5, 6), (-0.1, -0.2))),
                             trees.Call("child1", "call0", trees.Turn((4,), (7, 8), (-0.1, -0.2)))])
    choice = choose_terminal(tree.records, trees.run_result(1.0, None))

    assert choice == TerminalChoice(
        None, "heuristic", "response_has_no_id,response_has_no_output,heuristic=ambiguous_terminal",
        R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:ambiguous_terminal")


def test_no_records_is_a_selection_failure(chains):
    choice = choose_terminal([], chains.run_result(1.0, "chatcmpl-x"))

    assert choice == TerminalChoice(
        None, "heuristic", "response_id_no_match,response_has_no_output,heuristic=no_records",
        R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:no_records")


def test_an_unknown_attribution_method_is_a_version_error(chains, monkeypatch):
    chain = chains.build(RID)

    class Attribution:
        attributed, method, model_call_id, reason = True, "telepathy", "call1", ""

    monkeypatch.setattr(judge_module, "resolve_terminal", lambda *args, **kwargs: Attribution())
    with pytest.raises(UnknownAttributionMethodError, match="unknown method 'telepathy'"):
        choose_terminal(chain.records, chains.run_result(1.0, None))


def test_a_choice_is_a_call_or_a_rejection_never_both():
    with pytest.raises(ValueError, match="either a terminal call or a rejection"):
        TerminalChoice("c", "heuristic", "", R.TERMINAL_SELECTION_FAILED)
    with pytest.raises(ValueError, match="either a terminal call or a rejection"):
        TerminalChoice(None, None, "")


@pytest.mark.parametrize(
    ("result", "expected"),
    [({"reward": 1}, 1.0), ({"reward": 0.25}, 0.25), ({}, None), ({"reward": None}, None),
     ({"reward": True}, None), ({"reward": "1.0"}, None), ({"reward": float("nan")}, None),
     ({"reward": float("inf")}, None)],
)
def test_reward_is_a_finite_number_or_none(result, expected):
    assert reward_of(result) == expected


# --- the output witness: a client with no response id declares the scored output's text ---------


def _with_output(record, text: str):
    return record.model_copy(update={"output_fingerprint": assistant_fingerprint([{"role": "assistant", "content": text}]),
                                     "fingerprint_version": FINGERPRINT_VERSION})


def test_the_output_keys_are_ours_and_not_gyms():
    assert (TERMINAL_OUTPUT_TEXT_KEY, TERMINAL_OUTPUT_FINGERPRINT_KEY) == (
        "terminal_output_text", "terminal_output_fingerprint")
    assert not hasattr(delivery, "TERMINAL_OUTPUT_TEXT_KEY")


def test_an_output_witness_picks_the_terminal_among_siblings_and_retries(trees):
    # c0 -> {retry a, retry b (identical to a), distinct c}: the harness scored c's text.
    tree = trees.build(RID, [trees.Call("c0", None, trees.Turn((1, 2), (3,), (-0.5,))),
                             trees.Call("a", "c0", trees.Turn((4,), (5,), (-0.1,))),
                             trees.Call("b", "c0", trees.Turn((4,), (5,), (-0.1,))),
                             trees.Call("c", "c0", trees.Turn((4,), (6,), (-0.1,)))])
    by_id = tree.by_id
    records = [_with_output(by_id["c0"], "calling"), _with_output(by_id["a"], "It is 5."),
               _with_output(by_id["b"], "It is 5."), _with_output(by_id["c"], "It is 6.")]
    without = trees.run_result(1.0, None)

    assert choose_terminal(records, {**without, TERMINAL_OUTPUT_TEXT_KEY: "It is 6."}) == TerminalChoice(
        "c", "content", "output_witness")
    # Identical retries (same full sequence) are one answer: the smallest call id.
    assert choose_terminal(records, {**without, TERMINAL_OUTPUT_TEXT_KEY: "It is 5."}) == TerminalChoice(
        "a", "content", "output_witness")
    fingerprint = assistant_fingerprint([{"role": "assistant", "content": "It is 6."}])
    assert choose_terminal(records, {**without, TERMINAL_OUTPUT_FINGERPRINT_KEY: fingerprint}).call_id == "c"
    # Without the witness the walk cannot choose among the childless siblings.
    assert choose_terminal(records, without).rejection is R.TERMINAL_SELECTION_FAILED


def test_an_output_witness_matching_no_call_masks_and_never_falls_back_to_the_walk(chains):
    chain = chains.build(RID)
    records = [_with_output(chain.records[0], "calling"), _with_output(chain.terminal, "It is 5.")]
    result = {**chains.run_result(1.0, None), TERMINAL_OUTPUT_TEXT_KEY: "It is 7."}

    assert choose_terminal(records, chains.run_result(1.0, None)).selection == "heuristic"  # the walk would pick call1
    fingerprint = assistant_fingerprint([{"role": "assistant", "content": "It is 7."}])
    assert choose_terminal(records, result) == TerminalChoice(
        None, "content", "output_witness_unmatched", R.TERMINAL_WITNESS_UNMATCHED,
        f"terminal_output_text/terminal_output_fingerprint {fingerprint[:16]}... matches no committed call's output")
    # Records without fingerprints (or of another canonicalisation version) never match.
    stale = [r.model_copy(update={"fingerprint_version": FINGERPRINT_VERSION + 1}) for r in records]
    assert choose_terminal(stale, {**result, TERMINAL_OUTPUT_TEXT_KEY: "It is 5."}).rejection is R.TERMINAL_WITNESS_UNMATCHED


def test_an_output_witness_naming_distinct_calls_is_ambiguous(trees):
    tree = trees.build(RID, [trees.Call("x", None, trees.Turn((1,), (3,), (-0.5,))),
                             trees.Call("y", None, trees.Turn((2,), (3,), (-0.5,)))])
    records = [_with_output(r, "It is 5.") for r in tree.records]

    assert choose_terminal(records, {**trees.run_result(1.0, None), TERMINAL_OUTPUT_TEXT_KEY: "It is 5."}) == TerminalChoice(
        None, "content", "output_witness_ambiguous", R.TERMINAL_SELECTION_FAILED,
        "terminal_selection_failed:output_witness_ambiguous ['x', 'y']")


def test_an_output_witness_and_a_declared_id_must_agree(chains):
    chain = chains.build(RID)
    records = [_with_output(chain.records[0], "calling"), _with_output(chain.terminal, "It is 5.")]
    base = {**chains.run_result(1.0, None), TERMINAL_OUTPUT_TEXT_KEY: "It is 5."}

    agree = choose_terminal(records, {**base, TERMINAL_RESPONSE_ID_KEY: chain.terminal.response_id})
    assert (agree.call_id, agree.selection) == ("call1", "declared")
    trail = "witness_disagreement[output=call1;declared=call0]"
    assert choose_terminal(records, {**base, TERMINAL_RESPONSE_ID_KEY: chain.records[0].response_id}) == TerminalChoice(
        None, None, trail, R.TERMINAL_WITNESS_DISAGREEMENT, trail, witness_disagreement=True)
