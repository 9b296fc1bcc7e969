"""The main job on the real stack: 2 GRPO steps with capture on, 2 with capture off.

The two legs are the L1 script's (the session's `l1_legs` fixture, 4 groups of 4 per step); the
compacting agent's proof runs on the checkpoint-resume test's run (`metrics_contract.py`).

Asserts the metrics contract (keys, always-N on every line), that capture is engaged and exact
(token-in rate, no poisoned rollouts, token_mult_prob_error ~ 1), and that refit works: the
engine's logprobs of a fixed probe change after each step and match the trainer's. No actor of
either leg logs Ray's warning that it blocked its event loop, and no worker hands vLLM a raw prompt
(`log_checks.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import L1_PROMPTS_PER_STEP
from tests.integration.log_checks import (
    actor_lines,
    blocking_get_warnings,
    raw_prompt_warnings,
    reload_failed_warnings,
    vllm_main_process_warnings,
)
from tests.integration.metrics_contract import check_step_lines


def _check_lines(lines: list[dict]) -> list[dict]:
    check_step_lines(lines, steps=2, rollouts_per_step=L1_PROMPTS_PER_STEP * 4)
    return lines


def _read(log_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _leg(l1_legs, name: str) -> list[dict]:
    assert (l1_legs.out_dir / name / "metrics.jsonl").is_file(), l1_legs.describe()
    return _check_lines(_read(l1_legs.out_dir / name))


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


def _leg_output(l1_legs, leg: str) -> str:
    log = l1_legs.out_dir / f"{leg}.log"
    assert log.is_file(), l1_legs.describe()
    return log.read_text(errors="replace")


@pytest.mark.integration
@pytest.mark.parametrize("leg", ["capture", "legacy"])
def test_no_actor_blocks_its_event_loop(l1_legs, leg):
    text = _leg_output(l1_legs, leg)
    # The workers' own lines reach this log (Ray forwards actor output), so an empty answer below is a finding.
    assert actor_lines(text, "VllmGenerationWorker"), f"no VllmGenerationWorker line in the {leg} leg's log"
    assert blocking_get_warnings(text) == [], f"an actor blocked its event loop in the {leg} leg"


@pytest.mark.integration
@pytest.mark.parametrize("leg", ["capture", "legacy"])
def test_the_worker_hands_vllm_rendered_inputs_not_raw_prompts(l1_legs, leg):
    text = _leg_output(l1_legs, leg)
    # vLLM's warnings from the worker's own process reach this log, so the empty answer below is a finding.
    assert vllm_main_process_warnings(text), f"no vLLM warning from a worker's main process in the {leg} leg's log"
    assert raw_prompt_warnings(text) == [], f"a worker passed vLLM a raw prompt in the {leg} leg"


@pytest.mark.integration
def test_a_refitting_run_logs_no_reload_warning(l1_legs):
    text = _leg_output(l1_legs, "capture")
    # Every capture step refits (the metrics test shows the engine moved), and the engine core's
    # lines reach this log (the reload probe test shows a real missing weight is printed).
    assert reload_failed_warnings(text) == [], "a refit logged vLLM's reload warning"
