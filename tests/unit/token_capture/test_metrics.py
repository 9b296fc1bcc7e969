"""finalize_metrics: exact values over hand-built groups of kept rollouts and placeholders."""

from __future__ import annotations

from nemo_rl.data.rows import (
    CallLineage,
    GroupResult,
    KeptRollout,
    Placeholder,
    PlaceholderReason,
    RolloutYield,
    RowOrigin,
    TrainRow,
)
from nemo_rl.token_capture.metrics import finalize_metrics

R = PlaceholderReason


def _row(rid, group, sample, *, calls=2, reward=1.0, selection="response_id", origin=RowOrigin.CAPTURE, prefix="c",
         chain_index=0):
    capture = origin is RowOrigin.CAPTURE
    spans = {1: ((0, 3),), 2: ((0, 2), (2, 3)), 3: ((0, 1), (1, 2), (2, 3))}[calls]
    return TrainRow(
        rollout_id=rid, group_index=group, sample_index=sample,
        token_ids=(1, 2, 3), token_mask=(0.0, 1.0, 1.0), generation_logprobs=(0.0, -0.5, -0.5),
        reward=reward, prompt_len=1,
        model_call_ids=tuple(f"{prefix}{k}" for k in range(calls)),
        weight_versions=tuple(range(calls)) if capture else (None,) * calls,
        token_in_calls=calls - 1 if capture else 0, text_root_calls=1 if capture else 0,
        terminal_selection=selection if capture else None, origin=origin,
        call_spans=spans if capture else (), chain_index=chain_index,
    )


def _kept(rows, yield_=None):
    first = rows[0]
    return KeptRollout(first.rollout_id, first.group_index, first.sample_index, tuple(rows), first.reward,
                       first.terminal_selection, yield_)


def test_metrics_over_mixed_groups():
    b_rows = [_row("b", 0, 1, calls=1, reward=0.0, selection="heuristic"),
              _row("b", 0, 1, calls=1, reward=0.0, selection="heuristic", prefix="d", chain_index=1)]
    group0 = GroupResult(0, (
        _kept([_row("a", 0, 0, calls=3, reward=1.0)],
              RolloutYield(4, 2, (("served_not_staged", 2),), 1, lineage=CallLineage(2, 0, 0))),
        _kept(b_rows, RolloutYield(7, 4, (("excluded_by_branch_policy", 2),), 2, False, 1, 1, CallLineage(0, 0, 1))),
        Placeholder("c", 0, 2, R.CAPTURE_POISONED, "served_not_staged_unlocated", 1.0, "heuristic",
                    RolloutYield(5, 0, (("capture_poisoned", 5),), 1, lineage=CallLineage(1, 1, 1))),
        Placeholder("d", 0, 3, R.RUN_TIMEOUT, "slow"),
    ))
    group1 = GroupResult(1, (
        _kept([_row("e", 1, 0, calls=2, reward=0.5)], RolloutYield(None, 2, (), 1)),
        Placeholder("f", 1, 1, R.VERIFICATION_FAILED, "corrupt_digest", 0.5, "response_id",
                    RolloutYield(3, 0, (("verification_failed", 3),), 1, lineage=CallLineage(1, 0, 0))),
        Placeholder("g", 1, 2, R.TERMINAL_WITNESS_DISAGREEMENT, "witness_disagreement[...]", 0.0, None,
                    RolloutYield(2, 0, (("terminal_witness_disagreement", 2),), 1, True)),
        Placeholder("h", 1, 3, R.EMPTY_MANIFEST, "no committed call and no failure row", 1.0),
    ))

    metrics = finalize_metrics([group0, group1], [10.0, 30.0, 20.0])

    assert metrics == {
        "rollouts/dispatched": 8.0,
        "finalize/kept_rollouts": 3.0,
        "finalize/rows": 4.0,  # a: 1, b: 2 chains, e: 1
        "finalize/placeholders": 5.0,
        "finalize/rows_per_rollout": 4 / 3,
        "finalize/chains_per_rollout": 4 / 3,  # manifest leaves of a, b, e: 1 + 2 + 1
        "finalize/token_in_calls": 3.0,  # a: 2, b: 0 + 0, e: 1
        "finalize/text_root_calls": 4.0,
        # per served call, over a, b, c, f (the verdicts with a lineage, placeholders included):
        # token-in 2 + 0 + 1 + 1, unresolved 0 + 0 + 1 + 0, branches 0 + 1 + 1 + 0
        "finalize/continuation_calls": 5.0,
        "finalize/unresolved_continuations": 1.0,
        "finalize/token_in_rate": 4 / 5,
        "finalize/branches_per_rollout": 2 / 4,
        "finalize/abandoned_retry_calls": 1.0,
        "finalize/abandoned_retry_tokens": 1.0,
        "finalize/capture_poisoned_rollouts": 1.0,
        "finalize/invalid_row_rate": 5 / 8,
        # selections named: a, b(h), c(h), e, f -> 2 heuristic of 5
        "finalize/heuristic_terminal_fraction": 2 / 5,
        "finalize/heuristic_terminal_picks": 2.0,  # b (kept) and c (picked, then masked for another reason)
        "finalize/terminal_witness_disagreements": 1.0,
        "finalize/calls_per_rollout": 7 / 4,  # (3 + 1 + 1 + 2) / 4 rows
        "finalize/queue_wait_ms": 20.0,
        "finalize/queue_wait_ms_max": 30.0,
        "weight_version/min": 0.0,
        "weight_version/max": 2.0,
        # kept 1 + 0 + 0.5, placeholders 1 + 0 (unknown) + 0.5 + 0 + 1
        "reward/mean": 4.0 / 8,
        # reports of a, b, c, f, g (e has none): served 4 + 7 + 5 + 3 + 2, kept 2 + 4; b's abandoned
        # retry token is outside the denominator
        "finalize/served_generated_tokens": 21.0,
        "finalize/kept_generated_token_fraction": 6 / 20,
        "finalize/unverifiable_generated_tokens/capture_poisoned": 5.0,
        "finalize/unverifiable_generated_tokens/excluded_by_branch_policy": 2.0,
        "finalize/unverifiable_generated_tokens/served_not_staged": 2.0,
        "finalize/unverifiable_generated_tokens/terminal_witness_disagreement": 2.0,
        "finalize/unverifiable_generated_tokens/verification_failed": 3.0,
        # no row carries routes (dense model): every token of the 4 trained rows is a sentinel token
        "router_replay/coverage": 0.0,
        "router_replay/sentinel_tokens": 12.0,
        "router_replay/rows_with_routes": 0.0,
        "finalize/terminal_selection/heuristic": 2.0,
        "finalize/terminal_selection/response_id": 3.0,
        "finalize/placeholders/capture_poisoned": 1.0,
        "finalize/placeholders/empty_manifest": 1.0,
        "finalize/placeholders/run_timeout": 1.0,
        "finalize/placeholders/terminal_witness_disagreement": 1.0,
        "finalize/placeholders/verification_failed": 1.0,
    }


def test_empty_denominators_are_zero_not_errors():
    metrics = finalize_metrics([], [])

    assert metrics == {
        "rollouts/dispatched": 0.0,
        "finalize/kept_rollouts": 0.0,
        "finalize/rows": 0.0,
        "finalize/placeholders": 0.0,
        "finalize/rows_per_rollout": 0.0,
        "finalize/chains_per_rollout": 0.0,
        "finalize/token_in_calls": 0.0,
        "finalize/text_root_calls": 0.0,
        "finalize/token_in_rate": 0.0,  # no continuation call: read finalize/continuation_calls
        "finalize/continuation_calls": 0.0,
        "finalize/unresolved_continuations": 0.0,
        "finalize/branches_per_rollout": 0.0,
        "finalize/abandoned_retry_calls": 0.0,
        "finalize/abandoned_retry_tokens": 0.0,
        "finalize/capture_poisoned_rollouts": 0.0,
        "finalize/invalid_row_rate": 0.0,
        "finalize/heuristic_terminal_fraction": 0.0,
        "finalize/heuristic_terminal_picks": 0.0,
        "finalize/terminal_witness_disagreements": 0.0,
        "finalize/calls_per_rollout": 0.0,
        "finalize/queue_wait_ms": 0.0,
        "finalize/queue_wait_ms_max": 0.0,
        "weight_version/min": -1.0,
        "weight_version/max": -1.0,
        "reward/mean": 0.0,
        "finalize/served_generated_tokens": 0.0,
        "finalize/kept_generated_token_fraction": 0.0,
        "router_replay/coverage": 0.0,
        "router_replay/sentinel_tokens": 0.0,
        "router_replay/rows_with_routes": 0.0,
    }


def test_legacy_rows_add_no_capture_calls():
    group = GroupResult(0, (_kept([_row("a", 0, 0, origin=RowOrigin.LEGACY, reward=1.0)]),
                            Placeholder("b", 0, 1, R.LEGACY_NONCONTIGUOUS, "call 1", 0.0)))
    metrics = finalize_metrics([group], [])

    assert (metrics["finalize/token_in_calls"], metrics["finalize/text_root_calls"]) == (0.0, 0.0)
    assert metrics["finalize/token_in_rate"] == 0.0
    assert metrics["finalize/placeholders/legacy_noncontiguous"] == 1.0
    assert metrics["reward/mean"] == 0.5
    assert metrics["finalize/heuristic_terminal_fraction"] == 0.0
    assert (metrics["weight_version/min"], metrics["weight_version/max"]) == (-1.0, -1.0)
    assert (metrics["finalize/rows"], metrics["finalize/chains_per_rollout"]) == (1.0, 0.0)
    assert (metrics["finalize/served_generated_tokens"], metrics["finalize/kept_generated_token_fraction"]) == (0.0, 0.0)


def _lineage_step(*lineages):
    """One group whose rollout i trains one single-call row and carries lineages[i]."""
    entries = tuple(_kept([_row(f"r{i}", 0, i, calls=1)], RolloutYield(2, 2, (), 1, lineage=lineage))
                    for i, lineage in enumerate(lineages))
    return finalize_metrics([GroupResult(0, entries)], [])


def _health(metrics):
    return tuple(metrics[f"finalize/{k}"] for k in ("token_in_rate", "continuation_calls", "unresolved_continuations",
                                                    "branches_per_rollout"))


def test_token_in_rate_moves_when_a_continuation_was_re_rendered():
    # Each row is one chain with one text root: the rows alone say nothing about a re-rendered call.
    # The second rollout's continuation was admitted as a new root although its history held the
    # model's (edited) turn: one of its two continuations missed its parent.
    assert _health(_lineage_step(CallLineage(2, 0, 0), CallLineage(1, 1, 1))) == (3 / 4, 4.0, 1.0, 1 / 2)


def test_history_rewrites_are_branches_not_misses():
    # A compaction and a sub-agent open roots with no assistant turn in their history.
    assert _health(_lineage_step(CallLineage(2, 0, 1), CallLineage(3, 0, 2))) == (1.0, 5.0, 0.0, 3 / 2)


def test_single_call_rollouts_have_no_continuation_and_a_zero_rate():
    assert _health(_lineage_step(CallLineage(0, 0, 0))) == (0.0, 0.0, 0.0, 0.0)


def test_abandoned_retries_are_outside_the_kept_fraction():
    entry = _kept([_row("a", 0, 0, calls=1)], RolloutYield(10, 2, (), 2, False, 3, 8, CallLineage(2, 0, 0)))
    metrics = finalize_metrics([GroupResult(0, (entry,))], [])

    assert metrics["finalize/kept_generated_token_fraction"] == 1.0  # 2 kept of 10 served - 8 abandoned
    assert (metrics["finalize/abandoned_retry_calls"], metrics["finalize/abandoned_retry_tokens"]) == (3.0, 8.0)
    assert not any(key.startswith("finalize/unverifiable_generated_tokens/") for key in metrics)


def test_the_heuristic_pick_counter_counts_walk_picks_only():
    # kept by the walk, kept by a declared output witness, and a walk that could not choose (no pick).
    group = GroupResult(0, (
        _kept([_row("a", 0, 0, calls=2, reward=1.0, selection="heuristic")]),
        _kept([_row("b", 0, 1, calls=2, reward=1.0, selection="content")]),
        Placeholder("c", 0, 2, R.TERMINAL_SELECTION_FAILED, "terminal_selection_failed:ambiguous_terminal", 1.0,
                    "heuristic"),
        Placeholder("d", 0, 3, R.TERMINAL_WITNESS_UNMATCHED, "matches no committed call's output", 1.0, "content"),
    ))

    metrics = finalize_metrics([group], [])

    assert metrics["finalize/heuristic_terminal_picks"] == 1.0
    assert metrics["finalize/terminal_selection/heuristic"] == 2.0  # selection named, picked or not
    assert metrics["finalize/placeholders/terminal_witness_unmatched"] == 1.0
