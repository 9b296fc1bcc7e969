"""Per-step finalize metrics over accounted GRPO groups (pure).

`finalize_metrics(groups, queue_waits_ms) -> dict[str, float]`. Every rate has a defined value
on an empty denominator (0.0), so a step's metric set never changes shape except for the
per-reason counts, which appear for every reason that occurred.

Definitions (dispatched = all entries of all groups = rows + placeholders):
- finalize/placeholders/<reason>: placeholders with that `PlaceholderReason` value.
- finalize/token_in_calls, finalize/text_root_calls: terminal-chain calls of trained rows by
  capture mode. finalize/token_in_rate: among continuation calls (every call after a row's
  first), the share served from exact parent ids: token_in / (token_in + text_root - rows with
  a root). 1.0 means no continuation was re-rendered from text; 0.0 when no row has a
  continuation. Legacy rows add neither count.
- finalize/capture_poisoned_rollouts: placeholders with reason capture_poisoned.
- finalize/invalid_row_rate = placeholders / dispatched.
- finalize/heuristic_terminal_fraction: among entries whose receipt named a terminal method
  (rows and placeholders alike), the fraction chosen by the heuristic parent-link walk.
- finalize/calls_per_rollout: mean terminal-chain length over trained rows.
- finalize/queue_wait_ms (mean) and finalize/queue_wait_ms_max over the given waits.
- reward/mean over ALL dispatched rollouts: a row counts its reward, a placeholder its
  environment reward when the run produced one and 0.0 otherwise, so a step whose rollouts
  fail cannot report a better mean than one whose rollouts succeed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from nemo_rl.token_capture.rows import GroupResult, Placeholder, PlaceholderReason, TrainRow


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def finalize_metrics(groups: Sequence[GroupResult], queue_waits_ms: Sequence[float]) -> dict[str, float]:
    entries = [entry for group in groups for entry in group.entries]
    rows = [entry for entry in entries if isinstance(entry, TrainRow)]
    placeholders = [entry for entry in entries if isinstance(entry, Placeholder)]
    reasons = Counter(placeholder.reason for placeholder in placeholders)
    token_in = sum(row.token_in_calls for row in rows)
    text_root = sum(row.text_root_calls for row in rows)
    selected = [entry.terminal_selection for entry in entries if entry.terminal_selection is not None]
    rewards = [row.reward for row in rows] + [p.reward if p.reward is not None else 0.0 for p in placeholders]

    metrics: dict[str, float] = {
        "rollouts/dispatched": float(len(entries)),
        "finalize/rows": float(len(rows)),
        "finalize/placeholders": float(len(placeholders)),
        "finalize/token_in_calls": float(token_in),
        "finalize/text_root_calls": float(text_root),
        "finalize/token_in_rate": _ratio(token_in, token_in + text_root - sum(row.text_root_calls > 0 for row in rows)),
        "finalize/capture_poisoned_rollouts": float(reasons[PlaceholderReason.CAPTURE_POISONED]),
        "finalize/invalid_row_rate": _ratio(len(placeholders), len(entries)),
        "finalize/heuristic_terminal_fraction": _ratio(sum(s == "heuristic" for s in selected), len(selected)),
        "finalize/calls_per_rollout": _ratio(sum(len(row.model_call_ids) for row in rows), len(rows)),
        "finalize/queue_wait_ms": _ratio(sum(queue_waits_ms), len(queue_waits_ms)),
        "finalize/queue_wait_ms_max": max(queue_waits_ms, default=0.0),
        "reward/mean": _ratio(sum(rewards), len(rewards)),
    }
    for reason, count in sorted(reasons.items(), key=lambda item: item[0].value):
        metrics[f"finalize/placeholders/{reason.value}"] = float(count)
    return metrics
