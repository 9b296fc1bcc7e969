"""A step whose every rollout failed in the harness stops the run, named (never a quiet exit 0).

`harness_failure_counts(groups)` (pure): the count per placeholder reason when every dispatched
rollout of the step is a harness failure (`run_failed`: the agent's /run answered an error;
`run_timeout`: it never answered; `empty_manifest`: it answered but made no captured model call,
e.g. an agent that drops the rollout prefix), else None. `check_harness_failures` raises
`AllRolloutsFailedError` (fatal) naming the step, the reasons with counts and a few distinct
details. Why per step and only these: such a step yielded no captured model output at all, so
the cause is the harness or its wiring, which repeats every step; steps masked for other
reasons keep their bounded streak (`token_capture.max_consecutive_masked_steps`). The always-N
accounting is untouched: the groups and the metrics line are complete before the raise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from nemo_rl.algorithms.errors import GRPOError
from nemo_rl.data.rows import GroupResult, PlaceholderReason

HARNESS_FAILURES = frozenset(
    {PlaceholderReason.RUN_FAILED, PlaceholderReason.RUN_TIMEOUT, PlaceholderReason.EMPTY_MANIFEST}
)
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
            "under the log dir; an agent whose requests the gate refuses, whose packages are missing, or "
            "whose model calls do not carry the rollout prefix (empty_manifest) fails every rollout the same way",
            kind="all_rollouts_failed",
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
