"""Metrics lines shaped like a real capture run's, and a metrics file written by the real logger.

`healthy_line(step)` is one step line of a healthy 8-rollout capture step (the key set and
values of a real tiny-recipe step on this machine, plus the token-in health metrics);
`with_placeholders(line, **reasons)` turns kept rollouts into placeholders with those reasons,
keeping the line's own invariants (dispatched == kept + placeholders, the invalid-row rate);
`write_metrics(log_dir, lines)` writes them through `MetricsLogger`, as the GRPO loop does.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rl.utils.logger import LoggerConfig, MetricsLogger

_HEALTHY = {
    "component/deaths": 0.0, "component/down": 0.0, "component/restarts": 0.0,
    "finalize/abandoned_retry_calls": 0.0, "finalize/abandoned_retry_tokens": 0.0,
    "finalize/branches_per_rollout": 1.0, "finalize/calls_per_rollout": 2.0,
    "finalize/capture_poisoned_rollouts": 0.0, "finalize/chains_per_rollout": 1.0,
    "finalize/continuation_calls": 8.0, "finalize/dropped_groups": 0.0,
    "finalize/heuristic_terminal_fraction": 0.0, "finalize/heuristic_terminal_picks": 0.0,
    "finalize/invalid_row_rate": 0.0,
    "finalize/kept_generated_token_fraction": 1.0, "finalize/kept_rollouts": 8.0,
    "finalize/orphaned_staged_keys": 0.0, "finalize/placeholders": 0.0, "finalize/rows": 8.0,
    "finalize/rows_per_rollout": 1.0, "finalize/served_generated_tokens": 240.0,
    "finalize/served_report_failures": 0.0, "finalize/terminal_selection/response_id": 8.0,
    "finalize/terminal_witness_disagreements": 0.0, "finalize/text_root_calls": 8.0,
    "finalize/token_in_calls": 8.0, "finalize/token_in_rate": 1.0, "finalize/unresolved_continuations": 0.0,
    "gen_kl_error": 2.1e-11, "refit/engine_logprob_change": 0.75, "refit/engine_trainer_max_abs_diff": 1.4e-05,
    "reward/mean": 0.6, "rollouts/dispatched": 8.0, "token_mult_prob_error": 1.0000053,
    "train/loss": 3.5e-09, "train/num_samples": 8.0,
}


def healthy_line(step: int, **changes: float | None) -> dict[str, Any]:
    """A healthy capture step line; a change to None removes that key."""
    line: dict[str, Any] = {"step": step, **_HEALTHY,
                            "weight_version/min": float(step - 1), "weight_version/max": float(step - 1)}
    line.update(changes)
    return {key: value for key, value in line.items() if value is not None}


def with_placeholders(line: Mapping[str, Any], **reasons: int) -> dict[str, Any]:
    """`line` with that many of its kept rollouts turned into placeholders of each reason."""
    out = dict(line)
    count = sum(reasons.values())
    out["finalize/placeholders"] = out["finalize/placeholders"] + count
    out["finalize/kept_rollouts"] = out["finalize/kept_rollouts"] - count
    out["finalize/rows"] = out["finalize/rows"] - count
    out["finalize/invalid_row_rate"] = out["finalize/placeholders"] / out["rollouts/dispatched"]
    for reason, n in reasons.items():
        key = f"finalize/placeholders/{reason}"
        out[key] = out.get(key, 0.0) + float(n)
    return out


def write_metrics(log_dir: Path, lines: Sequence[Mapping[str, Any]]) -> Path:
    """Write the lines to `<log_dir>/metrics.jsonl` through the real logger; returns the dir."""
    with MetricsLogger(LoggerConfig(log_dir=str(log_dir)), out=io.StringIO()) as logger:
        for line in lines:
            logger.log(line["step"], {key: value for key, value in line.items() if key != "step"})
    return log_dir
