"""A step whose every rollout failed in the harness stops the run, named (never a quiet exit 0).

`harness_failure_counts(groups)` (pure) answers, for one step's groups, the count per placeholder
reason when every dispatched rollout is a harness failure (`run_failed`: the agent's /run answered
an error; `run_timeout`: it never answered), else None. `check_harness_failures` raises
`AllRolloutsFailedError` (fatal) naming the step, the reasons with their counts and a few
distinct details (the agent's own error text). Why per step and only these reasons: such a step
produced no model output at all, so the cause is the harness or its wiring (a request schema,
a missing package), which repeats on every step; masked steps for other reasons keep their
bounded streak (`token_capture.max_consecutive_masked_steps`). The always-N accounting is not
touched: the step's groups and metrics line are complete before the error is raised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from nemo_rl.algorithms.errors import GRPOError
from nemo_rl.data.rows import GroupResult, PlaceholderReason

HARNESS_FAILURES = frozenset({PlaceholderReason.RUN_FAILED, PlaceholderReason.RUN_TIMEOUT})
MAX_DETAILS = 3
DETAIL_CHARS = 300


class AllRolloutsFailedError(GRPOError):
    """Every rollout of a step failed in the agent harness (see the module docstring)."""

    def __init__(self, step: int, counts: Mapping[str, int], details: Sequence[str]) -> None:
        self.step = step
        self.counts = dict(counts)
        self.details = list(details)
        named = ", ".join(f"{reason}={count}" for reason, count in sorted(self.counts.items()))
        shown = "".join(f"\n  - {d}" for d in self.details)
        super().__init__(
            f"step {step}: every rollout failed in the agent harness ({named}); no model output reached "
            f"the trainer, so the run stops. First distinct errors:{shown}\nFix: read the agent's log "
            "under the log dir; an agent whose requests Gym's model server refuses, or whose packages "
            "are missing, fails every rollout the same way"
        )


def harness_failure_counts(groups: Sequence[GroupResult]) -> dict[str, int] | None:
    """Reason -> count when every dispatched rollout is a harness-failure placeholder; else None (pure)."""
    if not groups or any(group.kept for group in groups):
        return None
    placeholders = [p for group in groups for p in group.placeholders]
    if len(placeholders) != sum(group.n for group in groups):
        return None
    if not placeholders or any(p.reason not in HARNESS_FAILURES for p in placeholders):
        return None
    return dict(Counter(p.reason.value for p in placeholders))


def distinct_details(groups: Sequence[GroupResult], limit: int = MAX_DETAILS) -> list[str]:
    """The first `limit` distinct placeholder details, each cut to `DETAIL_CHARS` (pure)."""
    seen: list[str] = []
    for group in groups:
        for p in group.placeholders:
            detail = p.detail if len(p.detail) <= DETAIL_CHARS else p.detail[:DETAIL_CHARS] + "...<cut>"
            text = f"{p.reason.value}: {detail}"
            if text not in seen:
                seen.append(text)
            if len(seen) >= limit:
                return seen
    return seen


def check_harness_failures(groups: Sequence[GroupResult], step: int) -> None:
    """Raise `AllRolloutsFailedError` when `harness_failure_counts` names the step's groups."""
    counts = harness_failure_counts(groups)
    if counts is not None:
        raise AllRolloutsFailedError(step, counts, distinct_details(groups))
