"""What every capture step line of the GRPO loop must carry, and what a compacting-agent run keeps.

`REQUIRED_KEYS` is the metrics contract of a step line (`test_grpo_single_controller.py` checks it
on the L1 legs). `check_compacting_lines` is the compacting agent's proof: our compacting agent
rewrites its history after each tool result; NeMo-Gym 0.7.0's rules poison every such rollout
(`unresolved_parent`). Our gate starts a branch instead, and the judge trains both chains: nothing
is lost, every served token is in the loss once. It runs on the checkpoint-resume test's run
(`test_checkpoint_resume.py`, `env.agent=compacting_agent`), so the agent costs no stack start of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

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


def check_step_lines(lines: Sequence[dict], steps: int, rollouts_per_step: int) -> None:
    """Steps 1..steps, each with the contract's keys and always-N accounting."""
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
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
