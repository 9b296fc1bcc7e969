"""finalize_metrics: exact values over hand-built groups."""

from __future__ import annotations

import dataclasses

from nemo_rl.token_capture.metrics import finalize_metrics
from nemo_rl.token_capture.rows import GroupResult, Placeholder, PlaceholderReason, RowOrigin, TrainRow


def _row(rid, group, sample, *, calls=2, reward=1.0, selection="response_id", origin=RowOrigin.CAPTURE):
    capture = origin is RowOrigin.CAPTURE
    return TrainRow(
        rollout_id=rid, group_index=group, sample_index=sample,
        token_ids=(1, 2, 3), token_mask=(0.0, 1.0, 1.0), generation_logprobs=(0.0, -0.5, -0.5),
        reward=reward, prompt_len=1,
        model_call_ids=tuple(f"c{k}" for k in range(calls)),
        weight_versions=tuple(range(calls)) if capture else (None,) * calls,
        token_in_calls=calls - 1 if capture else 0, text_root_calls=1 if capture else 0,
        terminal_selection=selection if capture else None, origin=origin,
    )


def test_metrics_over_mixed_groups():
    group0 = GroupResult(0, (
        _row("a", 0, 0, calls=3, reward=1.0),
        _row("b", 0, 1, calls=1, reward=0.0, selection="heuristic"),
        Placeholder("c", 0, 2, PlaceholderReason.CAPTURE_POISONED, "worker_capture_failed", 1.0, "heuristic"),
        Placeholder("d", 0, 3, PlaceholderReason.RUN_TIMEOUT, "slow"),
    ))
    group1 = GroupResult(1, (
        _row("e", 1, 0, calls=2, reward=0.5),
        Placeholder("f", 1, 1, PlaceholderReason.VERIFICATION_FAILED, "corrupt_digest", 0.5, "response_id"),
        Placeholder("g", 1, 2, PlaceholderReason.CAPTURE_POISONED, "unresolved_parent", 0.0),
        Placeholder("h", 1, 3, PlaceholderReason.EMPTY_MANIFEST, "empty_manifest", 1.0),
    ))

    metrics = finalize_metrics([group0, group1], [10.0, 30.0, 20.0])

    assert metrics == {
        "rollouts/dispatched": 8.0,
        "finalize/rows": 3.0,
        "finalize/placeholders": 5.0,
        "finalize/token_in_calls": 3.0,  # 2 + 0 + 1
        "finalize/text_root_calls": 3.0,
        "finalize/token_in_rate": 1.0,  # 3 continuations (a: 2, e: 1), all token-in
        "finalize/capture_poisoned_rollouts": 2.0,
        "finalize/invalid_row_rate": 5 / 8,
        # selections named: a, b(h), c(h), e, f -> 2 heuristic of 5
        "finalize/heuristic_terminal_fraction": 2 / 5,
        "finalize/calls_per_rollout": 2.0,  # (3 + 1 + 2) / 3
        "finalize/queue_wait_ms": 20.0,
        "finalize/queue_wait_ms_max": 30.0,
        # rows 1 + 0 + 0.5, placeholders 1 + 0 (unknown) + 0.5 + 0 + 1
        "reward/mean": 4.0 / 8,
        "finalize/placeholders/capture_poisoned": 2.0,
        "finalize/placeholders/empty_manifest": 1.0,
        "finalize/placeholders/run_timeout": 1.0,
        "finalize/placeholders/verification_failed": 1.0,
    }


def test_empty_denominators_are_zero_not_errors():
    metrics = finalize_metrics([], [])

    assert metrics == {
        "rollouts/dispatched": 0.0,
        "finalize/rows": 0.0,
        "finalize/placeholders": 0.0,
        "finalize/token_in_calls": 0.0,
        "finalize/text_root_calls": 0.0,
        "finalize/token_in_rate": 0.0,
        "finalize/capture_poisoned_rollouts": 0.0,
        "finalize/invalid_row_rate": 0.0,
        "finalize/heuristic_terminal_fraction": 0.0,
        "finalize/calls_per_rollout": 0.0,
        "finalize/queue_wait_ms": 0.0,
        "finalize/queue_wait_ms_max": 0.0,
        "reward/mean": 0.0,
    }


def test_legacy_rows_add_no_capture_calls():
    group = GroupResult(0, (_row("a", 0, 0, origin=RowOrigin.LEGACY, reward=1.0),
                            Placeholder("b", 0, 1, PlaceholderReason.LEGACY_NONCONTIGUOUS, "call 1", 0.0)))
    metrics = finalize_metrics([group], [])

    assert (metrics["finalize/token_in_calls"], metrics["finalize/text_root_calls"]) == (0.0, 0.0)
    assert metrics["finalize/token_in_rate"] == 0.0
    assert metrics["finalize/placeholders/legacy_noncontiguous"] == 1.0
    assert metrics["reward/mean"] == 0.5
    assert metrics["finalize/heuristic_terminal_fraction"] == 0.0


def test_token_in_rate_counts_continuations_re_rendered_as_roots():
    row = _row("a", 0, 0, calls=3)
    rerooted = dataclasses.replace(row, token_in_calls=1, text_root_calls=2)
    metrics = finalize_metrics([GroupResult(0, (rerooted,))], [])
    # 2 continuations: one served token-in, one re-rendered from text as a second root
    assert metrics["finalize/token_in_rate"] == 0.5
