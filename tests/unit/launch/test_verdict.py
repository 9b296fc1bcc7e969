"""The smoke script's verdict: engaged / degraded / not engaged, and the reason, from metrics lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl.utils.verdict import (
    DEGRADED,
    ENGAGED,
    NOT_ENGAGED,
    VerdictError,
    capture_verdict,
    main,
    read_metrics,
)


def _step(step: int = 1, **changes: float) -> dict:
    """One step line as the capture loop writes it (values from a real 16-rollout step)."""
    line = {
        "step": step,
        "rollouts/dispatched": 16.0,
        "finalize/kept_rollouts": 16.0,
        "finalize/rows": 16.0,
        "finalize/placeholders": 0.0,
        "finalize/text_root_calls": 16.0,
        "finalize/token_in_calls": 16.0,
        "finalize/token_in_rate": 1.0,
        "finalize/capture_poisoned_rollouts": 0.0,
        "finalize/calls_per_rollout": 2.0,
        "token_mult_prob_error": 1.0000023,
        "reward/mean": 0.67,
    }
    line.update(changes)
    return line


def test_a_clean_capture_run_is_engaged_with_its_numbers() -> None:
    verdict = capture_verdict([_step(1), _step(2, **{"finalize/token_in_calls": 15.0})])
    assert verdict.status == ENGAGED and verdict.engaged
    assert verdict.line() == (
        "capture ENGAGED: 2 step(s), 32 rows from 32 rollouts, 0 placeholders, 0 poisoned, "
        "token_mult_prob_error max 1.0000, token_in_rate min 1.000"
    )


def test_no_lines_is_not_engaged_and_names_the_file() -> None:
    verdict = capture_verdict([], source="/runs/a/metrics.jsonl")
    assert verdict.status == NOT_ENGAGED
    assert verdict.line() == "capture NOT ENGAGED: no step finished: /runs/a/metrics.jsonl is missing or empty (read the run's log)"


def test_foreign_metrics_are_not_engaged_naming_the_missing_keys() -> None:
    line = _step()
    del line["finalize/token_in_rate"]
    assert capture_verdict([line]).reason == (
        "step 1 lacks ['finalize/token_in_rate']: not the metrics of the GRPO capture loop"
    )


def test_the_legacy_path_is_not_engaged() -> None:
    legacy = _step(**{"finalize/text_root_calls": 0.0, "finalize/token_in_calls": 0.0, "finalize/token_in_rate": 0.0})
    verdict = capture_verdict([legacy, {**legacy, "step": 2}])
    assert verdict.status == NOT_ENGAGED
    assert verdict.reason == (
        "32 rows trained but no call was served through capture (text_root_calls=0, token_in_calls=0 on "
        "every step): the legacy path ran; set token_capture.enabled=true"
    )


def test_all_placeholders_is_not_engaged_with_the_reasons_most_common_first() -> None:
    line = _step(**{
        "finalize/rows": 0.0, "finalize/kept_rollouts": 0.0, "finalize/placeholders": 16.0,
        "finalize/text_root_calls": 0.0, "finalize/token_in_calls": 0.0, "finalize/token_in_rate": 0.0,
        "finalize/placeholders/run_timeout": 4.0, "finalize/placeholders/verification_failed": 12.0,
    })
    assert capture_verdict([line]).line() == (
        "capture NOT ENGAGED: no row was trained in 1 step(s): all 16 rollouts became placeholders "
        "(verification_failed=12, run_timeout=4)"
    )


def test_poisoned_rollouts_degrade() -> None:
    line = _step(**{"finalize/rows": 14.0, "finalize/placeholders": 2.0, "finalize/capture_poisoned_rollouts": 2.0,
                    "finalize/placeholders/capture_poisoned": 2.0})
    assert capture_verdict([line]).line() == (
        "capture DEGRADED: 2 of 16 rollouts were poisoned (placeholders: capture_poisoned=2)"
    )


def test_re_rendered_continuations_degrade() -> None:
    line = _step(2, **{"finalize/token_in_calls": 8.0, "finalize/token_in_rate": 0.5, "finalize/text_root_calls": 24.0})
    assert capture_verdict([_step(1), line]).line() == (
        "capture DEGRADED: step 2: token_in_rate=0.500 < 0.99: some continuation calls were re-rendered "
        "from text instead of served from the parent's exact ids"
    )


def test_all_continuations_re_rendered_degrades_although_no_token_in_call() -> None:
    # Roots outnumber rows: every continuation was a text root; token_in_rate is 0.0.
    line = _step(**{"finalize/token_in_calls": 0.0, "finalize/token_in_rate": 0.0, "finalize/text_root_calls": 32.0})
    assert capture_verdict([line]).status == DEGRADED


def test_single_turn_rollouts_are_engaged_but_say_token_in_was_not_exercised() -> None:
    line = _step(**{"finalize/token_in_calls": 0.0, "finalize/token_in_rate": 0.0, "finalize/calls_per_rollout": 1.0})
    assert capture_verdict([line]).line() == (
        "capture ENGAGED: 1 step(s), 16 rows from 16 rollouts, 0 placeholders, 0 poisoned, token_mult_prob_error "
        "max 1.0000; token-in not exercised (no continuation call: single-turn rollouts)"
    )


def test_inexact_logprobs_degrade_naming_the_worst_step() -> None:
    lines = [_step(1, token_mult_prob_error=1.005), _step(2, token_mult_prob_error=1.2)]
    assert capture_verdict(lines).line() == (
        "capture DEGRADED: step 2: token_mult_prob_error=1.2000 > 1.01: trainer logprobs differ from the generation logprobs"
    )


def test_read_metrics_missing_file_is_empty_and_bad_lines_are_named(tmp_path: Path) -> None:
    assert read_metrics(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_step(1)) + "\n\n" + '{"step": 2,\n')
    with pytest.raises(VerdictError, match=r"metrics\.jsonl:3 is not JSON"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(VerdictError, match=r"metrics\.jsonl:1 is a JSON list, not an object"):
        read_metrics(tmp_path)


def test_cli_prints_one_line_and_exits_by_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 1
    assert capsys.readouterr().out == f"capture NOT ENGAGED: no step finished: {tmp_path / 'metrics.jsonl'} is missing or empty (read the run's log)\n"
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_step(1)) + "\n")
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("capture ENGAGED: 1 step(s), 16 rows")
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"verdict error: {tmp_path / 'metrics.jsonl'}:1 is not JSON")
