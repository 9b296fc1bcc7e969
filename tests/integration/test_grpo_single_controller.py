"""The main job on the real stack: 2 GRPO steps with capture on, 2 with capture off.

The two legs are the L1 script's (the session's `l1_legs` fixture, 4 groups of 4 per step); the
compacting agent gets a run of its own.

Asserts the metrics contract (keys, always-N on every line), that capture is engaged and exact
(token-in rate, no poisoned rollouts, token_mult_prob_error ~ 1), and that refit works: the
engine's logprobs of a fixed probe change after each step and match the trainer's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import L1_PROMPTS_PER_STEP

REPO = Path(__file__).resolve().parents[2]
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


def _check_lines(lines: list[dict]) -> list[dict]:
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert REQUIRED_KEYS <= set(m), REQUIRED_KEYS - set(m)
        assert m["rollouts/dispatched"] == m["finalize/kept_rollouts"] + m["finalize/placeholders"]
        assert m["finalize/rows"] >= m["finalize/kept_rollouts"]
        assert m["rollouts/dispatched"] == L1_PROMPTS_PER_STEP * 4
    return lines


def _read(log_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _leg(l1_legs, name: str) -> list[dict]:
    assert (l1_legs.out_dir / name / "metrics.jsonl").is_file(), l1_legs.describe()
    return _check_lines(_read(l1_legs.out_dir / name))


def _run(log_dir: Path, *overrides: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "examples/run_grpo_single_controller.py", "--config", "examples/configs/grpo_capture_tiny_cpu.yaml",
         "grpo.max_num_steps=2", f"grpo.num_prompts_per_step={L1_PROMPTS_PER_STEP}", f"logger.log_dir={log_dir}", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return _check_lines(_read(log_dir))


@pytest.mark.integration
def test_grpo_capture_on_is_engaged_exact_and_refits(l1_legs):
    lines = _leg(l1_legs, "capture")
    for m in lines:
        assert m["finalize/token_in_rate"] >= 0.99
        assert m["finalize/calls_per_rollout"] > 1.5  # multi-turn rollouts (tool call, then answer)
        assert m["finalize/token_in_calls"] >= 1
        assert m["finalize/capture_poisoned_rollouts"] == 0
        assert m["finalize/orphaned_staged_keys"] == 0  # every staged call was committed
        assert m["token_mult_prob_error"] < 1.01
        # The engine serves the new weights: its probe logprobs moved and match the trainer's.
        assert m["refit/engine_logprob_change"] > 1e-4
        assert m["refit/engine_trainer_max_abs_diff"] < 0.02
        # Yield measured against the worker's own served-token counter.
        assert m["finalize/served_generated_tokens"] > 0
        assert m["finalize/kept_generated_token_fraction"] >= 0.99
        # Rows went finalizer -> train partition -> policy worker; the step's keys are cleared after training.
        assert m["retention/train_keys_cleared"] == m["finalize/rows"]
        assert m["retention/train_keys_stray"] == 0.0
        assert m["retention/train_keys_remaining"] == 0.0
    # Rows carry the version the workers served: step 1 samples from the initial weights (0),
    # step 2 from the weights refit after step 1.
    assert [(m["weight_version/min"], m["weight_version/max"]) for m in lines] == [(0.0, 0.0), (1.0, 1.0)]


@pytest.mark.integration
def test_grpo_capture_off_runs_the_legacy_path(l1_legs):
    lines = _leg(l1_legs, "legacy")
    for m in lines:
        assert m["finalize/token_in_calls"] == 0
        assert m["finalize/rows"] >= 1
        assert m["weight_version/min"] == m["weight_version/max"] == -1.0  # the token echo carries no version
        assert "retention/train_keys_remaining" not in m  # legacy rows reach the policy as a TrainBatch argument


@pytest.mark.integration
def test_grpo_with_a_compacting_agent_keeps_every_rollout(tmp_path):
    """Our compacting agent rewrites its history after each tool result; NeMo-Gym 0.7.0's rules
    poison every such rollout (`unresolved_parent`). Our gate starts a branch instead, and the
    judge trains both chains: nothing is lost, every served token is in the loss once."""
    lines = _run(tmp_path / "compacting", "env.agent=compacting_agent")
    for m in lines:
        assert m["finalize/placeholders"] == 0
        assert m["finalize/kept_rollouts"] == m["rollouts/dispatched"]
        # Each compaction opens a new text root (a branch, not a miss): one chain per root, one row
        # per chain. A rollout whose model answers without a tool call has no compaction and one chain.
        assert m["finalize/branches_per_rollout"] > 0
        assert m["finalize/unresolved_continuations"] == 0
        assert m["finalize/chains_per_rollout"] == pytest.approx(1.0 + m["finalize/branches_per_rollout"])
        assert m["finalize/rows_per_rollout"] == pytest.approx(m["finalize/chains_per_rollout"])
        assert m["finalize/kept_generated_token_fraction"] == 1.0
        assert m["finalize/terminal_selection/response_id"] == m["rollouts/dispatched"]
        assert m["token_mult_prob_error"] < 1.01
