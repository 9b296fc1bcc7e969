"""Property tests of judge_rollout over random REAL staged forests.

Each example stages a random forest (roots, children, retried siblings, weight versions) with Gym's
RolloutTokenCapture, adds calls that were served but not staged (with and without a served-report
entry), off-chain failures, staged-but-uncommitted calls, tampered or missing snapshots, a random
terminal declaration and policy, and judges it. Invariants: one outcome in the right slot; only
verified committed calls in the loss, each at most once, with the staged ids and logprobs; a chain
cut by an unstaged child never trains; a retry sibling no later call continued never trains;
deterministic; the yield adds up to the served report.

`test_credit_goes_only_where_it_was_earned` stages clean random call trees (retried turns,
re-sent first calls with the same prompt, sub-agent and compaction roots with their own prompts)
with a declared terminal, and checks against an oracle written from the definition: no token of
a sibling that no later call continued is in the loss, every token of the terminal chain is, and
every other call trains exactly once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.staging.records import ManifestFailure

from nemo_rl.data.rows import KeptRollout, Placeholder, PlaceholderReason
from nemo_rl.data.calls import ServedCall
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import FetchProblem, RolloutEvidence, RunFailure, judge_rollout

RID = "run-s9-g1-i4-a0"
GROUP, SAMPLE = 1, 4
UNSTAGED_REASONS = ("worker_capture_failed", "worker_response_missing_commit_coordinates", "unresolved_parent",
                    "invalid_worker_commit_coordinates")
NO_COORDS = "request_finished_without_staged_coordinates"
LOGPROBS = (-0.125, -0.25, -0.5, -1.0, -2.0, -3.5)


@dataclass
class Scenario:
    calls: list[tuple[str, str | None, tuple[int, ...], tuple[int, ...], tuple[float, ...], int]]
    unstaged: list[tuple[str, str | None, int, str, bool, bool]]  # id, parent, tokens, reason, in report, +no_coords
    off_chain: list[str]
    uncommitted: list[tuple[str, str | None, int]]
    failed_committed: str | None  # a committed call that also has a failure row
    faults: dict[str, str]  # committed call id -> "tampered" | "missing"
    report: bool
    run_result: dict[str, Any] | None
    run_failure: bool
    cfg: TokenCaptureConfig
    target: str  # the committed call a declaration names (unused when none is declared)
    declared: str  # how the outcome names its terminal (see `scenarios`)


def _rarely(value: bool, one_in: int):
    """`value` about once in `one_in` draws (not the first choice, which Hypothesis favours)."""
    return st.sampled_from((not value,) * (one_in - 1) + (value,))


DECLARED_HONESTLY = ("response_id", "explicit", "declared")  # a declaration naming a committed call


@st.composite
def scenarios(draw, forge: bool = True) -> Scenario:
    """A random forest; with `forge=False` nothing is forged (every call staged, committed and intact,
    served by one weight version, a terminal declared by a committed call, a run that ended with a reward)."""
    n = draw(st.integers(1, 6))
    calls = []
    for i in range(n):
        ids = [c[0] for c in calls]
        parent = None if i == 0 else draw(st.one_of(st.none(), st.sampled_from(ids), st.sampled_from(ids)))
        tail = tuple(draw(st.lists(st.integers(0, 40), min_size=1 if parent is None else 0, max_size=3)))
        generated = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)))
        logprobs = tuple(draw(st.sampled_from(LOGPROBS)) for _ in generated)
        calls.append((f"k{i}", parent, tail, generated, logprobs, draw(st.sampled_from((3, 3, 3, 4))) if forge else 3))
    committed = [c[0] for c in calls]
    unstaged = [
        (f"u{j}", draw(st.one_of(st.none(), st.sampled_from(committed))), draw(st.integers(0, 4)),
         draw(st.sampled_from(UNSTAGED_REASONS)), draw(_rarely(False, 6)), draw(st.booleans()))
        for j in range(draw(st.integers(0, 2 if forge else 0)))
    ]
    uncommitted = [(f"s{j}", draw(st.one_of(st.none(), st.sampled_from(committed))), draw(st.integers(1, 3)))
                   for j in range(draw(st.integers(0, 1)))]
    off_chain = [f"o{j}" for j in range(draw(st.integers(0, 2)))]
    failed_committed = draw(st.sampled_from(committed)) if forge and draw(_rarely(True, 12)) else None
    faults = {}
    for call_id in committed if forge else ():
        fault = draw(st.sampled_from(("ok",) * 8 + ("tampered", "missing")))
        if fault != "ok":
            faults[call_id] = fault
    declared = draw(st.sampled_from(("none", "response_id", "unstaged_response_id", "explicit", "declared",
                                     "declared_bogus") if forge else DECLARED_HONESTLY))
    target = draw(st.sampled_from(committed))
    response: dict[str, Any] = {"output": []}
    rewards = (1.0, 0.0, 0.5, 1.0, None) if forge else (1.0, 0.0, 0.5)
    result: dict[str, Any] = {"response": response, "reward": draw(st.sampled_from(rewards))}
    if declared == "response_id":
        response["id"] = f"chatcmpl-{RID}-{target}"
    elif declared == "unstaged_response_id":
        response["id"] = "chatcmpl-unstaged"
    elif declared == "explicit":
        result["_ng_terminal_model_call_id"] = target
    elif declared == "declared":
        result["terminal_response_id"] = f"chatcmpl-{RID}-{target}"
    elif declared == "declared_bogus":
        result["terminal_response_id"] = "chatcmpl-bogus"
    cfg = TokenCaptureConfig(branch_policy=draw(st.sampled_from(("all_chains", "all_chains", "terminal_chain"))),
                             mixed_weight_version_policy=draw(st.sampled_from(("allow", "reject"))))
    return Scenario(calls, unstaged, off_chain, uncommitted, failed_committed, faults,
                    report=draw(_rarely(False, 4)), run_result=result,
                    run_failure=draw(_rarely(True, 16)) if forge else False, cfg=cfg, target=target,
                    declared=declared)


def forged(sc: Scenario) -> bool:
    """Whether anything in the scenario may rightly mask the rollout: a failed run, no reward, a staged
    record tampered or missing, a served call without custody, a failure row on a committed call, a
    terminal not declared by a committed call (the heuristic walk may rightly refuse), or, under
    `mixed_weight_version_policy=reject`, a terminal chain served by several weight versions."""
    parent_of = {cid: parent for cid, parent, *_ in sc.calls}
    version_of = {cid: version for cid, *_, version in sc.calls}
    chain, cursor = [], sc.target
    while cursor is not None:
        chain.append(cursor)
        cursor = parent_of[cursor]
    mixed = len({version_of[cid] for cid in chain}) > 1
    return (sc.run_failure or sc.run_result["reward"] is None or bool(sc.faults) or bool(sc.unstaged)
            or sc.failed_committed is not None or sc.declared not in DECLARED_HONESTLY
            or (mixed and sc.cfg.mixed_weight_version_policy == "reject"))


def _materialize(trees, sc: Scenario):
    tree = trees.build(RID, [trees.Call(cid, parent, trees.Turn(tail, gen, lps), wv)
                             for cid, parent, tail, gen, lps, wv in sc.calls])
    failures = []
    for cid, _, _, reason, _, no_coords in sc.unstaged:
        failures.append(ManifestFailure(model_call_id=cid, reason=reason))
        if no_coords:
            failures.append(ManifestFailure(model_call_id=cid, reason=NO_COORDS))
    failures += [ManifestFailure(model_call_id=cid, reason=NO_COORDS) for cid in sc.off_chain]
    if sc.failed_committed is not None:
        failures.append(ManifestFailure(model_call_id=sc.failed_committed, reason="worker_capture_failed"))
    served = None
    if sc.report:
        served = list(tree.served())
        served += [ServedCall(RID, cid, parent, "text" if parent is None else "token_in", tokens, False, reason)
                   for cid, parent, tokens, reason, in_report, _ in sc.unstaged if in_report]
        served += [ServedCall(RID, cid, parent, "text" if parent is None else "token_in", tokens, True)
                   for cid, parent, tokens in sc.uncommitted]
        served = tuple(served)
    snapshots, problems = {}, {}
    for snapshot in tree.snapshots:
        fault = sc.faults.get(snapshot.model_call_id)
        if fault == "missing":
            problems[snapshot.staging_key] = FetchProblem(PlaceholderReason.STAGED_RECORD_MISSING, "gone")
        elif fault == "tampered":
            snapshots[snapshot.staging_key] = snapshot.model_copy(
                update={"token_ids_delta": [*snapshot.token_ids_delta[:-1], snapshot.token_ids_delta[-1] + 1]})
        else:
            snapshots[snapshot.staging_key] = snapshot
    run_failure = RunFailure(PlaceholderReason.RUN_FAILED, "RuntimeError: boom") if sc.run_failure else None
    ev = RolloutEvidence(RID, GROUP, SAMPLE, None if run_failure else sc.run_result, run_failure,
                         tree.manifest(failures), None, served)
    return tree, ev, snapshots, problems


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_judge_invariants_over_random_forests(trees, sc):
    tree, ev, snapshots, problems = _materialize(trees, sc)
    result = judge_rollout(ev, snapshots, problems, sc.cfg)

    # Exactly one outcome, in the rollout's slot.
    assert isinstance(result, (KeptRollout, Placeholder))
    assert (result.rollout_id, result.group_index, result.sample_index) == (RID, GROUP, SAMPLE)
    event(f"rows={len(result.rows)}" if isinstance(result, KeptRollout) else f"placeholder={result.reason.value}")

    # Deterministic, whatever the order of the snapshot mapping.
    again = judge_rollout(ev, dict(reversed(list(snapshots.items()))), dict(problems), sc.cfg)
    assert again == result

    # The yield adds up to the workers' served report.
    assert result.yield_ is not None
    if ev.served is not None:
        served_total = sum(call.generated_tokens for call in ev.served)
        assert result.yield_.served_generated_tokens == served_total
        assert result.yield_.kept_generated_tokens + sum(n for _, n in result.yield_.unverifiable) \
            + result.yield_.abandoned_retry_tokens == served_total
    else:
        assert result.yield_.served_generated_tokens is None and result.yield_.unverifiable == ()

    if isinstance(result, Placeholder):
        assert forged(sc), f"nothing was forged, yet the rollout was masked: {result.reason.value}: {result.detail}"
        return
    faulty = set(sc.faults)
    unstaged_ids = {cid for cid, *_ in sc.unstaged}
    reported = {call.model_call_id: call for call in ev.served or ()}
    assert sc.failed_committed is None and not sc.run_failure
    assert unstaged_ids <= set(reported), "a served-not-staged call the report cannot locate must poison"
    cut = {reported[cid].parent_call_id for cid in unstaged_ids}
    assert result.yield_.kept_generated_tokens == result.num_generated_tokens
    by_id = tree.by_id
    owners: Counter[str] = Counter()
    for position, row in enumerate(result.rows):
        assert row.chain_index == position and row.reward == result.reward
        assert row.model_call_ids[-1] not in cut, "a chain cut by an unstaged child is trained"
        assert not faulty & set(row.model_call_ids), "a row holds a call whose staged record is not verified"
        assert by_id[row.model_call_ids[0]].parent_call_id is None
        for parent, child in zip(row.model_call_ids, row.model_call_ids[1:]):
            assert by_id[child].parent_call_id == parent
        if sc.cfg.mixed_weight_version_policy == "reject":
            assert len(set(row.weight_versions)) == 1
        for call_id, (start, end) in zip(row.model_call_ids, row.call_spans):
            snapshot = tree.snapshot(call_id)
            assert call_id in by_id and snapshots[snapshot.staging_key] == snapshot
            assert list(row.token_ids[start:end]) == snapshot.token_ids_delta
            mask = list(row.token_mask[start:end])
            logprobs = list(row.generation_logprobs[start:end])
            if 1.0 in mask:
                owners[call_id] += 1
                assert mask == snapshot.token_mask_delta
                assert logprobs == snapshot.generation_log_probs_delta
            else:
                assert logprobs == [0.0] * (end - start)
        assert row.token_ids == tree.sequences[row.model_call_ids[-1]]
    assert all(count == 1 for count in owners.values()), f"calls in the loss twice: {owners}"
    # A token_in sibling off the terminal chain that no committed or served call continued is in no row.
    terminal_chain = set(result.rows[0].model_call_ids)
    continued = {r.parent_call_id for r in tree.records} | {c.parent_call_id for c in ev.served or ()}
    retried = [r.model_call_id for r in tree.records if r.parent_call_id is not None
               and sum(1 for o in tree.records if o.parent_call_id == r.parent_call_id) > 1]
    for call_id in retried:
        if call_id not in terminal_chain and call_id not in continued:
            assert all(call_id not in row.model_call_ids for row in result.rows), f"abandoned {call_id} trains"
    # Every committed call that trains was judged on its own staged generation, exactly once.
    assert sum(tree.snapshot(c).token_mask_delta.count(1.0) for c in owners) == result.num_generated_tokens
    if sc.cfg.branch_policy == "terminal_chain":
        assert len(result.rows) == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(forge=False))
def test_an_unforged_forest_is_kept_with_its_declared_terminal_first(trees, sc):
    tree, ev, snapshots, problems = _materialize(trees, sc)
    assert not forged(sc) and problems == {}
    result = judge_rollout(ev, snapshots, problems, sc.cfg)

    assert isinstance(result, KeptRollout), f"{result.reason.value}: {result.detail}"
    assert result.reward == sc.run_result["reward"] and result.terminal_selection == {
        "response_id": "response_id", "explicit": "declared", "declared": "declared"}[sc.declared]
    assert result.rows[0].model_call_ids[-1] == sc.target
    assert result.rows[0].token_ids == tree.sequences[sc.target]


ROOT_PROMPTS = ((1, 2), (1, 2), (1, 9), (7,))  # repeats: a re-sent first call has its sibling's prompt


@st.composite
def call_trees(draw):
    """(calls, terminal): a clean random forest and the call the harness scored."""
    calls = []
    for i in range(draw(st.integers(1, 7))):
        parent = None if i == 0 else draw(st.one_of(st.none(), st.sampled_from([c[0] for c in calls])))
        tail = draw(st.sampled_from(ROOT_PROMPTS)) if parent is None else tuple(
            draw(st.lists(st.integers(0, 40), max_size=2)))
        generated = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)))
        calls.append((f"k{i}", parent, tail, generated, tuple(-0.5 for _ in generated)))
    return calls, draw(st.sampled_from([c[0] for c in calls]))


def _abandoned_oracle(calls, terminal):
    """Straight from the definition: off the terminal chain, continued by no call, with a sibling
    (the same parent; for a root, the same prompt)."""
    parent_of = {cid: parent for cid, parent, *_ in calls}
    on_terminal, cursor = set(), terminal
    while cursor is not None:
        on_terminal.add(cursor)
        cursor = parent_of[cursor]
    continued = {parent for _, parent, *_ in calls if parent is not None}
    out = set()
    for cid, parent, tail, *_ in calls:
        if cid in on_terminal or cid in continued:
            continue
        if parent is not None:
            siblings = [o for o, p, *_ in calls if p == parent and o != cid]
        else:
            siblings = [o for o, p, t, *_ in calls if p is None and t == tail and o != cid]
        if siblings:
            out.add(cid)
    return out, on_terminal


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree_and_terminal=call_trees())
def test_credit_goes_only_where_it_was_earned(trees, tree_and_terminal):
    calls, terminal = tree_and_terminal
    tree = trees.build(RID, [trees.Call(cid, parent, trees.Turn(tail, gen, lps)) for cid, parent, tail, gen, lps in calls])
    run_result = {**trees.run_result(1.0), "terminal_response_id": tree.by_id[terminal].response_id}
    ev = RolloutEvidence(RID, GROUP, SAMPLE, run_result, None, tree.manifest(), None, tuple(tree.served()))
    result = judge_rollout(ev, tree.snapshots_by_key, {}, TokenCaptureConfig())

    abandoned, on_terminal = _abandoned_oracle(calls, terminal)
    event(f"abandoned={len(abandoned)}")
    assert isinstance(result, KeptRollout)
    in_loss: Counter[str] = Counter()
    for row in result.rows:
        for call_id, (start, end) in zip(row.model_call_ids, row.call_spans):
            if 1.0 in row.token_mask[start:end]:
                in_loss[call_id] += 1
                assert list(row.token_mask[start:end]) == tree.snapshot(call_id).token_mask_delta
    # No token of a sibling that no later call continued is ever in the loss ...
    assert not abandoned & set(in_loss), f"abandoned retries {sorted(abandoned & set(in_loss))} are in the loss"
    # ... every token of the terminal chain is, in the first row ...
    assert set(result.rows[0].model_call_ids) == on_terminal and result.rows[0].loss_call_ids() == on_terminal
    # ... and every other call trains exactly once.
    assert in_loss == Counter({cid: 1 for cid, *_ in calls if cid not in abandoned})
    generated = {cid: len(gen) for cid, _, _, gen, _ in calls}
    assert result.yield_.abandoned_retry_calls == len(abandoned)
    assert result.yield_.abandoned_retry_tokens == sum(generated[c] for c in abandoned)
    assert result.yield_.unverifiable == ()
    assert result.yield_.kept_generated_tokens + result.yield_.abandoned_retry_tokens == sum(generated.values())
