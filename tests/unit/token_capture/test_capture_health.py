"""The capture-health thresholds: one validated place, every placeholder reason classified once."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_rl.data.rows import PlaceholderReason
from nemo_rl.token_capture.capture_health import THRESHOLDS, CaptureHealthThresholds, Finding, health_findings
from tests.metrics_lines import healthy_line, with_placeholders


def test_every_placeholder_reason_has_exactly_one_class() -> None:
    classes = {reason.value: THRESHOLDS.reason_limit(reason.value)[0] for reason in PlaceholderReason}
    assert "unclassified" not in classes.values()
    assert classes["capture_poisoned"] == classes["verification_failed"] == "zero"
    assert classes["staged_record_missing"] == classes["data_plane_error"] == classes["finalize_timeout"] == "transport"
    assert classes["run_timeout"] == "environment"
    assert classes["group_below_min_valid_fraction"] == "derived"
    # Announced reasons are classified before they reach the enum.
    assert THRESHOLDS.reason_limit("declared_terminal_uncaptured") == ("zero", 0.0)
    assert THRESHOLDS.reason_limit("served_report_unavailable") == ("transport", 0.01)
    assert THRESHOLDS.reason_limit("never_heard_of") == ("unclassified", 0.0)


def test_a_reason_left_out_or_listed_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"PlaceholderReason values \['run_timeout'\] are in no class"):
        CaptureHealthThresholds(environment_reasons=frozenset({"run_failed", "reward_missing", "empty_generation",
                                                             "legacy_noncontiguous"}))
    with pytest.raises(ValidationError, match=r"placeholder reasons \['run_timeout'\] are in more than one class"):
        CaptureHealthThresholds(derived_reasons=frozenset({"group_below_min_valid_fraction", "run_timeout"}))
    with pytest.raises(ValidationError, match="max_transport_rate"):
        CaptureHealthThresholds(max_transport_rate=1.5)
    with pytest.raises(ValidationError, match="extra_forbidden"):
        CaptureHealthThresholds(min_token_in_rat=0.5)
    with pytest.raises(ValidationError, match="frozen"):
        THRESHOLDS.min_token_in_rate = 0.5  # type: ignore[misc]


def test_thresholds_are_taken_from_the_config_given() -> None:
    lines = [healthy_line(1), with_placeholders(healthy_line(2), run_timeout=1)]
    assert health_findings(lines, capture=True) == []
    strict = CaptureHealthThresholds(max_environment_rate=0.05)
    (finding,) = health_findings(lines, capture=True, thresholds=strict)
    assert (finding.metric, finding.threshold) == (
        "finalize/placeholders/run_timeout", "environment weather, tolerated <= 0.05 of dispatched")


def test_the_legacy_leg_is_not_judged_on_token_in() -> None:
    legacy = healthy_line(1, **{"finalize/token_in_rate": 0.0, "finalize/continuation_calls": 8.0,
                                "finalize/unresolved_continuations": 8.0})
    assert health_findings([legacy], capture=False) == []
    assert [f.metric for f in health_findings([legacy], capture=True)] == [
        "finalize/token_in_rate", "finalize/unresolved_continuations"]


def test_the_legacy_paths_retokenization_drift_is_weather_up_to_the_environment_rate() -> None:
    # The L1 legacy leg (2 steps x 16 rollouts) met one noncontiguous rollout: the legacy path's own
    # drift, what capture removes; tolerated like an environment failure, flagged above 10%.
    assert THRESHOLDS.reason_limit("legacy_noncontiguous") == ("environment", 0.10)
    one_in_32 = [healthy_line(1, **{"rollouts/dispatched": 16.0, "finalize/kept_rollouts": 16.0, "finalize/rows": 16.0}),
                 with_placeholders(healthy_line(2, **{"rollouts/dispatched": 16.0, "finalize/kept_rollouts": 16.0,
                                                      "finalize/rows": 16.0}), legacy_noncontiguous=1)]
    assert health_findings(one_in_32, capture=False) == []
    four_in_32 = [one_in_32[0], with_placeholders(one_in_32[1], legacy_noncontiguous=3)]
    assert [f.metric for f in health_findings(four_in_32, capture=False)] == [
        "finalize/placeholders/legacy_noncontiguous", "finalize/invalid_row_rate"]
    # A missing or malformed echo is a configuration defect: any one fails.
    assert THRESHOLDS.reason_limit("legacy_invalid_echo") == ("zero", 0.0)


def test_a_finding_needs_every_part() -> None:
    with pytest.raises(ValueError, match="Finding.look_at must be a non-empty str, got ''"):
        Finding("m", "1", "<= 0", "at step 1", "meaning", "")


def test_no_line_is_a_finding_not_health() -> None:
    assert [f.describe() for f in health_findings([], capture=True)] == [
        "metrics.jsonl=no step line (at least one step) in the run: a run without a finished step has nothing to "
        "judge; look at the run's driver log"]
