"""A verdict on a run's `metrics.jsonl`: is token capture engaged, healthy, and if not, why.

`capture_verdict(lines)` is pure and returns a `Verdict`: `ENGAGED`, `DEGRADED` (a health signal
out of bounds), `UNJUDGED` (a signal the judgement needs is missing: never a pass) or
`NOT_ENGAGED`, with findings naming the metric, the value and the threshold. The thresholds live
only in `capture_health.THRESHOLDS` (shared with the L1 checks). `read_metrics` refuses an
unparsable line (`VerdictError` naming file and line). CLI: `python -m
nemo_rl.token_capture.verdict LOG_DIR`; exit 0 for ENGAGED, 1 otherwise, 2 when unreadable.
The rules, first match wins: docs/guides/token-capture.md, "How the verdict decides".
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nemo_rl.data.errors import FatalError
from nemo_rl.token_capture.capture_health import (
    PLACEHOLDER_REASON_PREFIX,
    Finding,
    health_findings,
    informational_summary,
    judged_metrics,
)
from nemo_rl.utils.logger import METRICS_FILE, read_jsonl_objects

ENGAGED = "ENGAGED"
DEGRADED = "DEGRADED"
UNJUDGED = "UNJUDGED"
NOT_ENGAGED = "NOT_ENGAGED"
# What makes a line a GRPO capture loop's (rule 2); the health metrics are rule 5's.
REQUIRED_KEYS = (
    "step",
    "rollouts/dispatched",
    "finalize/rows",
    "finalize/placeholders",
    "finalize/text_root_calls",
    "finalize/token_in_calls",
)


class VerdictError(FatalError, ValueError):
    """metrics.jsonl exists but cannot be read as one JSON object per line."""


@dataclass(frozen=True)
class Verdict:
    status: str
    reason: str
    findings: tuple[Finding, ...] = ()

    @property
    def engaged(self) -> bool:
        return self.status == ENGAGED

    def line(self) -> str:
        return f"capture {self.status.replace('_', ' ')}: {self.reason}"

    def report(self) -> str:
        """The headline (which carries the first finding), then one line per further finding."""
        return "\n".join([self.line()] + [f"  - {finding.describe()}" for finding in self.findings[1:]])


def read_metrics(log_dir: str | Path) -> list[dict]:
    path = Path(log_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return read_jsonl_objects(path, VerdictError)


def _placeholder_reasons(lines: Sequence[Mapping]) -> str:
    reasons: Counter[str] = Counter()
    for line in lines:
        for key, value in line.items():
            if key.startswith(PLACEHOLDER_REASON_PREFIX) and value:
                reasons[key[len(PLACEHOLDER_REASON_PREFIX):]] += int(value)
    return ", ".join(f"{reason}={count}" for reason, count in reasons.most_common()) or "none recorded"


def capture_verdict(lines: Sequence[Mapping], source: str = METRICS_FILE) -> Verdict:
    """The verdict over one run's step lines; `source` names the file in the no-step message."""
    if not lines:
        return Verdict(NOT_ENGAGED, f"no step finished: {source} is missing or empty (read the run's log)")
    for line in lines:
        missing = [key for key in REQUIRED_KEYS if key not in line]
        if missing:
            return Verdict(
                NOT_ENGAGED,
                f"step {line.get('step', '?')} lacks {missing}: not the metrics of the GRPO capture loop",
            )
    steps = len(lines)
    dispatched = int(sum(line["rollouts/dispatched"] for line in lines))
    rows = int(sum(line["finalize/rows"] for line in lines))
    placeholders = int(sum(line["finalize/placeholders"] for line in lines))
    if rows == 0:
        return Verdict(
            NOT_ENGAGED,
            f"no row was trained in {steps} step(s): all {dispatched} rollouts became placeholders "
            f"({_placeholder_reasons(lines)})",
        )
    if all(line["finalize/text_root_calls"] == 0 and line["finalize/token_in_calls"] == 0 for line in lines):
        return Verdict(
            NOT_ENGAGED,
            f"{rows} rows trained but no call was served through capture (text_root_calls=0, "
            "token_in_calls=0 on every step): the legacy path ran; set token_capture.enabled=true",
        )
    absent = sorted({key for line in lines for key in judged_metrics(capture=True) if key not in line})
    if absent:
        steps_lacking = [line["step"] for line in lines if any(key not in line for key in absent)]
        return Verdict(
            UNJUDGED,
            f"steps {steps_lacking} lack {absent}: capture ran, but its health cannot be judged without them "
            "(a build that predates them wrote this file; re-run with a current build)",
        )
    findings = tuple(health_findings(lines, capture=True))
    if findings:
        more = f" (+{len(findings) - 1} more below)" if len(findings) > 1 else ""
        return Verdict(DEGRADED, f"{findings[0].describe()}{more}", findings)
    worst = max(line["token_mult_prob_error"] for line in lines)
    summary = (
        f"{steps} step(s), {rows} rows from {dispatched} rollouts, {placeholders} placeholders"
        + (f" ({_placeholder_reasons(lines)})" if placeholders else "")
        + f", token_mult_prob_error max {worst:.4f}"
    )
    served = sum(line["finalize/served_generated_tokens"] for line in lines)
    if served > 0:
        kept = sum(line["finalize/kept_generated_token_fraction"] * line["finalize/served_generated_tokens"]
                   for line in lines)
        summary += f", kept generated-token fraction {kept / served:.3f}"
    continuation_lines = [line for line in lines if line["finalize/continuation_calls"] > 0]
    if not continuation_lines:
        summary += "; token-in not exercised (no continuation call: single-turn rollouts)"
    else:
        min_rate = min(line["finalize/token_in_rate"] for line in continuation_lines)
        calls = int(sum(line["finalize/continuation_calls"] for line in continuation_lines))
        summary += f", token_in_rate min {min_rate:.3f} over {calls} continuation calls, 0 unresolved"
    extra = informational_summary(lines)
    return Verdict(ENGAGED, f"{summary}; {extra}" if extra else summary)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_rl.token_capture.verdict", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", help=f"the run's logger.log_dir (holds {METRICS_FILE})")
    args = parser.parse_args(argv)
    try:
        lines = read_metrics(args.log_dir)
    except (VerdictError, OSError) as e:
        print(f"verdict error: {e}", file=sys.stderr)
        return 2
    verdict = capture_verdict(lines, source=str(Path(args.log_dir) / METRICS_FILE))
    print(verdict.report(), flush=True)
    return 0 if verdict.engaged else 1


if __name__ == "__main__":
    sys.exit(main())
