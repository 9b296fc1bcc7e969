"""The smoke script's verdict, from metrics files written by the real logger: each verdict is
tripped by the file built to trip it, and a healthy file (weather within bounds included) passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl.token_capture.verdict import (
    DEGRADED,
    ENGAGED,
    NOT_ENGAGED,
    UNJUDGED,
    VerdictError,
    capture_verdict,
    main,
    read_metrics,
)
from tests.metrics_lines import healthy_line, with_placeholders, write_metrics

HEALTHY_2_STEPS = (
    "capture ENGAGED: 2 step(s), 16 rows from 16 rollouts, 0 placeholders, token_mult_prob_error max 1.0000, "
    "kept generated-token fraction 1.000, token_in_rate min 1.000 over 16 continuation calls, 0 unresolved; "
    "branches_per_rollout max 1; 0 abandoned retries masked (0 tokens)"
)


def _verdict_of(tmp_path: Path, lines: list[dict], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, printed report) of the CLI on a metrics file the logger wrote."""
    write_metrics(tmp_path / "run", lines)
    status = main([str(tmp_path / "run")])
    return status, capsys.readouterr().out


def test_a_healthy_run_is_engaged_with_its_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _verdict_of(tmp_path, [healthy_line(1), healthy_line(2)], capsys) == (0, HEALTHY_2_STEPS + "\n")


def test_weather_within_its_bound_passes_and_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One run_timeout in 16 rollouts (0.0625) is within the environment budget (0.10).
    lines = [healthy_line(1), with_placeholders(healthy_line(2), run_timeout=1)]
    status, out = _verdict_of(tmp_path, lines, capsys)
    assert (status, out) == (0, (
        "capture ENGAGED: 2 step(s), 15 rows from 16 rollouts, 1 placeholders (run_timeout=1), token_mult_prob_error "
        "max 1.0000, kept generated-token fraction 1.000, token_in_rate min 1.000 over 16 continuation calls, 0 "
        "unresolved; branches_per_rollout max 1; 0 abandoned retries masked (0 tokens)\n"))


PLACEHOLDER_LOOK = "look at the placeholders' details (reason {r!r}) in the driver log and finalize/placeholders/{r} per step"


@pytest.mark.parametrize("reason", ["staged_record_missing", "data_plane_error", "finalize_timeout",
                                    "served_report_unavailable", "finalizer_unavailable", "component_failed"])
def test_one_transport_placeholder_in_a_smoke_run_degrades(
    reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [healthy_line(1), with_placeholders(healthy_line(2), **{reason: 1})]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        f"capture DEGRADED: finalize/placeholders/{reason}=1 of 16 rollouts (0.0625) (transport weather, tolerated "
        f"<= 0.01 of dispatched) in step 2: more transport failures than weather explains; "
        f"{PLACEHOLDER_LOOK.format(r=reason)}\n"))


@pytest.mark.parametrize("reason", ["capture_poisoned", "verification_failed", "declared_terminal_uncaptured",
                                    "terminal_witness_disagreement", "mixed_weight_version"])
def test_a_single_broken_contract_placeholder_degrades(
    reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [healthy_line(1), with_placeholders(healthy_line(2), **{reason: 1})]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        f"capture DEGRADED: finalize/placeholders/{reason}=1 (must be 0) in step 2: a broken contract (capture, "
        f"verification, terminal or harness), not weather; {PLACEHOLDER_LOOK.format(r=reason)}\n"))


def test_an_unknown_placeholder_reason_degrades(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [healthy_line(1), with_placeholders(healthy_line(2), brand_new_reason=1)]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture DEGRADED: finalize/placeholders/brand_new_reason=1 (unclassified reason: no tolerance) in step 2: a "
        "placeholder reason the health thresholds do not know; it is never passed silently; look at "
        "nemo_rl/token_capture/capture_health.py CaptureHealthThresholds: classify the reason\n"))


def test_environment_weather_above_its_bound_degrades_with_every_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [with_placeholders(healthy_line(1), run_timeout=1), with_placeholders(healthy_line(2), run_timeout=1)]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture DEGRADED: finalize/placeholders/run_timeout=2 of 16 rollouts (0.125) (environment weather, tolerated "
        "<= 0.1 of dispatched) in steps 1,2: more environment failures than weather explains; "
        f"{PLACEHOLDER_LOOK.format(r='run_timeout')} (+1 more below)\n"
        "  - finalize/invalid_row_rate=0.125 over the run (2 of 16) (<= 0.1) worst at step 1 (0.125): too many "
        "rollouts became placeholders to train on a representative batch; look at finalize/placeholders/<reason> for "
        "which reasons dominate\n"))


def test_a_high_invalid_row_rate_degrades_although_its_reason_is_derived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [healthy_line(1), with_placeholders(healthy_line(2), group_below_min_valid_fraction=2)]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture DEGRADED: finalize/invalid_row_rate=0.125 over the run (2 of 16) (<= 0.1) worst at step 2 (0.25): too "
        "many rollouts became placeholders to train on a representative batch; look at finalize/placeholders/<reason> "
        "for which reasons dominate\n"))


def test_placeholders_without_a_reason_degrade(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [healthy_line(1), healthy_line(2, **{"finalize/placeholders": 1.0, "finalize/kept_rollouts": 7.0,
                                                 "finalize/invalid_row_rate": 0.125})]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture DEGRADED: finalize/placeholders=1 (must equal the sum of finalize/placeholders/<reason> (0)) at step 2: "
        "some placeholders carry no reason, so they cannot be judged; look at nemo_rl/token_capture/metrics.py "
        "finalize_metrics\n"))


def test_a_low_kept_generated_token_fraction_degrades(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [healthy_line(1), healthy_line(2, **{"finalize/kept_generated_token_fraction": 0.5,
                                                 "finalize/unverifiable_generated_tokens/verification_failed": 120.0})]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture DEGRADED: finalize/kept_generated_token_fraction=0.75 over the run (360 of 480 served tokens) (>= 0.9) "
        "worst at step 2 (0.5): generated tokens were served but not trained; look at "
        "finalize/unverifiable_generated_tokens/<reason> (this run: verification_failed=120)\n"))


def test_a_low_token_in_rate_degrades(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [healthy_line(1, **{"finalize/token_in_rate": 0.75}), healthy_line(2, **{"finalize/token_in_rate": 0.5})]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture DEGRADED: finalize/token_in_rate=0.5 (8 continuation calls) (>= 0.99 on steps with continuation "
        "calls) at step 2, worst of steps 1,2: continuation calls were re-rendered from text instead of served from "
        "the parent's exact ids; look at finalize/unresolved_continuations and the harness: does it edit what the "
        "model said before sending it back?\n"))


def test_unresolved_continuations_degrade(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [healthy_line(1), healthy_line(2, **{"finalize/unresolved_continuations": 2.0})]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture DEGRADED: finalize/unresolved_continuations=2 over the run (<= 0 per step) in step 2: calls whose "
        "history held assistant turns resolved to no captured parent (a re-render); look at the gate's lineage "
        "decisions for those calls; the harness's history handling\n"))


def test_inexact_logprobs_degrade_naming_the_worst_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [healthy_line(1, token_mult_prob_error=1.05), healthy_line(2, token_mult_prob_error=1.2)]
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture DEGRADED: token_mult_prob_error=1.2000 (<= 1.01) at step 2, worst of steps 1,2: trainer logprobs "
        "differ from the generation logprobs; look at gen_kl_error and the rows' tokens vs the engine's\n"))


def test_single_turn_rollouts_are_engaged_and_their_zero_token_in_rate_is_not_judged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    single = {"finalize/token_in_rate": 0.0, "finalize/continuation_calls": 0.0, "finalize/token_in_calls": 0.0,
              "finalize/calls_per_rollout": 1.0}
    assert _verdict_of(tmp_path, [healthy_line(1, **single)], capsys) == (0, (
        "capture ENGAGED: 1 step(s), 8 rows from 8 rollouts, 0 placeholders, token_mult_prob_error max 1.0000, kept "
        "generated-token fraction 1.000; token-in not exercised (no continuation call: single-turn rollouts); "
        "branches_per_rollout max 1; 0 abandoned retries masked (0 tokens)\n"))


def test_metrics_without_the_health_signals_are_unjudged_never_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = {"finalize/continuation_calls": None, "finalize/unresolved_continuations": None}
    lines = [healthy_line(1, **old), healthy_line(2, **old)]
    assert capture_verdict(lines).status == UNJUDGED
    assert _verdict_of(tmp_path, lines, capsys) == (1, (
        "capture UNJUDGED: steps [1, 2] lack ['finalize/continuation_calls', 'finalize/unresolved_continuations']: "
        "capture ran, but its health cannot be judged without them (a build that predates them wrote this file; "
        "re-run with a current build)\n"))


def test_informational_metrics_never_degrade_and_their_absence_is_named() -> None:
    retried = [healthy_line(1, **{"finalize/abandoned_retry_calls": 3.0, "finalize/abandoned_retry_tokens": 41.0,
                                  "finalize/branches_per_rollout": 1.5})]
    verdict = capture_verdict(retried)
    assert verdict.status == ENGAGED
    assert verdict.reason.endswith("; branches_per_rollout max 1.5; 3 abandoned retries masked (41 tokens)")
    absent = {"finalize/abandoned_retry_calls": None, "finalize/abandoned_retry_tokens": None,
              "finalize/branches_per_rollout": None}
    verdict = capture_verdict([healthy_line(1, **absent)])
    assert verdict.status == ENGAGED
    assert verdict.reason.endswith("; not logged: branches_per_rollout, abandoned_retry_calls, abandoned_retry_tokens")


def test_no_lines_is_not_engaged_and_names_the_file() -> None:
    verdict = capture_verdict([], source="/runs/a/metrics.jsonl")
    assert verdict.status == NOT_ENGAGED
    assert verdict.line() == "capture NOT ENGAGED: no step finished: /runs/a/metrics.jsonl is missing or empty (read the run's log)"


def test_foreign_metrics_are_not_engaged_naming_the_missing_keys() -> None:
    assert capture_verdict([healthy_line(1, **{"finalize/text_root_calls": None})]).reason == (
        "step 1 lacks ['finalize/text_root_calls']: not the metrics of the GRPO capture loop"
    )


def test_the_legacy_path_is_not_engaged() -> None:
    legacy = {"finalize/text_root_calls": 0.0, "finalize/token_in_calls": 0.0, "finalize/token_in_rate": 0.0}
    verdict = capture_verdict([healthy_line(1, **legacy), healthy_line(2, **legacy)])
    assert verdict.status == NOT_ENGAGED
    assert verdict.reason == (
        "16 rows trained but no call was served through capture (text_root_calls=0, token_in_calls=0 on "
        "every step): the legacy path ran; set token_capture.enabled=true"
    )


def test_all_placeholders_is_not_engaged_with_the_reasons_most_common_first() -> None:
    line = with_placeholders(healthy_line(1), run_timeout=2, verification_failed=6)
    assert capture_verdict([line]).line() == (
        "capture NOT ENGAGED: no row was trained in 1 step(s): all 8 rollouts became placeholders "
        "(verification_failed=6, run_timeout=2)"
    )


def test_every_degraded_file_is_degraded_not_engaged() -> None:
    # The status constant, not only the text: scripts branch on it.
    line = with_placeholders(healthy_line(2), verification_failed=1)
    assert capture_verdict([healthy_line(1), line]).status == DEGRADED


def test_read_metrics_missing_file_is_empty_and_bad_lines_are_named(tmp_path: Path) -> None:
    assert read_metrics(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text(json.dumps(healthy_line(1)) + "\n\n" + '{"step": 2,\n')
    with pytest.raises(VerdictError, match=r"metrics\.jsonl:3 is not JSON"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(VerdictError, match=r"metrics\.jsonl:1 is a JSON list, not an object"):
        read_metrics(tmp_path)


def test_cli_exit_status_for_missing_and_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 1
    assert capsys.readouterr().out == (
        f"capture NOT ENGAGED: no step finished: {tmp_path / 'metrics.jsonl'} is missing or empty (read the run's log)\n")
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"verdict error: {tmp_path / 'metrics.jsonl'}:1 is not JSON")
