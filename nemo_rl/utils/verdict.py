"""A one-line verdict on a run's `metrics.jsonl`: is token capture engaged, exact, and if not, why.

Contract:
- `capture_verdict(lines)` is pure over the parsed step lines (one dict per step, as
  `MetricsLogger` writes them) and returns a `Verdict` whose `status` is one of:
  `ENGAGED` (rows were trained from captured tokens and nothing says they are inexact),
  `DEGRADED` (capture ran, but something the guide's "Confirm capture is engaged" table flags
  happened), `NOT_ENGAGED` (no captured row was trained). `Verdict.line()` is the one line.
- The rules, first match wins:
  1. no step line -> NOT_ENGAGED (the run finished no step);
  2. a line lacks one of `REQUIRED_KEYS` -> NOT_ENGAGED (not a GRPO capture loop's metrics);
  3. no trained row over all steps -> NOT_ENGAGED, naming the placeholder reasons;
  4. no call served through capture (`text_root_calls` and `token_in_calls` are 0 on every step)
     -> NOT_ENGAGED: the legacy path ran (`token_capture.enabled=false`);
  5. a poisoned rollout on any step -> DEGRADED;
  6. a step with continuation calls whose `token_in_rate` is below `TOKEN_IN_RATE_MIN` (some
     continuation was re-rendered from text) -> DEGRADED; a step has continuation calls when
     `token_in_calls > 0` or it has more text roots than rows;
  7. `token_mult_prob_error` above `PROB_ERROR_MAX` on any step -> DEGRADED;
  8. otherwise ENGAGED; when no step had a continuation call the line says token-in was not
     exercised (single-turn rollouts), since `token_in_rate` is 0.0 by definition then.
- `read_metrics(log_dir)` parses `<log_dir>/metrics.jsonl`; a missing file is an empty list
  (rule 1 names it), an unparsable line is a `VerdictError` naming the file and line number.
- CLI: `python -m nemo_rl.utils.verdict LOG_DIR` prints the line; exit 0 for ENGAGED, 1 for
  DEGRADED or NOT_ENGAGED, 2 when the file cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nemo_rl.utils.logger import METRICS_FILE, read_jsonl_objects

ENGAGED = "ENGAGED"
DEGRADED = "DEGRADED"
NOT_ENGAGED = "NOT_ENGAGED"
# Thresholds of docs/guides/token-capture.md ("Confirm capture is engaged").
TOKEN_IN_RATE_MIN = 0.99
PROB_ERROR_MAX = 1.01
REQUIRED_KEYS = (
    "step",
    "rollouts/dispatched",
    "finalize/rows",
    "finalize/placeholders",
    "finalize/text_root_calls",
    "finalize/token_in_calls",
    "finalize/token_in_rate",
    "finalize/capture_poisoned_rollouts",
    "token_mult_prob_error",
)
_PLACEHOLDER_REASON_PREFIX = "finalize/placeholders/"


class VerdictError(ValueError):
    """metrics.jsonl exists but cannot be read as one JSON object per line."""


@dataclass(frozen=True)
class Verdict:
    status: str
    reason: str

    @property
    def engaged(self) -> bool:
        return self.status == ENGAGED

    def line(self) -> str:
        return f"capture {self.status.replace('_', ' ')}: {self.reason}"


def read_metrics(log_dir: str | Path) -> list[dict]:
    path = Path(log_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return read_jsonl_objects(path, VerdictError)


def _placeholder_reasons(lines: Sequence[Mapping]) -> str:
    reasons: Counter[str] = Counter()
    for line in lines:
        for key, value in line.items():
            if key.startswith(_PLACEHOLDER_REASON_PREFIX):
                reasons[key[len(_PLACEHOLDER_REASON_PREFIX):]] += int(value)
    return ", ".join(f"{reason}={count}" for reason, count in reasons.most_common()) or "none recorded"


def _has_continuations(line: Mapping) -> bool:
    return line["finalize/token_in_calls"] > 0 or line["finalize/text_root_calls"] > line["finalize/rows"]


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
    poisoned = int(sum(line["finalize/capture_poisoned_rollouts"] for line in lines))
    if poisoned:
        return Verdict(
            DEGRADED,
            f"{poisoned} of {dispatched} rollouts were poisoned (placeholders: {_placeholder_reasons(lines)})",
        )
    for line in lines:
        rate = line["finalize/token_in_rate"]
        if _has_continuations(line) and rate < TOKEN_IN_RATE_MIN:
            return Verdict(
                DEGRADED,
                f"step {line['step']}: token_in_rate={rate:.3f} < {TOKEN_IN_RATE_MIN}: some continuation "
                "calls were re-rendered from text instead of served from the parent's exact ids",
            )
    worst = max(lines, key=lambda line: line["token_mult_prob_error"])
    if worst["token_mult_prob_error"] > PROB_ERROR_MAX:
        return Verdict(
            DEGRADED,
            f"step {worst['step']}: token_mult_prob_error={worst['token_mult_prob_error']:.4f} > "
            f"{PROB_ERROR_MAX}: trainer logprobs differ from the generation logprobs",
        )
    summary = (
        f"{steps} step(s), {rows} rows from {dispatched} rollouts, {placeholders} placeholders, 0 poisoned, "
        f"token_mult_prob_error max {worst['token_mult_prob_error']:.4f}"
    )
    continuation_lines = [line for line in lines if _has_continuations(line)]
    if not continuation_lines:
        return Verdict(ENGAGED, f"{summary}; token-in not exercised (no continuation call: single-turn rollouts)")
    min_rate = min(line["finalize/token_in_rate"] for line in continuation_lines)
    return Verdict(ENGAGED, f"{summary}, token_in_rate min {min_rate:.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_rl.utils.verdict", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", help=f"the run's logger.log_dir (holds {METRICS_FILE})")
    args = parser.parse_args(argv)
    try:
        lines = read_metrics(args.log_dir)
    except (VerdictError, OSError) as e:
        print(f"verdict error: {e}", file=sys.stderr)
        return 2
    verdict = capture_verdict(lines, source=str(Path(args.log_dir) / METRICS_FILE))
    print(verdict.line(), flush=True)
    return 0 if verdict.engaged else 1


if __name__ == "__main__":
    sys.exit(main())
