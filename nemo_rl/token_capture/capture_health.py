"""Capture-health judgement over a run's `metrics.jsonl` lines, with the thresholds in one place.

`THRESHOLDS` (a frozen, validated `CaptureHealthThresholds`) is the only copy of every health
threshold: the verdict and the L1 checks both judge through `health_findings`, so they cannot
disagree. `health_findings(lines, capture=...)` is pure; an empty list means healthy, and each
`Finding` names the metric, the value, the threshold and the steps.
Invariants: a run lacking a judged metric is UNJUDGED, never a pass and never a crash; a
placeholder reason no class knows fails as unclassified, so a new reason cannot pass silently;
the informational figures (branches, abandoned retries) are never findings.
What is judged, in order: docs/guides/token-capture.md, "What the health judgement checks".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_rl.data.rows import PlaceholderReason

PLACEHOLDER_REASON_PREFIX = "finalize/placeholders/"
UNVERIFIABLE_PREFIX = "finalize/unverifiable_generated_tokens/"
INFORMATIONAL_METRICS = (
    "finalize/branches_per_rollout",
    "finalize/abandoned_retry_calls",
    "finalize/abandoned_retry_tokens",
)
_BASE_METRICS = (
    "rollouts/dispatched",
    "finalize/placeholders",
    "finalize/invalid_row_rate",
    "finalize/served_generated_tokens",
    "finalize/kept_generated_token_fraction",
    "token_mult_prob_error",
)
_TOKEN_IN_METRICS = (
    "finalize/token_in_rate",
    "finalize/continuation_calls",
    "finalize/unresolved_continuations",
)


def judged_metrics(capture: bool) -> tuple[str, ...]:
    """The metrics every line must carry to be judged (the token-in ones on capture runs only)."""
    return _BASE_METRICS + (_TOKEN_IN_METRICS if capture else ())


class CaptureHealthThresholds(BaseModel):
    """Every capture-health threshold (`THRESHOLDS` is the one instance the judgement uses).

    Placeholder reasons fall in four classes, each with its bound (the `*_reasons` fields);
    every `PlaceholderReason` is in exactly one (validated), and names of reasons not yet in
    the enum may be listed ahead of it. Why each class and threshold sits where it does:
    docs/guides/token-capture.md, "Why each threshold sits where it does".
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    zero_reasons: frozenset[str] = Field(default=frozenset({
        "capture_poisoned", "verification_failed", "terminal_declared_unmatched", "declared_terminal_uncaptured",
        "terminal_witness_disagreement", "terminal_witness_unmatched", "terminal_selection_failed", "empty_manifest",
        "mixed_weight_version",
        "legacy_token_echo_missing", "legacy_invalid_echo",
    }), description="broken contracts: any count fails")
    transport_reasons: frozenset[str] = Field(default=frozenset({
        "staged_record_missing", "data_plane_error", "finalize_timeout", "finalizer_unavailable",
        "manifest_unavailable", "served_not_staged", "served_report_unavailable", "component_failed",
    }), description="our stack's data-plane and component weather: bounded by max_transport_rate")
    environment_reasons: frozenset[str] = Field(default=frozenset({
        "run_failed", "run_timeout", "reward_missing", "empty_generation", "legacy_noncontiguous",
    }), description="outcomes of the harness, environment or model: bounded by max_environment_rate")
    derived_reasons: frozenset[str] = Field(
        default=frozenset({"group_below_min_valid_fraction"}),
        description="masked because of other rollouts: bounded through max_invalid_row_rate only",
    )
    max_transport_rate: float = Field(
        default=0.01, ge=0.0, le=1.0, description="per transport reason, over the run's dispatched rollouts")
    max_environment_rate: float = Field(
        default=0.10, ge=0.0, le=1.0, description="per environment reason, over the run's dispatched rollouts")
    max_invalid_row_rate: float = Field(
        default=0.10, ge=0.0, le=1.0, description="all placeholders over the run's dispatched rollouts")
    min_kept_generated_token_fraction: float = Field(
        default=0.90, ge=0.0, le=1.0, description="generated tokens in the loss over tokens the workers served (run)")
    min_token_in_rate: float = Field(
        default=0.99, ge=0.0, le=1.0,
        description="continuation calls served from the parent's exact ids, per step that has any")
    max_unresolved_continuations: int = Field(
        default=0, ge=0,
        description="calls with assistant turns in their history that resolved to no captured parent, per step")
    max_token_mult_prob_error: float = Field(
        default=1.01, ge=1.0, description="trainer vs generation probability ratio of the trained tokens, per step")

    @model_validator(mode="after")
    def _every_reason_in_exactly_one_class(self) -> CaptureHealthThresholds:
        classes = {"zero_reasons": self.zero_reasons, "transport_reasons": self.transport_reasons,
                   "environment_reasons": self.environment_reasons, "derived_reasons": self.derived_reasons}
        seen: Counter[str] = Counter(reason for reasons in classes.values() for reason in reasons)
        repeated = sorted(reason for reason, count in seen.items() if count > 1)
        if repeated:
            raise ValueError(f"placeholder reasons {repeated} are in more than one class; put each in exactly one")
        unclassified = sorted(reason.value for reason in PlaceholderReason if reason.value not in seen)
        if unclassified:
            raise ValueError(f"PlaceholderReason values {unclassified} are in no class of CaptureHealthThresholds "
                             "(fix: add each to zero_reasons, transport_reasons, environment_reasons or "
                             "derived_reasons, with the reason why in the class docstring)")
        return self

    def reason_limit(self, reason: str) -> tuple[str, float | None]:
        """(class name, max rate of dispatched rollouts) for one reason; the rate is None when no
        per-reason bound applies (derived) and the class is "unclassified" for an unknown reason."""
        if reason in self.zero_reasons:
            return "zero", 0.0
        if reason in self.transport_reasons:
            return "transport", self.max_transport_rate
        if reason in self.environment_reasons:
            return "environment", self.max_environment_rate
        if reason in self.derived_reasons:
            return "derived", None
        return "unclassified", 0.0


THRESHOLDS = CaptureHealthThresholds()


@dataclass(frozen=True)
class Finding:
    """One violated health expectation: the metric, its value, the threshold, where and what to read."""

    metric: str
    value: str
    threshold: str
    where: str
    meaning: str
    look_at: str

    def __post_init__(self) -> None:
        for name in ("metric", "value", "threshold", "where", "meaning", "look_at"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Finding.{name} must be a non-empty str, got {getattr(self, name)!r}")

    def describe(self) -> str:
        return f"{self.metric}={self.value} ({self.threshold}) {self.where}: {self.meaning}; look at {self.look_at}"


def _steps(lines: Sequence[Mapping[str, Any]]) -> str:
    label = "step" if len(lines) == 1 else "steps"
    return f"{label} " + ",".join(str(line.get("step", "?")) for line in lines)


def _worst_of(worst: Mapping[str, Any], lines: Sequence[Mapping[str, Any]]) -> str:
    where = f"at step {worst.get('step', '?')}"
    return where if len(lines) == 1 else f"{where}, worst of {_steps(lines)}"


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _missing(lines: Sequence[Mapping[str, Any]], capture: bool) -> list[Finding]:
    findings = []
    for line in lines:
        absent = [key for key in judged_metrics(capture) if key not in line]
        if absent:
            findings.append(Finding(
                ", ".join(absent), "absent", "required to judge capture health", f"at step {line.get('step', '?')}",
                "this run's metrics do not carry the health signals, so its health cannot be judged",
                "the build that wrote the file (a current build logs them: nemo_rl/token_capture/metrics.py)",
            ))
    return findings


def _reason_counts(lines: Sequence[Mapping[str, Any]]) -> tuple[Counter[str], dict[str, list[Mapping[str, Any]]]]:
    counts: Counter[str] = Counter()
    where: dict[str, list[Mapping[str, Any]]] = {}
    for line in lines:
        for key, value in line.items():
            if key.startswith(PLACEHOLDER_REASON_PREFIX) and value:
                reason = key[len(PLACEHOLDER_REASON_PREFIX):]
                counts[reason] += int(value)
                where.setdefault(reason, []).append(line)
    return counts, where


def _placeholder_findings(lines: Sequence[Mapping[str, Any]], dispatched: float,
                          thresholds: CaptureHealthThresholds) -> list[Finding]:
    findings = []
    counts, where = _reason_counts(lines)
    for reason in sorted(counts):
        count = counts[reason]
        klass, limit = thresholds.reason_limit(reason)
        metric = f"{PLACEHOLDER_REASON_PREFIX}{reason}"
        rate = count / dispatched if dispatched else 1.0
        look = f"the placeholders' details (reason {reason!r}) in the driver log and {metric} per step"
        if klass == "unclassified":
            findings.append(Finding(
                metric, str(count), "unclassified reason: no tolerance", f"in {_steps(where[reason])}",
                "a placeholder reason the health thresholds do not know; it is never passed silently",
                "nemo_rl/token_capture/capture_health.py CaptureHealthThresholds: classify the reason",
            ))
        elif klass == "zero" and count > 0:
            findings.append(Finding(
                metric, str(count), "must be 0", f"in {_steps(where[reason])}",
                "a broken contract (capture, verification, terminal or harness), not weather", look,
            ))
        elif limit is not None and rate > limit:
            findings.append(Finding(
                metric, f"{count} of {int(dispatched)} rollouts ({_fmt(rate)})",
                f"{klass} weather, tolerated <= {_fmt(limit)} of dispatched", f"in {_steps(where[reason])}",
                f"more {klass} failures than weather explains", look,
            ))
    for line in lines:
        total = sum(v for k, v in line.items() if k.startswith(PLACEHOLDER_REASON_PREFIX))
        if total != line["finalize/placeholders"]:
            findings.append(Finding(
                "finalize/placeholders", _fmt(line["finalize/placeholders"]),
                f"must equal the sum of finalize/placeholders/<reason> ({_fmt(total)})",
                f"at step {line.get('step', '?')}", "some placeholders carry no reason, so they cannot be judged",
                "nemo_rl/token_capture/metrics.py finalize_metrics",
            ))
    return findings


def _kept_fraction_finding(lines: Sequence[Mapping[str, Any]], thresholds: CaptureHealthThresholds) -> list[Finding]:
    served = sum(line["finalize/served_generated_tokens"] for line in lines)
    if served <= 0:
        return []
    kept = sum(line["finalize/kept_generated_token_fraction"] * line["finalize/served_generated_tokens"] for line in lines)
    fraction = kept / served
    if fraction >= thresholds.min_kept_generated_token_fraction:
        return []
    lost: Counter[str] = Counter()
    for line in lines:
        for key, value in line.items():
            if key.startswith(UNVERIFIABLE_PREFIX):
                lost[key[len(UNVERIFIABLE_PREFIX):]] += int(value)
    by_reason = ", ".join(f"{reason}={tokens}" for reason, tokens in lost.most_common()) or "none logged"
    worst = min((line for line in lines if line["finalize/served_generated_tokens"] > 0),
                key=lambda line: line["finalize/kept_generated_token_fraction"])
    return [Finding(
        "finalize/kept_generated_token_fraction", f"{_fmt(fraction)} over the run ({int(round(kept))} of {int(served)} "
        "served tokens)", f">= {_fmt(thresholds.min_kept_generated_token_fraction)}",
        f"worst at step {worst.get('step', '?')} ({_fmt(worst['finalize/kept_generated_token_fraction'])})",
        "generated tokens were served but not trained",
        f"{UNVERIFIABLE_PREFIX}<reason> (this run: {by_reason})",
    )]


def _token_in_findings(lines: Sequence[Mapping[str, Any]], thresholds: CaptureHealthThresholds) -> list[Finding]:
    findings = []
    low = [line for line in lines if line["finalize/continuation_calls"] > 0
           and line["finalize/token_in_rate"] < thresholds.min_token_in_rate]
    if low:
        worst = min(low, key=lambda line: line["finalize/token_in_rate"])
        findings.append(Finding(
            "finalize/token_in_rate",
            f"{_fmt(worst['finalize/token_in_rate'])} ({int(worst['finalize/continuation_calls'])} continuation calls)",
            f">= {_fmt(thresholds.min_token_in_rate)} on steps with continuation calls", _worst_of(worst, low),
            "continuation calls were re-rendered from text instead of served from the parent's exact ids",
            "finalize/unresolved_continuations and the harness: does it edit what the model said before sending it back?",
        ))
    unresolved = [line for line in lines
                  if line["finalize/unresolved_continuations"] > thresholds.max_unresolved_continuations]
    if unresolved:
        total = int(sum(line["finalize/unresolved_continuations"] for line in unresolved))
        findings.append(Finding(
            "finalize/unresolved_continuations", f"{total} over the run",
            f"<= {thresholds.max_unresolved_continuations} per step", f"in {_steps(unresolved)}",
            "calls whose history held assistant turns resolved to no captured parent (a re-render)",
            "the gate's lineage decisions for those calls; the harness's history handling",
        ))
    return findings


def _prob_error_finding(lines: Sequence[Mapping[str, Any]], thresholds: CaptureHealthThresholds) -> list[Finding]:
    high = [line for line in lines if line["token_mult_prob_error"] > thresholds.max_token_mult_prob_error]
    if not high:
        return []
    worst = max(high, key=lambda line: line["token_mult_prob_error"])
    return [Finding(
        "token_mult_prob_error", f"{worst['token_mult_prob_error']:.4f}",
        f"<= {thresholds.max_token_mult_prob_error}", _worst_of(worst, high),
        "trainer logprobs differ from the generation logprobs", "gen_kl_error and the rows' tokens vs the engine's",
    )]


def health_findings(
    lines: Sequence[Mapping[str, Any]], *, capture: bool, thresholds: CaptureHealthThresholds = THRESHOLDS
) -> list[Finding]:
    """Every violated health expectation of one run (see the module docstring for the rules)."""
    if not lines:
        return [Finding("metrics.jsonl", "no step line", "at least one step", "in the run",
                        "a run without a finished step has nothing to judge", "the run's driver log")]
    missing = _missing(lines, capture)
    if missing:
        return missing
    dispatched = sum(line["rollouts/dispatched"] for line in lines)
    placeholders = sum(line["finalize/placeholders"] for line in lines)
    findings = _placeholder_findings(lines, dispatched, thresholds)
    rate = placeholders / dispatched if dispatched else 0.0
    if rate > thresholds.max_invalid_row_rate:
        worst = max(lines, key=lambda line: line["finalize/invalid_row_rate"])
        findings.append(Finding(
            "finalize/invalid_row_rate", f"{_fmt(rate)} over the run ({int(placeholders)} of {int(dispatched)})",
            f"<= {_fmt(thresholds.max_invalid_row_rate)}",
            f"worst at step {worst.get('step', '?')} ({_fmt(worst['finalize/invalid_row_rate'])})",
            "too many rollouts became placeholders to train on a representative batch",
            "finalize/placeholders/<reason> for which reasons dominate",
        ))
    findings += _kept_fraction_finding(lines, thresholds)
    if capture:
        findings += _token_in_findings(lines, thresholds)
    findings += _prob_error_finding(lines, thresholds)
    return findings


def informational_summary(lines: Sequence[Mapping[str, Any]]) -> str:
    """The informational figures (never judged), or which of them the run did not log."""
    logged = [key for key in INFORMATIONAL_METRICS if all(key in line for line in lines)]
    parts = []
    if "finalize/branches_per_rollout" in logged:
        parts.append(f"branches_per_rollout max {_fmt(max(line['finalize/branches_per_rollout'] for line in lines))}")
    retry_keys = ("finalize/abandoned_retry_calls", "finalize/abandoned_retry_tokens")
    if all(key in logged for key in retry_keys):
        calls = int(sum(line["finalize/abandoned_retry_calls"] for line in lines))
        tokens = int(sum(line["finalize/abandoned_retry_tokens"] for line in lines))
        parts.append(f"{calls} abandoned retries masked ({tokens} tokens)")
    absent = [key.removeprefix("finalize/") for key in INFORMATIONAL_METRICS if key not in logged]
    if absent:
        parts.append(f"not logged: {', '.join(absent)}")
    return "; ".join(parts)
