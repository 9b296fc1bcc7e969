"""Attacks on the judge's promise: a row holds exactly the sampled tokens with verified lineage.

Each test forges one piece of evidence over REAL staged forests (Gym's capture core signs them, so
every forged row carries self-consistent digests, as a buggy worker or a misfiled store would) and
pins the exact verdict. Rejections already pinned elsewhere are not repeated here (test_judge.py).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nemo_rl.algorithms.grpo_single_controller import build_train_batch
from nemo_rl.data.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason, RolloutYield
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RolloutEvidence, judge_rollout

R = PlaceholderReason
RID = "run-s1-g0-i0-a0"
CFG = TokenCaptureConfig()


def _judge(tree, terminal: str, *, records=None, snapshots=None, sample=0):
    manifest = tree.manifest(records=records)
    run = {"response": {"id": tree.by_id[terminal].response_id, "output": []}, "reward": 1.0}
    ev = RolloutEvidence(tree.rollout_id, 0, sample, run, None, manifest, None, tuple(tree.served()))
    return judge_rollout(ev, tree.snapshots_by_key if snapshots is None else snapshots, {}, CFG)


def _plain(trees, rollout_id=RID, generated=(21, 22, 23)):
    return trees.build(rollout_id, [
        trees.Call("c0", None, trees.Turn((11, 12), generated, (-0.5, -0.25, -0.125))),
        trees.Call("c1", "c0", trees.Turn((31,), (41, 42), (-1.0, -0.75))),
    ])


def test_a_record_naming_another_rollouts_staged_row_is_refused(trees):
    # A replayed call: rollout RID's manifest names rollout OTHER's row for c1 (same ids, same tokens).
    tree, other = _plain(trees), _plain(trees, rollout_id="run-s1-g0-i1-a0")
    foreign = other.by_id["c1"]
    records = [tree.by_id["c0"], foreign]
    snapshots = {**tree.snapshots_by_key, foreign.staging_key: other.snapshot("c1")}
    result = _judge(tree, "c1", records=records, snapshots=snapshots)

    assert isinstance(result, Placeholder)
    assert (result.reason, result.detail) == (R.VERIFICATION_FAILED, "wrong_rollout")


def test_a_record_whose_key_holds_another_calls_row_is_refused(trees):
    # The store answers c1's key with c0's (valid, signed) row: the snapshot is not the call it is filed under.
    tree = _plain(trees)
    snapshots = {**tree.snapshots_by_key, tree.by_id["c1"].staging_key: tree.snapshot("c0")}
    result = _judge(tree, "c1", snapshots=snapshots)

    assert (result.reason, result.detail) == (R.VERIFICATION_FAILED, "duplicate_snapshot")


def test_a_forged_token_in_continuation_is_refused(trees):
    # c1 was staged on top of a DIFFERENT c0 (same id and length, other sampled tokens): its prompt is not
    # this c0's prompt + completion, though its own record and row agree and are signed.
    tree, forged = _plain(trees), _plain(trees, generated=(24, 25, 26))
    records = [tree.by_id["c0"], forged.by_id["c1"]]
    snapshots = {**tree.snapshots_by_key, forged.by_id["c1"].staging_key: forged.snapshot("c1")}
    result = _judge(tree, "c1", records=records, snapshots=snapshots)

    assert (result.reason, result.detail) == (R.VERIFICATION_FAILED, "chain_hash_mismatch")


def test_a_generation_that_is_all_prompt_is_refused(trees):
    # An empty completion: the worker staged c1's delta with no generated token.
    tree = trees.build(RID, [trees.Call("c0", None, trees.Turn((11, 12), (21,), (-0.5,))),
                             trees.Call("c1", "c0", trees.Turn((31, 32), (), ()))])
    result = _judge(tree, "c1")

    assert (result.reason, result.detail) == (R.VERIFICATION_FAILED, "empty_generation")


def test_a_root_with_no_prompt_token_is_masked_not_trained(trees):
    # FOUND: a root staged with an empty prompt verified and was kept; its first token has no prefix,
    # so the trainer's TrainBatch refused the whole step (the run stopped) instead of masking the rollout.
    tree = trees.build(RID, [trees.Call("c0", None, trees.Turn((), (21, 22), (-0.5, -0.25)))])
    result = _judge(tree, "c0")

    assert result == Placeholder(
        RID, 0, 0, R.VERIFICATION_FAILED,
        "empty_prompt: call c0 stages no prompt token before its first generated token", 1.0, "response_id",
        RolloutYield(2, 0, (("verification_failed", 2),), 1, False, lineage=result.yield_.lineage))


def test_a_sampled_token_with_a_positive_logprob_is_masked_not_trained(trees):
    # FOUND: Gym's digest takes any finite logprob; a kept row with logprob > 0 on a loss token made the
    # trainer's TrainBatch refuse the step. The rollout is masked instead, and the group keeps its slot.
    tree = _plain(trees)
    bad = trees.build("run-s1-g0-i1-a0", [trees.Call("c0", None, trees.Turn((11, 12), (21, 22, 23), (-0.5, 0.25, -0.125))),
                            trees.Call("c1", "c0", trees.Turn((31,), (41, 42), (-1.0, -0.75)))])
    result = _judge(bad, "c1", sample=1)

    assert isinstance(result, Placeholder)
    assert (result.reason, result.detail) == (
        R.VERIFICATION_FAILED, "positive_logprob: token 3 of the row was sampled with logprob 0.25 > 0")
    kept = _judge(tree, "c1")
    assert isinstance(kept, KeptRollout)
    batch = build_train_batch([GroupResult(0, (kept, result))], normalize=False, train_partition="train").rows
    assert batch.num_samples == 1 and batch.token_ids == (tree.sequences["c1"],)


def test_a_bad_non_terminal_chain_is_dropped_alone(trees):
    # A sub-agent root with no prompt token beside the scored chain: only its own tokens are lost.
    tree = trees.build(RID, [
        trees.Call("c0", None, trees.Turn((11, 12), (21, 22), (-0.5, -0.25))),
        trees.Call("c1", "c0", trees.Turn((31,), (41,), (-1.0,))),
        trees.Call("s0", None, trees.Turn((), (51, 52, 53), (-0.1, -0.2, -0.3))),
    ])
    result = _judge(tree, "c1")

    assert isinstance(result, KeptRollout)
    assert [row.model_call_ids for row in result.rows] == [("c0", "c1")]
    assert result.yield_.unverifiable == (("verification_failed", 3),)


@pytest.mark.parametrize("policy", ["all_chains", "terminal_chain"])
def test_no_kept_row_of_a_forged_forest_breaks_the_trainers_rules(trees, policy):
    # Whatever the judge keeps, the driver's TrainBatch takes: the judge and the trainer agree on the rules.
    tree = trees.build(RID, [
        trees.Call("c0", None, trees.Turn((11,), (21, 22), (-0.5, -0.25))),
        trees.Call("c1", "c0", trees.Turn((31,), (41,), (-1.0,))),
        trees.Call("s0", None, trees.Turn((), (51,), (-0.1,))),
        trees.Call("s1", "s0", trees.Turn((61,), (71,), (0.5,))),
    ])
    ev = RolloutEvidence(RID, 0, 0, {"response": {"id": tree.by_id["c1"].response_id}, "reward": 1.0}, None,
                         tree.manifest(), None, tuple(tree.served()))
    result = judge_rollout(ev, tree.snapshots_by_key, {}, TokenCaptureConfig(branch_policy=policy))

    assert [row.model_call_ids for row in result.rows] == [("c0", "c1")]
    assert build_train_batch([GroupResult(0, (result,))], normalize=False, train_partition="train").rows.token_ids == (tree.sequences["c1"],)


@pytest.mark.parametrize(("staged", "failure"), [(True, None), (False, "stage_timeout")])
def test_the_walk_does_not_credit_a_reward_a_call_without_a_record_may_have_earned(trees, staged, failure):
    # FOUND: the scored reply (chatcmpl-z) continued c1 but never reached the ledger (staged and not
    # committed, or not staged with no failure row). The walk cannot see it, so it named c1 and the
    # rollout's reward was credited to c0 -> c1. The walk is refused, as for a failure row.
    from nemo_rl.data.calls import ServedCall

    tree = _plain(trees)
    served = (*tree.served(), ServedCall(RID, "z", "c1", "token_in", 4, staged, failure))
    run = {"response": {"id": "chatcmpl-z", "output": []}, "reward": 1.0}
    ev = RolloutEvidence(RID, 0, 0, run, None, tree.manifest(), None, served)
    result = judge_rollout(ev, tree.snapshots_by_key, {}, CFG)

    assert isinstance(result, Placeholder)
    assert (result.reason, result.detail, result.terminal_selection) == (
        R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:heuristic_with_uncommitted_calls ['z']", "heuristic")
    without = RolloutEvidence(RID, 0, 0, run, None, tree.manifest(), None, tuple(tree.served()))
    assert judge_rollout(without, tree.snapshots_by_key, {}, CFG).terminal_selection == "heuristic"  # kept


def _resigned(snapshot, **changes):
    """`snapshot` with `changes` and a digest recomputed over them, as a worker that staged them would sign it."""
    from nemo_gym.token_id_capture.staging import StagedCallBaseSnapshot, compute_staging_digest

    fields = {**snapshot.model_dump(exclude={"digest"}), **changes}
    return StagedCallBaseSnapshot(**fields, digest=compute_staging_digest(**fields))


def test_a_loss_mask_over_a_calls_prompt_tokens_is_refused_by_the_served_count(trees):
    # FOUND: c1's delta is [31 (a tool token, carry), 41, 42 (sampled)]. A worker that staged its mask as
    # all 1.0 signs a row every digest and hash accepts (they bind ids and mask, not which is which), and
    # token 31 was trained as if sampled. The worker's served report says it sampled 2: the judge checks.
    tree = _plain(trees)
    forged = _resigned(tree.snapshot("c1"), token_mask_delta=[1.0, 1.0, 1.0])
    records = [tree.by_id["c0"], tree.by_id["c1"].model_copy(update={"digest": forged.digest})]
    snapshots = {**tree.snapshots_by_key, forged.staging_key: forged}
    result = _judge(tree, "c1", records=records, snapshots=snapshots)

    assert isinstance(result, Placeholder)
    assert (result.reason, result.detail) == (
        R.VERIFICATION_FAILED, "generated_count_mismatch: call c1 stages 3 generated tokens, the worker reported "
                               "serving [2]")
    assert isinstance(_judge(tree, "c1"), KeptRollout)  # the honest row trains


@st.composite
def _forged_forests(draw):
    """2-4 calls (roots may have no prompt token, logprobs may be > 0) and maybe one call whose staged mask
    was re-signed to cover its carry tokens; the scored call is any of them."""
    calls = []
    for index in range(draw(st.integers(2, 4))):
        parent = draw(st.sampled_from([None] + [c[0] for c in calls])) if calls else None
        tail = tuple(draw(st.lists(st.integers(1, 99), min_size=0, max_size=2)))
        generated = tuple(draw(st.lists(st.integers(100, 199), min_size=1, max_size=3)))
        logprobs = tuple(draw(st.sampled_from((-0.5, -0.125, 0.0, 0.5))) for _ in generated)
        calls.append((f"k{index}", parent, tail, generated, logprobs))
    forge = draw(st.sampled_from([None] + [c[0] for c in calls if c[2]]))
    return calls, forge, draw(st.sampled_from([c[0] for c in calls]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(forest=_forged_forests())
def test_whatever_the_judge_keeps_the_trainer_takes_and_only_sampled_tokens_are_in_the_loss(trees, forest):
    calls, forge, scored = forest
    tree = trees.build(RID, [trees.Call(i, p, trees.Turn(t, g, lp)) for i, p, t, g, lp in calls])
    records, snapshots = list(tree.records), tree.snapshots_by_key
    if forge is not None:
        forged = _resigned(tree.snapshot(forge), token_mask_delta=[1.0] * len(tree.snapshot(forge).token_mask_delta))
        records = [r.model_copy(update={"digest": forged.digest}) if r.model_call_id == forge else r for r in records]
        snapshots = {**snapshots, forged.staging_key: forged}
    result = _judge(tree, scored, records=records, snapshots=snapshots)  # never raises

    assert isinstance(result, (KeptRollout, Placeholder)) and (result.rollout_id, result.sample_index) == (RID, 0)
    # Nothing forged (no re-signed mask, no positive logprob, a prompt token before every root's
    # generation): the rollout must be kept, so a judge that masks everything fails here.
    honest = forge is None and all(lp <= 0.0 for *_, lps in calls for lp in lps) and all(t for _, p, t, *_ in calls if p is None)
    event("honest" if honest else "forged")
    if isinstance(result, Placeholder):
        assert not honest, f"nothing was forged, yet the rollout was masked: {result.reason.value}: {result.detail}"
        return
    batch = build_train_batch([GroupResult(0, (result,))], normalize=False, train_partition="train").rows  # the trainer takes every row
    assert batch.num_samples == len(result.rows)
    generated = {i: g for i, _, _, g, _ in calls}
    for row in result.rows:
        for call_id, (start, end) in zip(row.model_call_ids, row.call_spans):
            loss = [t for t, m in zip(row.token_ids[start:end], row.token_mask[start:end]) if m == 1.0]
            assert loss in ([], list(generated[call_id]))  # a call's sampled ids, or masked (owned elsewhere)
            assert call_id != forge
