"""Per-step finalize metrics over accounted GRPO groups (pure).

`finalize_metrics(groups, queue_waits_ms)` returns one flat `dict[str, float]` per step;
`first_call_prompt_records(step, groups)` returns the records the loop appends when
`logger.dump_first_call_prompt_ids` is on.

Invariants: every rate is 0.0 on an empty denominator, so a step's metric set never changes
shape except for the per-reason / per-method counts; dispatched = kept rollouts + placeholders;
capture-health figures count each served call once, not once per row; `weight_version/*` is
measured from the rows, never from the step counter.
Every metric's definition: docs/guides/token-capture.md, "Every finalize metric".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from nemo_rl.data.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason, RowRef, TrainRow


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def _yield_metrics(entries: Sequence[KeptRollout | Placeholder]) -> dict[str, float]:
    served = kept = abandoned = 0
    lost: Counter[str] = Counter()
    for entry in entries:
        report = entry.yield_
        if report is None or report.served_generated_tokens is None:
            continue
        served += report.served_generated_tokens
        kept += report.kept_generated_tokens
        abandoned += report.abandoned_retry_tokens
        for reason, tokens in report.unverifiable:
            lost[reason] += tokens
    metrics = {
        "finalize/served_generated_tokens": float(served),
        "finalize/kept_generated_token_fraction": _ratio(kept, served - abandoned),
        "finalize/abandoned_retry_tokens": float(abandoned),
        "finalize/abandoned_retry_calls": float(sum(e.yield_.abandoned_retry_calls for e in entries if e.yield_ is not None)),
    }
    for reason, tokens in sorted(lost.items()):
        metrics[f"finalize/unverifiable_generated_tokens/{reason}"] = float(tokens)
    return metrics


def _lineage_metrics(entries: Sequence[KeptRollout | Placeholder]) -> dict[str, float]:
    lineages = [entry.yield_.lineage for entry in entries if entry.yield_ is not None and entry.yield_.lineage]
    token_in = sum(lineage.token_in_calls for lineage in lineages)
    continuations = sum(lineage.continuation_calls for lineage in lineages)
    return {
        "finalize/continuation_calls": float(continuations),
        "finalize/unresolved_continuations": float(sum(lineage.unresolved_continuations for lineage in lineages)),
        "finalize/token_in_rate": _ratio(token_in, continuations),
        "finalize/branches_per_rollout": _ratio(sum(lineage.branches for lineage in lineages), len(lineages)),
    }


def _router_replay_metrics(rows: Sequence[TrainRow | RowRef]) -> dict[str, float]:
    coverage = [row.route_coverage for row in rows]
    loss_tokens = sum(c.loss_tokens for c in coverage)
    return {
        "router_replay/coverage": _ratio(sum(c.covered_loss_tokens for c in coverage), loss_tokens),
        "router_replay/sentinel_tokens": float(sum(c.sentinel_tokens for c in coverage)),
        "router_replay/rows_with_routes": float(sum(c.has_routes for c in coverage)),
    }


def first_call_prompt_records(step: int, groups: Sequence[GroupResult]) -> list[dict]:
    records: list[dict] = []
    for group in groups:
        for entry in group.entries:
            where = {"step": step, "group": entry.group_index, "rollout": entry.sample_index}
            if isinstance(entry, Placeholder):
                records.append({**where, "chain": None, "origin": None, "prompt_ids": None,
                                "placeholder": entry.reason.value})
                continue
            for row in entry.rows:
                if row.prompt_ids is None:
                    raise ValueError(f"rollout {row.rollout_id} row {row.chain_index} carries no prompt ids: its "
                                     "finalizer was not told logger.dump_first_call_prompt_ids=true")
                records.append({**where, "chain": row.chain_index, "origin": row.origin.value,
                                "prompt_ids": list(row.prompt_ids), "placeholder": None})
    return records


def heuristic_picks(entries: Sequence[KeptRollout | Placeholder]) -> int:
    """Rollouts whose terminal Gym's parent-link walk picked (no declaration or witness named it)."""
    return sum(1 for entry in entries if entry.terminal_selection == "heuristic"
               and not (isinstance(entry, Placeholder) and entry.reason is PlaceholderReason.TERMINAL_SELECTION_FAILED))


def finalize_metrics(groups: Sequence[GroupResult], queue_waits_ms: Sequence[float]) -> dict[str, float]:
    entries = [entry for group in groups for entry in group.entries]
    kept = [entry for entry in entries if isinstance(entry, KeptRollout)]
    rows = [row for rollout in kept for row in rollout.rows]
    placeholders = [entry for entry in entries if isinstance(entry, Placeholder)]
    reasons = Counter(placeholder.reason for placeholder in placeholders)
    token_in = sum(row.token_in_calls for row in rows)
    text_root = sum(row.text_root_calls for row in rows)
    selected = Counter(entry.terminal_selection for entry in entries if entry.terminal_selection is not None)
    rewards = [rollout.reward for rollout in kept] + [p.reward if p.reward is not None else 0.0 for p in placeholders]
    versions = [v for row in rows for v in row.weight_versions if v is not None]
    disagreements = sum(1 for p in placeholders if p.reason is PlaceholderReason.TERMINAL_WITNESS_DISAGREEMENT)

    metrics: dict[str, float] = {
        "rollouts/dispatched": float(len(entries)),
        "finalize/kept_rollouts": float(len(kept)),
        "finalize/rows": float(len(rows)),
        "finalize/placeholders": float(len(placeholders)),
        "finalize/rows_per_rollout": _ratio(len(rows), len(kept)),
        "finalize/chains_per_rollout": _ratio(sum(k.yield_.chains for k in kept if k.yield_), len(kept)),
        "finalize/token_in_calls": float(token_in),
        "finalize/text_root_calls": float(text_root),
        "finalize/capture_poisoned_rollouts": float(reasons[PlaceholderReason.CAPTURE_POISONED]),
        "finalize/invalid_row_rate": _ratio(len(placeholders), len(entries)),
        "finalize/heuristic_terminal_fraction": _ratio(selected["heuristic"], sum(selected.values())),
        "finalize/heuristic_terminal_picks": float(heuristic_picks(entries)),
        "finalize/terminal_witness_disagreements": float(disagreements),
        "finalize/calls_per_rollout": _ratio(sum(len(row.model_call_ids) for row in rows), len(rows)),
        "finalize/queue_wait_ms": _ratio(sum(queue_waits_ms), len(queue_waits_ms)),
        "finalize/queue_wait_ms_max": max(queue_waits_ms, default=0.0),
        "weight_version/min": float(min(versions)) if versions else -1.0,
        "weight_version/max": float(max(versions)) if versions else -1.0,
        "reward/mean": _ratio(sum(rewards), len(rewards)),
    }
    metrics.update(_yield_metrics(entries))
    metrics.update(_lineage_metrics(entries))
    metrics.update(_router_replay_metrics(rows))
    for method, count in sorted(selected.items()):
        metrics[f"finalize/terminal_selection/{method}"] = float(count)
    for reason, count in sorted(reasons.items(), key=lambda item: item[0].value):
        metrics[f"finalize/placeholders/{reason.value}"] = float(count)
    return metrics
