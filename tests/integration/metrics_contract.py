"""What every capture step line of the GRPO loop must carry, and what a compacting-agent run keeps.

`REQUIRED_KEYS` is the metrics contract of a step line (`test_grpo_single_controller.py` checks it
on the L1 legs); every key a line carries must be named in docs/ (`undocumented_keys`: the metric
tables live there once). `check_compacting_lines` is the compacting agent's proof: our compacting agent
rewrites its history after each tool result; NeMo-Gym 0.7.0's rules poison every such rollout
(`unresolved_parent`). Our gate starts a branch instead, and the judge trains both chains: nothing
is lost, every served token is in the loss once. It runs on the checkpoint-resume test's run
(`test_checkpoint_resume.py`, `env.agent=compacting_agent`), so the agent costs no stack start of its own.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import pytest

from tests.unit.test_docs_tables import names

DOCS = Path(__file__).resolve().parents[2] / "docs"

REQUIRED_KEYS = {
    "step", "reward/mean", "rollouts/dispatched", "finalize/rows", "finalize/placeholders",
    "finalize/token_in_rate", "finalize/token_in_calls", "finalize/text_root_calls",
    "finalize/capture_poisoned_rollouts", "finalize/invalid_row_rate", "finalize/heuristic_terminal_fraction",
    "finalize/calls_per_rollout", "finalize/queue_wait_ms", "token_mult_prob_error", "gen_kl_error",
    "finalize/kept_rollouts", "finalize/rows_per_rollout", "finalize/chains_per_rollout",
    "finalize/kept_generated_token_fraction", "finalize/served_generated_tokens",
    "finalize/terminal_witness_disagreements", "steps/masked_consecutive",
    "weight_version/min", "weight_version/max", "timing/step_s", "timing/generation_s", "timing/finalize_s", "timing/train_s", "timing/refit_s",
}


@cache
def documented_metric_patterns() -> tuple[str, ...]:
    """Every backticked name in docs/ as a pattern: `{a,b}` expanded, a `<placeholder>` matching anything
    (only after a namespace: `finalize/placeholders/<reason>` is a family, a bare `<name>` is no metric)."""
    lines = [line for doc in sorted(DOCS.rglob("*.md")) for line in doc.read_text().splitlines()
             if not line.lstrip().startswith("```")]  # a fence would pair its backticks with the next name's
    found = {re.sub(r"<[^>]+>", "*", name) for line in lines for name in names(line)}
    return tuple(sorted(p for p in found if "*" not in p or "/" in p.partition("*")[0]))


def undocumented_keys(lines: Iterable[dict]) -> set[str]:
    """The metric keys of `lines` that no doc names."""
    keys = {key for m in lines for key in m if key != "step"}
    patterns = documented_metric_patterns()
    return {key for key in keys if not any(fnmatch.fnmatchcase(key, p) for p in patterns)}


def check_step_lines(lines: Sequence[dict], steps: int, rollouts_per_step: int) -> None:
    """Steps 1..steps, each with the contract's keys and always-N accounting; every key documented."""
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert undocumented_keys(lines) == set(), "metrics no doc names: add them to docs/guides/token-capture.md"
    for m in lines:
        assert REQUIRED_KEYS <= set(m), REQUIRED_KEYS - set(m)
        assert m["rollouts/dispatched"] == m["finalize/kept_rollouts"] + m["finalize/placeholders"]
        assert m["finalize/rows"] >= m["finalize/kept_rollouts"]
        assert m["rollouts/dispatched"] == rollouts_per_step


def check_compacting_lines(lines: Sequence[dict]) -> None:
    """Every step of a compacting-agent run keeps every rollout, one chain per text root, one row per chain."""
    for m in lines:
        assert m["finalize/placeholders"] == 0, m
        assert m["finalize/kept_rollouts"] == m["rollouts/dispatched"], m
        # Each compaction opens a new text root (a branch, not a miss): one chain per root, one row
        # per chain. A rollout whose model answers without a tool call has no compaction and one chain.
        assert m["finalize/branches_per_rollout"] > 0, m
        assert m["finalize/unresolved_continuations"] == 0, m
        assert m["finalize/chains_per_rollout"] == pytest.approx(1.0 + m["finalize/branches_per_rollout"])
        assert m["finalize/rows_per_rollout"] == pytest.approx(m["finalize/chains_per_rollout"])
        assert m["finalize/kept_generated_token_fraction"] == 1.0, m
        assert m["finalize/terminal_selection/response_id"] == m["rollouts/dispatched"], m
        assert m["token_mult_prob_error"] < 1.01, m
