"""judge_rollout over REAL staged forests (Gym's RolloutTokenCapture digests, real verify_and_linearize).

Every PlaceholderReason the judge can produce is produced here; the keep cases pin exact ids, masks,
logprobs, call spans and the RolloutYield against the workers' served report. `fetch_snapshots` is
unit-tested with fake sources (a pure function over the SnapshotSource protocol).
"""

from __future__ import annotations

import pytest
from nemo_gym.token_id_capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint
from nemo_gym.token_id_capture.staging.records import ManifestFailure, RolloutManifest

from nemo_rl.data.rows import CallLineage, KeptRollout, Placeholder, PlaceholderReason, RolloutYield, RowOrigin
from nemo_rl.data.calls import (
    ServedCall,
    StagedRecordInvalidError,
)
from nemo_rl.data_plane.partitions import StagedKeysMissingError, StagingStoreUnavailableError
from nemo_rl.experience.finalizer_pool import fetch_snapshots
from nemo_rl.experience.finalizer_pool import judge_from_source
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import (
    TERMINAL_OUTPUT_TEXT_KEY,
    FetchProblem,
    RolloutEvidence,
    RunFailure,
    judge_rollout,
)

R = PlaceholderReason
RID = "run-s1-g2-i3-a0"
CFG = TokenCaptureConfig()
ROOT_TURN = ((11, 12, 13, 14), (21, 22, 23), (-0.5, -0.25, -0.125))
CHILD_TURN = ((31, 32), (41, 42), (-1.0, -0.75))
WRONG_COORDS = "worker_response_missing_commit_coordinates"
NO_COORDS = "request_finished_without_staged_coordinates"
PLAIN = CallLineage(1, 0, 0)  # the plain two-call chain's capture health: one token-in call, no miss, no branch


class MemorySource:
    """A SnapshotSource over a dict: missing keys raise StagedKeysMissingError; `error` raises first."""

    def __init__(self, snapshots, error: Exception | None = None) -> None:
        self.snapshots = dict(snapshots)
        self.error = error
        self.fetched: list[list[str]] = []

    def fetch(self, staging_keys):
        self.fetched.append(list(staging_keys))
        if self.error is not None:
            raise self.error
        missing = [key for key in staging_keys if key not in self.snapshots]
        if missing:
            raise StagedKeysMissingError("staging", missing)
        return [self.snapshots[key] for key in staging_keys]


def _turn(trees, spec):
    return trees.Turn(*spec)


def _plain(trees, *, versions=(3, 3), rollout_id=RID):
    return trees.build(rollout_id, [trees.Call("call0", None, _turn(trees, ROOT_TURN), versions[0]),
                                    trees.Call("call1", "call0", _turn(trees, CHILD_TURN), versions[1])])


def _retry(trees, *, identical=False):
    """c0 -> {a (dead sibling), b (the retry that was scored)}; b -> c (its continuation) unless identical."""
    b_turn = CHILD_TURN if identical else ((31, 32), (51, 52, 53), (-0.1, -0.2, -0.3))
    calls = [trees.Call("c0", None, _turn(trees, ROOT_TURN)), trees.Call("a", "c0", _turn(trees, CHILD_TURN)),
             trees.Call("b", "c0", _turn(trees, b_turn))]
    if not identical:
        calls.append(trees.Call("c", "b", trees.Turn((61,), (71,), (-0.4,))))
    return trees.build(RID, calls)


def _compaction(trees):
    """r1 -> c1 (the pre-compaction chain), then a second root r2 -> c2 (the scored chain)."""
    return trees.build(RID, [
        trees.Call("r1", None, trees.Turn((1, 2), (3, 4), (-0.1, -0.2))),
        trees.Call("c1", "r1", trees.Turn((5,), (6,), (-0.3,))),
        trees.Call("r2", None, trees.Turn((1, 9), (7,), (-0.4,))),
        trees.Call("c2", "r2", trees.Turn((8,), (10, 11), (-0.5, -0.6))),
    ])


def _ev(tree, run_result=None, *, served=(), failures=(), manifest=..., problem=None, run_failure=None,
        rollout_id=RID):
    """Evidence for `tree`; served=() means the tree's full served report, None means no report."""
    if manifest is ...:
        manifest = tree.manifest(failures)
    report = tuple(tree.served()) if served == () else (None if served is None else tuple(served))
    return RolloutEvidence(rollout_id, 2, 3, None if run_failure else run_result, run_failure, manifest, problem,
                           report)


def _judge(ev, tree, *, cfg=CFG, snapshots=None, problems=None):
    return judge_rollout(ev, tree.snapshots_by_key if snapshots is None else snapshots, problems or {}, cfg)


def _scored(trees, tree, call_id, reward=1.0):
    return trees.run_result(reward, tree.by_id[call_id].response_id)


def _loss(row):
    return [(t, lp) for t, m, lp in zip(row.token_ids, row.token_mask, row.generation_logprobs) if m == 1.0]


def _served(call_id, parent, tokens, *, staged=False, failure="worker_capture_failed"):
    return ServedCall(RID, call_id, parent, "text" if parent is None else "token_in", tokens, staged,
                      None if staged else failure)


# --- keep cases ---------------------------------------------------------------------------------


def test_plain_chain_is_one_exact_row(trees):
    tree = _plain(trees)
    result = _judge(_ev(tree, _scored(trees, tree, "call1")), tree)

    assert isinstance(result, KeptRollout)
    (row,) = result.rows
    assert row.token_ids == (11, 12, 13, 14, 21, 22, 23, 31, 32, 41, 42) == tree.sequences["call1"]
    assert row.token_mask == (0.0,) * 4 + (1.0,) * 3 + (0.0,) * 2 + (1.0,) * 2
    assert row.generation_logprobs == (0.0,) * 4 + (-0.5, -0.25, -0.125) + (0.0,) * 2 + (-1.0, -0.75)
    assert row.call_spans == ((0, 7), (7, 11))
    assert row.model_call_ids == ("call0", "call1")
    assert (row.chain_index, row.prompt_len, row.reward, row.origin) == (0, 4, 1.0, RowOrigin.CAPTURE)
    assert (row.weight_versions, row.token_in_calls, row.text_root_calls) == ((3, 3), 1, 1)
    assert (row.rollout_id, row.group_index, row.sample_index, row.terminal_selection) == (RID, 2, 3, "response_id")
    assert (result.reward, result.terminal_selection) == (1.0, "response_id")
    assert result.yield_ == RolloutYield(5, 5, (), 1, False, lineage=PLAIN)


def test_plain_chain_without_a_served_report_has_no_denominator(trees):
    tree = _plain(trees)
    result = _judge(_ev(tree, trees.run_result(0.5), served=None), tree)

    assert isinstance(result, KeptRollout)
    assert (result.terminal_selection, result.reward, result.rows[0].reward) == ("heuristic", 0.5, 0.5)
    assert result.yield_ == RolloutYield(None, 5, (), 1, False)


def test_three_call_chain_counts_two_token_in_calls(trees):
    tree = trees.build(RID, [trees.Call("k0", None, trees.Turn((1, 2), (3,), (-0.1,))),
                             trees.Call("k1", "k0", trees.Turn((4,), (5,), (-0.2,))),
                             trees.Call("k2", "k1", trees.Turn((6,), (7, 8), (-0.3, -0.4)))])
    (row,) = _judge(_ev(tree, _scored(trees, tree, "k2")), tree).rows

    assert (row.token_in_calls, row.text_root_calls, len(row.model_call_ids)) == (2, 1, 3)
    assert row.token_ids == (1, 2, 3, 4, 5, 6, 7, 8)
    assert row.call_spans == ((0, 3), (3, 5), (5, 8))


def test_distinct_retry_trains_the_scored_chain_and_masks_the_abandoned_sibling(trees):
    tree = _retry(trees)
    result = _judge(_ev(tree, _scored(trees, tree, "c")), tree)

    assert isinstance(result, KeptRollout)
    (terminal,) = result.rows
    assert terminal.model_call_ids == ("c0", "b", "c") and terminal.chain_index == 0
    assert terminal.token_ids == (11, 12, 13, 14, 21, 22, 23, 31, 32, 51, 52, 53, 61, 71) == tree.sequences["c"]
    assert terminal.token_mask == (0.0,) * 4 + (1.0,) * 3 + (0.0,) * 2 + (1.0,) * 3 + (0.0, 1.0)
    assert _loss(terminal) == [(21, -0.5), (22, -0.25), (23, -0.125), (51, -0.1), (52, -0.2), (53, -0.3), (71, -0.4)]
    assert terminal.call_spans == ((0, 7), (7, 12), (12, 14))
    assert terminal.loss_call_ids() == {"c0", "b", "c"}
    # a is the reply the harness discarded (b, its sibling, was continued): no row, its 2 tokens
    # counted as an abandoned retry, outside the denominator; nothing is unverifiable.
    assert result.yield_ == RolloutYield(3 + 2 + 3 + 1, 7, (), 2, False, 1, 2, CallLineage(3, 0, 0))


def test_distinct_retry_without_witness_follows_the_continued_sibling(trees):
    tree = _retry(trees)
    result = _judge(_ev(tree, trees.run_result(1.0)), tree)

    assert [row.model_call_ids for row in result.rows] == [("c0", "b", "c")]
    assert result.terminal_selection == "heuristic"
    assert (result.yield_.abandoned_retry_calls, result.yield_.abandoned_retry_tokens) == (1, 2)


def test_identical_retry_trains_the_scored_sample_once(trees):
    tree = _retry(trees, identical=True)
    assert tree.by_id["a"].cumulative_hash == tree.by_id["b"].cumulative_hash
    result = _judge(_ev(tree, _scored(trees, tree, "b")), tree)

    assert isinstance(result, KeptRollout)
    (row,) = result.rows
    assert row.model_call_ids == ("c0", "b")
    assert row.token_ids == (11, 12, 13, 14, 21, 22, 23, 31, 32, 41, 42)
    assert row.token_mask == (0.0,) * 4 + (1.0,) * 3 + (0.0,) * 2 + (1.0,) * 2
    assert result.yield_ == RolloutYield(3 + 2 + 2, 5, (), 2, False, 1, 2, CallLineage(2, 0, 0))


def test_identical_retry_without_witness_is_ambiguous(trees):
    tree = _retry(trees, identical=True)
    result = _judge(_ev(tree, trees.run_result(1.0)), tree)

    assert result == Placeholder(RID, 2, 3, R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:ambiguous_terminal",
                                 1.0, "heuristic", RolloutYield(7, 0, (("terminal_selection_failed", 7),), 2, False,
                                                                lineage=CallLineage(2, 0, 0)))


def test_compaction_second_root_is_the_terminal_chain_and_the_old_chain_is_row_two(trees):
    tree = _compaction(trees)
    result = _judge(_ev(tree, _scored(trees, tree, "c2")), tree)

    assert isinstance(result, KeptRollout)
    new, old = result.rows
    assert (new.model_call_ids, new.token_ids) == (("r2", "c2"), (1, 9, 7, 8, 10, 11))
    assert new.token_mask == (0.0, 0.0, 1.0, 0.0, 1.0, 1.0)
    assert new.generation_logprobs == (0.0, 0.0, -0.4, 0.0, -0.5, -0.6)
    assert (old.model_call_ids, old.token_ids) == (("r1", "c1"), (1, 2, 3, 4, 5, 6))
    assert old.token_mask == (0.0, 0.0, 1.0, 1.0, 0.0, 1.0)
    assert old.generation_logprobs == (0.0, 0.0, -0.1, -0.2, 0.0, -0.3)
    assert (new.prompt_len, old.prompt_len, new.chain_index, old.chain_index) == (2, 2, 0, 1)
    # The summary root is a branch, not a miss: its history has no assistant turn.
    assert result.yield_ == RolloutYield(6, 6, (), 2, False, lineage=CallLineage(2, 0, 1))


def test_terminal_chain_policy_keeps_one_row_and_counts_the_rest(trees):
    tree = _compaction(trees)
    cfg = TokenCaptureConfig(branch_policy="terminal_chain")
    result = _judge(_ev(tree, _scored(trees, tree, "c2")), tree, cfg=cfg)

    (row,) = result.rows
    assert row.model_call_ids == ("r2", "c2")
    assert result.yield_ == RolloutYield(6, 3, (("excluded_by_branch_policy", 3),), 2, False,
                                         lineage=CallLineage(2, 0, 1))


def test_an_abandoned_retry_is_not_excluded_by_the_terminal_chain_policy(trees):
    tree = _retry(trees)
    cfg = TokenCaptureConfig(branch_policy="terminal_chain")
    result = _judge(_ev(tree, _scored(trees, tree, "c")), tree, cfg=cfg)

    assert [row.model_call_ids for row in result.rows] == [("c0", "b", "c")]
    assert result.yield_ == RolloutYield(9, 7, (), 2, False, 1, 2, CallLineage(3, 0, 0))


def test_off_chain_failure_does_not_poison(trees):
    tree = _plain(trees)
    failures = [ManifestFailure(model_call_id="lost", reason=NO_COORDS)]
    result = _judge(_ev(tree, _scored(trees, tree, "call1"), failures=failures), tree)

    assert isinstance(result, KeptRollout)
    assert result.rows[0].token_ids == tree.sequences["call1"]
    assert result.yield_ == RolloutYield(5, 5, (), 1, False, lineage=PLAIN)


def test_served_not_staged_on_a_non_terminal_leaf_drops_only_that_chain(trees):
    tree = _retry(trees)
    failures = [ManifestFailure(model_call_id="z", reason="worker_capture_failed"),
                ManifestFailure(model_call_id="z", reason=NO_COORDS)]
    served = [*tree.served(), _served("z", "a", 4)]
    result = _judge(_ev(tree, _scored(trees, tree, "c"), failures=failures, served=served), tree)

    assert isinstance(result, KeptRollout)
    (row,) = result.rows
    assert row.model_call_ids == ("c0", "b", "c")
    # a (2 tokens, its chain cut) and z (4 tokens, never staged) are served but untrained; a is not an
    # abandoned retry: z continued it.
    assert result.yield_ == RolloutYield(13, 7, (("served_not_staged", 6),), 2, False, lineage=CallLineage(4, 0, 0))


def test_unstaged_root_cuts_nothing_and_counts_as_served_not_staged(trees):
    tree = _plain(trees)
    failures = [ManifestFailure(model_call_id="z", reason="unresolved_parent")]
    served = [*tree.served(), _served("z", None, 6, failure="unresolved_parent")]
    result = _judge(_ev(tree, _scored(trees, tree, "call1"), failures=failures, served=served), tree)

    assert isinstance(result, KeptRollout)
    assert result.yield_ == RolloutYield(11, 5, (("served_not_staged", 6),), 1, False, lineage=PLAIN)


def test_yield_names_staged_but_uncommitted_and_unstaged_served_calls(trees):
    tree = _plain(trees)
    served = [*tree.served(), _served("orphan", "call1", 3, staged=True),
              _served("quiet", "call0", 2, failure="stage_timeout")]
    result = _judge(_ev(tree, _scored(trees, tree, "call1"), served=served), tree)

    assert isinstance(result, KeptRollout)
    assert result.yield_ == RolloutYield(10, 5, (("served_not_staged", 2), ("staged_not_committed", 3)), 1, False,
                                         lineage=CallLineage(3, 0, 0))


def test_mixed_weight_versions_are_allowed_by_default(trees):
    tree = _plain(trees, versions=(3, 4))
    result = _judge(_ev(tree, _scored(trees, tree, "call1")), tree)

    (row,) = result.rows
    assert row.weight_versions == (3, 4)
    assert row.token_weight_versions == (3,) * 7 + (4,) * 4


def test_a_corrupt_non_terminal_chain_is_dropped_alone(trees):
    tree = _compaction(trees)
    snapshots = tree.snapshots_by_key
    key = tree.by_id["c1"].staging_key
    snapshots[key] = snapshots[key].model_copy(update={"token_ids_delta": [5, 99]})
    result = _judge(_ev(tree, _scored(trees, tree, "c2")), tree, snapshots=snapshots)

    assert [row.model_call_ids for row in result.rows] == [("r2", "c2")]
    assert result.yield_ == RolloutYield(6, 3, (("verification_failed", 3),), 2, False, lineage=CallLineage(2, 0, 1))


def test_a_missing_non_terminal_record_drops_that_chain_through_the_real_fetch(trees):
    tree = _compaction(trees)
    snapshots = tree.snapshots_by_key
    del snapshots[tree.by_id["c1"].staging_key]
    source = MemorySource(snapshots)
    result = judge_from_source(source, _ev(tree, _scored(trees, tree, "c2")), CFG)

    assert [row.model_call_ids for row in result.rows] == [("r2", "c2")]
    assert result.yield_ == RolloutYield(6, 3, (("staged_record_missing", 3),), 2, False, lineage=CallLineage(2, 0, 1))
    assert source.fetched == [[f"{RID}/r1", f"{RID}/c1", f"{RID}/r2", f"{RID}/c2"], [f"{RID}/r1", f"{RID}/r2", f"{RID}/c2"]]


# --- every placeholder reason the judge produces ------------------------------------------------


@pytest.mark.parametrize("reason", [R.RUN_FAILED, R.RUN_TIMEOUT])
def test_run_failures(trees, reason):
    tree = _plain(trees)
    result = _judge(_ev(tree, run_failure=RunFailure(reason, "RuntimeError: agent exploded")), tree)

    assert result == Placeholder(RID, 2, 3, reason, "RuntimeError: agent exploded", None, None,
                                 RolloutYield(5, 0, ((reason.value, 5),), 0, False, lineage=PLAIN))


def test_manifest_unavailable(trees):
    tree = _plain(trees)
    ev = _ev(tree, trees.run_result(1.0), manifest=None, problem="ManifestError: HTTP 500")
    assert _judge(ev, tree) == Placeholder(RID, 2, 3, R.MANIFEST_UNAVAILABLE, "ManifestError: HTTP 500", 1.0,
                                           None, RolloutYield(5, 0, (("manifest_unavailable", 5),), 0, False))


def test_manifest_of_another_rollout_is_poisoned_and_not_fetched(trees):
    other = _plain(trees, rollout_id="someone-else")
    ev = _ev(other, trees.run_result(1.0), served=None)
    source = MemorySource(other.snapshots_by_key)

    assert ev.staging_keys() == []
    assert judge_from_source(source, ev, CFG) == Placeholder(
        RID, 2, 3, R.CAPTURE_POISONED, "manifest_rollout_mismatch:someone-else", 1.0, None,
        RolloutYield(None, 0, (), 0, False))
    assert source.fetched == []


def test_duplicate_call_ids_are_poisoned(trees):
    tree = _plain(trees)
    manifest = tree.manifest(records=[tree.records[0], tree.records[0]])
    result = _judge(_ev(tree, _scored(trees, tree, "call0"), manifest=manifest), tree)

    assert (result.reason, result.detail, result.reward) == (R.CAPTURE_POISONED, "duplicate_model_call_id", 1.0)


@pytest.mark.parametrize("with_report", [False, True])
def test_served_not_staged_call_the_report_cannot_locate_poisons(trees, with_report):
    tree = _plain(trees)
    failures = [ManifestFailure(model_call_id="z", reason="worker_capture_failed"),
                ManifestFailure(model_call_id="z", reason=NO_COORDS)]
    ev = _ev(tree, _scored(trees, tree, "call1"), failures=failures, served=() if with_report else None)
    result = _judge(ev, tree)

    expected_yield = RolloutYield(5, 0, (("capture_poisoned", 5),), 1, lineage=PLAIN) if with_report \
        else RolloutYield(None, 0, (), 1)
    assert result == Placeholder(
        RID, 2, 3, R.CAPTURE_POISONED, "served_not_staged_unlocated: calls ['z'] (['worker_capture_failed'])",
        1.0, None, expected_yield)


def test_a_failure_row_on_a_committed_call_poisons(trees):
    tree = _plain(trees)
    failures = [ManifestFailure(model_call_id="call1", reason="invalid_worker_commit_coordinates")]
    result = _judge(_ev(tree, _scored(trees, tree, "call1"), failures=failures), tree)

    assert (result.reason, result.detail) == (
        R.CAPTURE_POISONED, "served_not_staged_unlocated: calls ['call1'] (['invalid_worker_commit_coordinates'])")


def test_reward_missing(trees):
    tree = _plain(trees)
    result = _judge(_ev(tree, _scored(trees, tree, "call1", reward=None)), tree)
    assert result == Placeholder(RID, 2, 3, R.REWARD_MISSING, "run result has no finite reward", None, None,
                                 RolloutYield(5, 0, (("reward_missing", 5),), 0, False, lineage=PLAIN))


def test_empty_manifest(trees):
    tree = _plain(trees)
    bare = RolloutManifest(rollout_id=RID)
    with_failure = RolloutManifest(rollout_id=RID, failures=[ManifestFailure(model_call_id="c0", reason=WRONG_COORDS)])

    bare_result = _judge(_ev(tree, trees.run_result(0.5), manifest=bare, served=[]), tree)
    failed_result = _judge(_ev(tree, trees.run_result(0.5), manifest=with_failure, served=None), tree)

    assert bare_result == Placeholder(RID, 2, 3, R.EMPTY_MANIFEST, "no committed call and no failure row", 0.5, None,
                                      RolloutYield(0, 0, (), 0, False, lineage=CallLineage(0, 0, 0)))
    assert failed_result == Placeholder(
        RID, 2, 3, R.EMPTY_MANIFEST, f"no committed call; failures: ['{WRONG_COORDS}']", 0.5, None,
        RolloutYield(None, 0, (), 0, False))


def test_terminal_declared_unmatched(trees):
    tree = _plain(trees)
    run_result = {**_scored(trees, tree, "call1"), "terminal_response_id": "chatcmpl-nope"}
    result = _judge(_ev(tree, run_result), tree)

    assert result == Placeholder(
        RID, 2, 3, R.TERMINAL_DECLARED_UNMATCHED, "terminal_response_id='chatcmpl-nope': declared_terminal_not_captured",
        1.0, "declared", RolloutYield(5, 0, (("terminal_declared_unmatched", 5),), 1, False, lineage=PLAIN))


def test_terminal_declared_matched_wins(trees):
    tree = _retry(trees)
    run_result = {**trees.run_result(1.0), "terminal_response_id": tree.by_id["c"].response_id}
    result = _judge(_ev(tree, run_result), tree)

    assert (result.terminal_selection, result.rows[0].model_call_ids) == ("declared", ("c0", "b", "c"))


def test_terminal_witness_disagreement(trees):
    tree = _plain(trees)
    run_result = {**_scored(trees, tree, "call0"), "_ng_terminal_model_call_id": "call1"}
    result = _judge(_ev(tree, run_result), tree)

    assert result == Placeholder(
        RID, 2, 3, R.TERMINAL_WITNESS_DISAGREEMENT,
        "response_has_no_output,witness_disagreement[explicit=call1;response_id=call0]", 1.0, None,
        RolloutYield(5, 0, (("terminal_witness_disagreement", 5),), 1, True, lineage=PLAIN))


def _with_outputs(tree, texts):
    return [r.model_copy(update={"output_fingerprint": assistant_fingerprint([{"role": "assistant", "content": t}]),
                                 "fingerprint_version": FINGERPRINT_VERSION}) for r, t in zip(tree.records, texts)]


def test_an_output_witness_trains_the_chain_it_names_and_an_unmatched_one_masks(trees):
    # A client with no response id (the Agents SDK over chat completions) declares the scored text.
    tree = _plain(trees)
    manifest = tree.manifest(records=_with_outputs(tree, ("calling the tool", "It is 5.")))
    kept = _judge(_ev(tree, {**trees.run_result(1.0), TERMINAL_OUTPUT_TEXT_KEY: "It is 5."}, manifest=manifest), tree)
    masked = _judge(_ev(tree, {**trees.run_result(1.0), TERMINAL_OUTPUT_TEXT_KEY: "It is 6."}, manifest=manifest), tree)

    assert isinstance(kept, KeptRollout) and kept.terminal_selection == "content"
    assert kept.rows[0].model_call_ids == ("call0", "call1")
    # Never the walk (which would have picked call1): a typed verdict, every served token lost to it.
    assert isinstance(masked, Placeholder)
    assert (masked.reason, masked.terminal_selection) == (R.TERMINAL_WITNESS_UNMATCHED, "content")
    assert masked.yield_.unverifiable == (("terminal_witness_unmatched", 5),)


def test_terminal_selection_failed_over_ambiguous_roots(trees):
    tree = _compaction(trees)
    result = _judge(_ev(tree, trees.run_result(1.0)), tree)

    assert result == Placeholder(RID, 2, 3, R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:ambiguous_roots",
                                 1.0, "heuristic", RolloutYield(6, 0, (("terminal_selection_failed", 6),), 2, False,
                                                                lineage=CallLineage(2, 0, 1)))


def test_staged_record_missing_through_the_real_fetch(trees):
    tree = _plain(trees)
    snapshots = tree.snapshots_by_key
    key = f"{RID}/call1"
    del snapshots[key]
    result = judge_from_source(MemorySource(snapshots), _ev(tree, _scored(trees, tree, "call1")), CFG)

    assert result == Placeholder(
        RID, 2, 3, R.STAGED_RECORD_MISSING, f"{key}: {StagedKeysMissingError('staging', [key])}", 1.0, "response_id",
        RolloutYield(5, 0, (("staged_record_missing", 5),), 1, False, lineage=PLAIN))


def test_corrupt_digest_is_a_verification_failure(trees):
    tree = _plain(trees)
    snapshots = tree.snapshots_by_key
    key = f"{RID}/call1"
    snapshots[key] = snapshots[key].model_copy(update={"token_ids_delta": [31, 32, 41, 99]})
    result = judge_from_source(MemorySource(snapshots), _ev(tree, _scored(trees, tree, "call1")), CFG)

    assert result == Placeholder(RID, 2, 3, R.VERIFICATION_FAILED, "corrupt_digest", 1.0, "response_id",
                                 RolloutYield(5, 0, (("verification_failed", 5),), 1, False, lineage=PLAIN))


def test_tampered_snapshot_of_another_chain_is_a_verification_failure(trees):
    tree = _plain(trees)
    other = trees.build(RID, [trees.Call("call0", None, _turn(trees, ROOT_TURN)),
                              trees.Call("call1", "call0", trees.Turn((31, 32), (41, 43), (-1.0, -0.75)))])
    snapshots = {**tree.snapshots_by_key, f"{RID}/call1": other.snapshot("call1")}
    result = _judge(_ev(tree, _scored(trees, tree, "call1")), tree, snapshots=snapshots)

    assert (result.reason, result.detail) == (R.VERIFICATION_FAILED, "wrong_digest")


def test_invalid_stored_record_is_a_verification_failure(trees):
    tree = _plain(trees)
    error = StagedRecordInvalidError(f"{RID}/call0", "header is not JSON")
    result = judge_from_source(MemorySource(tree.snapshots_by_key, error), _ev(tree, _scored(trees, tree, "call1")), CFG)

    assert (result.reason, result.detail) == (
        R.VERIFICATION_FAILED,
        f"{RID}/call0: invalid_staged_record: staged record under key '{RID}/call0' is invalid: header is not JSON")


def test_unavailable_store_is_a_data_plane_error(trees):
    tree = _plain(trees)
    source = MemorySource(tree.snapshots_by_key, StagingStoreUnavailableError("get timed out after 10s"))
    result = judge_from_source(source, _ev(tree, _scored(trees, tree, "call1")), CFG)

    assert result == Placeholder(
        RID, 2, 3, R.DATA_PLANE_ERROR, f"{RID}/call0: StagingStoreUnavailableError: get timed out after 10s", 1.0,
        "response_id", RolloutYield(5, 0, (("data_plane_error", 5),), 1, False, lineage=PLAIN))


def test_served_not_staged_on_the_terminal_chain_cuts_it(trees):
    tree = _plain(trees)
    failures = [ManifestFailure(model_call_id="z", reason="worker_capture_failed")]
    served = [*tree.served(), _served("z", "call1", 4)]
    result = _judge(_ev(tree, _scored(trees, tree, "call1"), failures=failures, served=served), tree)

    assert result == Placeholder(
        RID, 2, 3, R.SERVED_NOT_STAGED, "cut_by_unstaged_child: a child of call1 was served without custody", 1.0,
        "response_id", RolloutYield(9, 0, (("served_not_staged", 9),), 1, False, lineage=CallLineage(2, 0, 0)))


def test_heuristic_is_refused_when_a_served_call_has_no_record(trees):
    # The scored response (chatcmpl-z) was served without custody: the parent-link walk cannot see
    # it and must not credit its reward to the staged chain.
    tree = _plain(trees)
    failures = [ManifestFailure(model_call_id="z", reason="worker_capture_failed")]
    served = [*tree.served(), _served("z", "call1", 4)]
    result = _judge(_ev(tree, trees.run_result(1.0, "chatcmpl-z"), failures=failures, served=served), tree)

    assert result == Placeholder(
        RID, 2, 3, R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:heuristic_with_unstaged_calls ['z']", 1.0,
        "heuristic", RolloutYield(9, 0, (("terminal_selection_failed", 9),), 1, False, lineage=CallLineage(2, 0, 0)))


def test_mixed_weight_version_is_rejected_by_policy(trees):
    tree = _plain(trees, versions=(3, 4))
    cfg = TokenCaptureConfig(mixed_weight_version_policy="reject")
    result = _judge(_ev(tree, _scored(trees, tree, "call1")), tree, cfg=cfg)

    assert result == Placeholder(RID, 2, 3, R.MIXED_WEIGHT_VERSION, "chain served by weight versions [3, 4]", 1.0,
                                 "response_id", RolloutYield(5, 0, (("mixed_weight_version", 5),), 1, False,
                                                             lineage=PLAIN))


def test_a_mixed_non_terminal_chain_is_dropped_alone_under_reject(trees):
    # c0 forks: a (continued by a1, so not an abandoned retry) and b -> c (scored).
    tree = trees.build(RID, [trees.Call("c0", None, _turn(trees, ROOT_TURN), 3),
                             trees.Call("a", "c0", _turn(trees, CHILD_TURN), 4),
                             trees.Call("a1", "a", trees.Turn((9,), (10,), (-0.5,)), 4),
                             trees.Call("b", "c0", trees.Turn((31,), (5, 6), (-0.1, -0.2)), 3),
                             trees.Call("c", "b", trees.Turn((7,), (8,), (-0.3,)), 3)])
    cfg = TokenCaptureConfig(mixed_weight_version_policy="reject")
    result = _judge(_ev(tree, _scored(trees, tree, "c")), tree, cfg=cfg)

    assert [row.model_call_ids for row in result.rows] == [("c0", "b", "c")]
    assert result.yield_ == RolloutYield(9, 6, (("mixed_weight_version", 3),), 2, False, lineage=CallLineage(4, 0, 0))


def test_the_judge_is_deterministic(trees):
    tree = _retry(trees)
    ev = _ev(tree, _scored(trees, tree, "c"))
    assert _judge(ev, tree) == _judge(ev, tree)


# --- fetch_snapshots (fake sources: the unit test of a pure function) ---------------------------


def test_fetch_snapshots_reads_every_key_in_one_call(trees):
    tree = _plain(trees)
    source = MemorySource(tree.snapshots_by_key)
    keys = [f"{RID}/call0", f"{RID}/call1", f"{RID}/call0"]
    snapshots, problems = fetch_snapshots(source, keys)

    assert (snapshots, problems) == (tree.snapshots_by_key, {})
    assert source.fetched == [[f"{RID}/call0", f"{RID}/call1"]]


def test_fetch_snapshots_marks_missing_keys_and_refetches_the_rest(trees):
    tree = _plain(trees)
    present = {f"{RID}/call1": tree.snapshot("call1")}
    source = MemorySource(present)
    snapshots, problems = fetch_snapshots(source, [f"{RID}/call0", f"{RID}/call1", f"{RID}/x"])

    missing = StagedKeysMissingError("staging", [f"{RID}/call0", f"{RID}/x"])
    assert snapshots == present
    assert problems == {f"{RID}/call0": FetchProblem(R.STAGED_RECORD_MISSING, str(missing)),
                        f"{RID}/x": FetchProblem(R.STAGED_RECORD_MISSING, str(missing))}
    assert source.fetched == [[f"{RID}/call0", f"{RID}/call1", f"{RID}/x"], [f"{RID}/call1"]]


def test_fetch_snapshots_marks_an_invalid_record_and_refetches_the_rest(trees):
    tree = _plain(trees)

    class InvalidOnce(MemorySource):
        def fetch(self, staging_keys):
            if f"{RID}/call0" in staging_keys:
                self.fetched.append(list(staging_keys))
                raise StagedRecordInvalidError(f"{RID}/call0", "header is not JSON")
            return super().fetch(staging_keys)

    source = InvalidOnce(tree.snapshots_by_key)
    snapshots, problems = fetch_snapshots(source, [f"{RID}/call0", f"{RID}/call1"])

    assert snapshots == {f"{RID}/call1": tree.snapshot("call1")}
    assert problems == {f"{RID}/call0": FetchProblem(
        R.VERIFICATION_FAILED,
        f"invalid_staged_record: staged record under key '{RID}/call0' is invalid: header is not JSON")}
    assert source.fetched == [[f"{RID}/call0", f"{RID}/call1"], [f"{RID}/call1"]]


def test_fetch_snapshots_after_a_missing_key_then_an_unavailable_store(trees):
    tree = _plain(trees)

    class FlakySource(MemorySource):
        def fetch(self, staging_keys):
            if len(self.fetched) == 1:
                self.fetched.append(list(staging_keys))
                raise StagingStoreUnavailableError("controller gone")
            return super().fetch(staging_keys)

    source = FlakySource({f"{RID}/call1": tree.snapshot("call1")})
    snapshots, problems = fetch_snapshots(source, [f"{RID}/call0", f"{RID}/call1"])

    assert snapshots == {}
    assert problems == {
        f"{RID}/call0": FetchProblem(R.STAGED_RECORD_MISSING, str(StagedKeysMissingError("staging", [f"{RID}/call0"]))),
        f"{RID}/call1": FetchProblem(R.DATA_PLANE_ERROR, "StagingStoreUnavailableError: controller gone"),
    }


def test_fetch_snapshots_short_or_foreign_answers_are_missing(trees):
    tree = _plain(trees)

    class ShortSource(MemorySource):
        def fetch(self, staging_keys):
            return super().fetch(staging_keys)[:-1]

    class SwappedSource(MemorySource):
        def fetch(self, staging_keys):
            return super().fetch(staging_keys)[::-1]

    short_snapshots, short_problems = fetch_snapshots(ShortSource(tree.snapshots_by_key),
                                                      [f"{RID}/call0", f"{RID}/call1"])
    swapped_snapshots, swapped_problems = fetch_snapshots(SwappedSource(tree.snapshots_by_key),
                                                          [f"{RID}/call0", f"{RID}/call1"])

    assert short_snapshots == {f"{RID}/call0": tree.snapshot("call0")}
    assert short_problems == {f"{RID}/call1": FetchProblem(
        R.STAGED_RECORD_MISSING, f"the source answered 1 snapshots for 2 keys and none for {RID}/call1")}
    assert swapped_snapshots == {}
    assert set(swapped_problems) == {f"{RID}/call0", f"{RID}/call1"}
    assert {p.reason for p in swapped_problems.values()} == {R.STAGED_RECORD_MISSING}


def test_fetch_snapshots_of_no_key_never_calls_the_source():
    source = MemorySource({})
    assert fetch_snapshots(source, []) == ({}, {})
    assert source.fetched == []


def test_a_source_raising_outside_the_protocol_is_a_bug_not_a_verdict(trees):
    tree = _plain(trees)
    with pytest.raises(TimeoutError, match="kv_batch_get"):
        fetch_snapshots(MemorySource(tree.snapshots_by_key, TimeoutError("kv_batch_get: no answer")),
                        [f"{RID}/call0"])


def test_scored_unstaged_retry_is_not_credited_to_its_staged_sibling(trees):
    """c0 -> {c1 (staged), z (served, capture failed)}; /run scored z (its response id matches no row).

    The heuristic walk cannot see z, so it 'uniquely' picks c1 and the rollout trains c1's tokens with
    the reward z earned. With z's sibling staged, the walk would have refused (ambiguous_terminal);
    an unstaged sibling must not make the choice look unique. Expected: fail closed (a placeholder).
    """
    tree = trees.build(RID, [trees.Call("c0", None, _turn(trees, ROOT_TURN)),
                             trees.Call("c1", "c0", _turn(trees, CHILD_TURN))])
    failures = [ManifestFailure(model_call_id="z", reason="worker_capture_failed")]
    served = [*tree.served(), _served("z", "c0", 4)]
    result = _judge(_ev(tree, trees.run_result(1.0, "chatcmpl-z"), failures=failures, served=served), tree)

    assert isinstance(result, Placeholder), (
        f"kept {[row.model_call_ids for row in result.rows]} by {result.terminal_selection} although the scored "
        "response chatcmpl-z is a served-not-staged sibling of c1")
    assert result.reason in (R.SERVED_NOT_STAGED, R.TERMINAL_SELECTION_FAILED)


def test_unstaged_abandoned_retry_beside_a_witnessed_terminal_keeps_the_rollout(trees):
    tree = trees.build(RID, [trees.Call("c0", None, _turn(trees, ROOT_TURN)),
                             trees.Call("c1", "c0", _turn(trees, CHILD_TURN))])
    failures = [ManifestFailure(model_call_id="z", reason="worker_capture_failed")]
    served = [*tree.served(), _served("z", "c0", 4)]
    result = _judge(_ev(tree, _scored(trees, tree, "c1"), failures=failures, served=served), tree)

    assert [row.model_call_ids for row in result.rows] == [("c0", "c1")]
    assert result.yield_ == RolloutYield(9, 5, (("served_not_staged", 4),), 1, False, lineage=CallLineage(2, 0, 0))


# --- credit only where it was earned: abandoned retries (issue 16 item 3) ------------------------


def test_a_retried_first_call_is_an_abandoned_root(trees):
    """r1 and r2 are the same first request sent twice (same prompt ids); the harness continued r2."""
    tree = trees.build(RID, [trees.Call("r1", None, trees.Turn((1, 2), (3, 4), (-0.1, -0.2))),
                             trees.Call("r2", None, trees.Turn((1, 2), (5,), (-0.3,))),
                             trees.Call("c", "r2", trees.Turn((6,), (7, 8), (-0.4, -0.5)))])
    result = _judge(_ev(tree, _scored(trees, tree, "c")), tree)

    assert [row.model_call_ids for row in result.rows] == [("r2", "c")]
    assert result.rows[0].token_mask == (0.0, 0.0, 1.0, 0.0, 1.0, 1.0)
    assert result.yield_ == RolloutYield(5, 3, (), 2, False, 1, 2, CallLineage(1, 0, 1))


def test_a_subagent_root_with_its_own_prompt_trains_in_its_own_row(trees):
    """m0 -> m1 is the main conversation (scored); s0 -> s1 a sub-agent's: a different prompt, no sibling."""
    tree = trees.build(RID, [trees.Call("m0", None, trees.Turn((1, 2), (3,), (-0.1,))),
                             trees.Call("s0", None, trees.Turn((9, 2), (4,), (-0.2,))),
                             trees.Call("s1", "s0", trees.Turn((5,), (6,), (-0.3,))),
                             trees.Call("m1", "m0", trees.Turn((7,), (8,), (-0.4,)))])
    result = _judge(_ev(tree, _scored(trees, tree, "m1")), tree)

    assert [row.model_call_ids for row in result.rows] == [("m0", "m1"), ("s0", "s1")]
    assert result.rows[1].token_mask == (0.0, 0.0, 1.0, 0.0, 1.0)
    assert result.yield_ == RolloutYield(4, 4, (), 2, False, lineage=CallLineage(2, 0, 1))


def test_when_every_reply_to_a_turn_was_abandoned_the_turn_itself_still_trains(trees):
    """c0 -> {a, b}, neither continued; then the harness compacted into r -> t (scored).

    a and b are masked as abandoned retries; c0's own reply led to the compaction, and no other
    row owns it, so its chain (stopping at c0) trains.
    """
    tree = trees.build(RID, [trees.Call("c0", None, trees.Turn((1, 2), (3, 4), (-0.1, -0.2))),
                             trees.Call("a", "c0", trees.Turn((5,), (6,), (-0.3,))),
                             trees.Call("b", "c0", trees.Turn((5,), (7,), (-0.4,))),
                             trees.Call("r", None, trees.Turn((1, 9), (10,), (-0.5,))),
                             trees.Call("t", "r", trees.Turn((11,), (12,), (-0.6,)))])
    result = _judge(_ev(tree, _scored(trees, tree, "t")), tree)

    assert [row.model_call_ids for row in result.rows] == [("r", "t"), ("c0",)]
    assert result.rows[1].token_ids == (1, 2, 3, 4) and result.rows[1].token_mask == (0.0, 0.0, 1.0, 1.0)
    assert result.rows[1].generation_logprobs == (0.0, 0.0, -0.1, -0.2)
    assert result.yield_ == RolloutYield(6, 4, (), 3, False, 2, 2, CallLineage(3, 0, 1))


def test_a_served_not_staged_sibling_makes_a_staged_leaf_an_abandoned_retry(trees):
    """c0 -> {a (staged, never continued), z (served without custody)}; the harness went on from c0's
    compaction r -> t (scored). a has a sibling the workers served: the harness retried it."""
    tree = trees.build(RID, [trees.Call("c0", None, trees.Turn((1, 2), (3,), (-0.1,))),
                             trees.Call("a", "c0", trees.Turn((5,), (6,), (-0.3,))),
                             trees.Call("r", None, trees.Turn((1, 9), (10,), (-0.5,))),
                             trees.Call("t", "r", trees.Turn((11,), (12,), (-0.6,)))])
    failures = [ManifestFailure(model_call_id="z", reason="worker_capture_failed")]
    served = [*tree.served(), _served("z", "c0", 4)]
    result = _judge(_ev(tree, _scored(trees, tree, "t"), failures=failures, served=served), tree)

    # c0's chain is cut by z (its continuation was served without custody) and a is abandoned.
    assert [row.model_call_ids for row in result.rows] == [("r", "t")]
    assert result.yield_ == RolloutYield(8, 2, (("served_not_staged", 5),), 2, False, 1, 1, CallLineage(3, 0, 1))


# --- capture health: what the gate decided for each served call (issue 16 item 1) ---------------


def _rerooted(tree, call_id, **kw):
    """The served report's entry for a text root whose request history held an assistant turn."""
    call = tree.calls[call_id]
    return ServedCall(RID, call_id, None, "text", len(call.turn.generated), True, unresolved_continuation=True, **kw)


def test_a_continuation_the_gate_found_no_parent_for_is_counted_unresolved(trees):
    """The harness edited r1's reply: r2's history holds it, but the gate opened a new root."""
    tree = trees.build(RID, [trees.Call("r1", None, trees.Turn((1, 2), (3, 4), (-0.1, -0.2))),
                             trees.Call("r2", None, trees.Turn((1, 2, 33, 4, 5), (6,), (-0.3,))),
                             trees.Call("c", "r2", trees.Turn((7,), (8,), (-0.4,)))])
    served = [call if call.model_call_id != "r2" else _rerooted(tree, "r2") for call in tree.served()]
    result = _judge(_ev(tree, _scored(trees, tree, "c"), served=served), tree)

    # Exact all the same: r2's row renders the edited history as prompt, r1 trains in its own row.
    assert [row.model_call_ids for row in result.rows] == [("r2", "c"), ("r1",)]
    assert result.yield_ == RolloutYield(4, 4, (), 2, False, lineage=CallLineage(1, 1, 1))
    assert result.yield_.lineage.continuation_calls == 2


def test_a_first_call_with_assistant_turns_in_its_prompt_is_not_a_miss(trees):
    """A few-shot prompt: the rollout's first call has assistant turns but nothing captured to continue."""
    tree = _plain(trees)
    served = [call if call.model_call_id != "call0" else _rerooted(tree, "call0") for call in tree.served()]
    result = _judge(_ev(tree, _scored(trees, tree, "call1"), served=served), tree)

    assert result.yield_.lineage == PLAIN


def test_lineage_counts_each_served_call_once_and_rides_on_placeholders(trees):
    tree = _compaction(trees)
    served = [*tree.served(), tree.served()[1]]  # a report entry repeated (two workers' answers merged)
    failed = _judge(_ev(tree, run_failure=RunFailure(R.RUN_FAILED, "boom"), served=served), tree)

    assert isinstance(failed, Placeholder)
    assert failed.yield_.lineage == CallLineage(2, 0, 1)


# --- a declared terminal that was not captured masks (issue 16 item 5) --------------------------


def test_a_declared_terminal_call_that_was_not_captured_masks_without_falling_back(trees):
    # The response id names call1 (a witness that would attribute it), but the run declared z, a
    # call served without custody: the scored reply is not in the manifest.
    tree = _plain(trees)
    run_result = {**_scored(trees, tree, "call1"), "_ng_terminal_model_call_id": "z"}
    result = _judge(_ev(tree, run_result), tree)

    assert result == Placeholder(
        RID, 2, 3, R.DECLARED_TERMINAL_UNCAPTURED, "_ng_terminal_model_call_id='z' names no committed call", 1.0,
        "declared", RolloutYield(5, 0, (("declared_terminal_uncaptured", 5),), 1, False, lineage=PLAIN))
