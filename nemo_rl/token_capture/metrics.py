"""Per-step finalize metrics over accounted GRPO groups (pure).

`finalize_metrics(groups, queue_waits_ms) -> dict[str, float]`. Every rate has a defined value
on an empty denominator (0.0), so a step's metric set never changes shape except for the
per-reason / per-method counts, which appear for every reason or method that occurred.

Definitions (dispatched = all entries of all groups = kept rollouts + placeholders):
- finalize/kept_rollouts, finalize/placeholders; finalize/rows: training rows (a kept rollout
  contributes one row per verified chain); finalize/rows_per_rollout = rows / kept rollouts;
  finalize/chains_per_rollout: mean number of chains (leaves) in the manifests of kept rollouts.
- finalize/placeholders/<reason>: placeholders with that `PlaceholderReason` value.
- finalize/token_in_calls, finalize/text_root_calls: chain calls of trained rows by capture mode
  (a call shared by several rows counts in each).
- Capture health, per served call (each call once, not per row), over every rollout (kept or
  placeholder) whose verdict carries a `CallLineage` (a served report and its manifest; see
  `judge.call_lineage`): finalize/continuation_calls = calls whose history held assistant turns
  (token-in calls + unresolved continuations); finalize/unresolved_continuations = those the
  gate admitted as a new text root because it found no captured parent (the harness re-rendered
  or edited what the model said); finalize/token_in_rate = token-in calls / continuation calls,
  0.0 when there is no continuation call (single-call rollouts, capture off: read
  finalize/continuation_calls first). A compaction or a sub-agent (no assistant turn in the new
  history) is a root, not a continuation. finalize/branches_per_rollout = text roots beyond the
  first in the manifests, per rollout with a lineage (0.0 when none).
- finalize/abandoned_retry_calls, finalize/abandoned_retry_tokens: retried replies the harness
  discarded (a sibling no later call continued, off the terminal chain), never in the loss;
  tokens from the served report.
- finalize/capture_poisoned_rollouts: placeholders with reason capture_poisoned.
- finalize/invalid_row_rate = placeholders / dispatched.
- finalize/terminal_selection/<method>: rollouts (kept or not) whose terminal was named by that
  method; finalize/heuristic_terminal_fraction is the heuristic share among them;
  finalize/terminal_witness_disagreements counts rollouts masked because witnesses disagreed.
- finalize/served_generated_tokens: generated tokens the workers report having served for the
  step's rollouts (their own counters); finalize/kept_generated_token_fraction = generated tokens
  in the loss / (served - abandoned retry tokens), over rollouts with a report (0.0 when the
  denominator is 0); finalize/unverifiable_generated_tokens/<reason>: served tokens not in the
  loss that could have been, by reason (abandoned retries are not among them).
- weight_version/min, weight_version/max: over every call of every trained row (measured from
  the rows, never from the step counter); -1.0 when no row carries a version (legacy).
- finalize/calls_per_rollout: mean chain length over trained rows.
- finalize/queue_wait_ms (mean) and finalize/queue_wait_ms_max over the given waits.
- reward/mean over ALL dispatched rollouts: a kept rollout counts its reward, a placeholder its
  environment reward when the run produced one and 0.0 otherwise.
- Router replay (R3), over every training row of the step (always emitted, 0.0 when no row has
  routes, e.g. a dense model), from the rows' `routed_experts` arrays: a token is covered iff
  none of its [L, K] entries is the sentinel -1 (a row with `routed_experts=None` covers
  nothing). router_replay/coverage = covered loss (mask 1.0) tokens / loss tokens;
  router_replay/sentinel_tokens = tokens of trained rows that are not covered (carry tokens
  without a route count too; placeholders contribute no row); router_replay/rows_with_routes =
  rows with at least one covered token. Same definitions as `router_replay.router_replay_metrics`
  over a batch built from the same rows (padding excluded). A `RowRef` carries the same figures
  (`RouteCoverage`), computed by the finalizer from the arrays it stored in the train partition.

`first_call_prompt_records(step, groups) -> list[dict]` (pure; the loop appends them to a file
when `logger.dump_first_call_prompt_ids`): one record per training row, `{"step", "group",
"rollout" (sample index), "chain" (the row's chain_index), "origin", "prompt_ids", "placeholder":
None}`, where `prompt_ids = token_ids[:prompt_len]`, the prompt of the first call of the row's
chain (capture rows: the verified staged ids; legacy rows: Gym's echoed `prompt_token_ids` of
the first call; a `RowRef` carries them only when its finalizer was told the option is on, else
this raises); and one record per placeholder with `chain`, `origin` and `prompt_ids` None and
`placeholder` its reason. A rollout on the default tool loop has exactly one row (chain 0).
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
