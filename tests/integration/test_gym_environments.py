"""Gym's shipped environments through the main loop on the real stack (capture on, tiny CPU model).

Each recipe names a Gym resources server by package (`env.gym.resources_server`) and reads the
package's own `data/example.jsonl` at run time. The contract checked is the pipeline's: every
dispatched rollout is accounted for (kept or placeholder), some rollouts are kept as verified
rows, the prompts are the package's and the Gym server started is the package's. The default
tiny model does not solve `example_multi_step` (reward 0, so none is asserted there); the model
warm-started on `example_session_state_mgmt`'s tools earns non-zero reward from Gym's own
verifier, with odds that make a red run a defect, under Gym's own `simple_agent_with_compaction`
as shipped (it sends `required_prefix_token_ids: null` on every call): every rollout is kept.
One stack per test, each run checking all its stack can show (CI cost: docs/guides/token-capture.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.metrics_contract import check_step_lines

REPO = Path(__file__).resolve().parents[2]
GENERATIONS = 2


def _run(recipe: str, log_dir: Path, steps: int, extra: tuple[str, ...] = (), prompts: int = 1,
         generations: int = GENERATIONS) -> tuple[list[dict], str]:
    proc = subprocess.run(
        [sys.executable, "examples/run_grpo_single_controller.py", "--config", f"examples/configs/{recipe}.yaml",
         f"grpo.max_num_steps={steps}", f"grpo.num_prompts_per_step={prompts}",
         f"grpo.num_generations_per_prompt={generations}", f"logger.log_dir={log_dir}", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()], proc.stdout


def _check_accounted(lines: list[dict], steps: int, dispatched: int) -> None:
    check_step_lines(lines, steps, dispatched)
    assert sum(m["finalize/kept_rollouts"] for m in lines) >= 1
    assert sum(m["finalize/rows"] for m in lines) >= 1


def _check_packaged(log_dir: Path, stdout: str, server: str) -> None:
    # The prompts came from the installed package's example rows, and Gym's server was the one started.
    assert f"resources_servers/{server}/data/example.jsonl" in stdout
    assert list(log_dir.glob(f"gym_{server}*.log"))


@pytest.mark.integration
def test_gyms_multi_step_env_runs_through_the_loop(tmp_path: Path) -> None:
    # One step: its ~4.6k-token prompts are the point here (loops across refits: the L1 legs).
    log_dir = tmp_path / "multi_step"
    lines, stdout = _run("grpo_gym_example_multi_step", log_dir, steps=1)
    _check_accounted(lines, steps=1, dispatched=GENERATIONS)
    _check_packaged(log_dir, stdout, "example_multi_step")


@pytest.mark.integration
def test_the_warm_started_model_earns_reward_on_gyms_session_state_env_under_gyms_compaction_agent(
    tmp_path: Path,
) -> None:
    # The learning recipe as shipped (5 rows x 8 rollouts, temperature 1.0), one step, under Gym's own
    # simple_agent_with_compaction as shipped: the tiny model warm-started on synthetic transcripts of
    # the env's tools (built on first use, ~1-4 min) calls Gym's real counter server, and Gym's
    # verifier rewards the rollouts whose increments left the counter at expected_count. Measured
    # (2026-12-02) per-rollout success at step 1: 0.2 (47 of 240: 15/80 sampled offline; 7, 8, 10
    # and 7 of 40 in four real step 1s), so P(reward 0 over 40 rollouts) = 0.804**40 ~ 1.6e-4.
    recipe = "grpo_gym_session_state_learn_cpu"
    log_dir = tmp_path / recipe
    prompts, generations = 5, 8
    lines, stdout = _run(recipe, log_dir, steps=1, prompts=prompts, generations=generations,
                         extra=("env.agent=simple_agent_with_compaction",))
    _check_accounted(lines, steps=1, dispatched=prompts * generations)
    _check_packaged(log_dir, stdout, "example_session_state_mgmt")
    assert "gymcounter-" in stdout  # the warm start, not the default tiny model
    (m,) = lines
    # Before the gate accepted the compaction agent's `required_prefix_token_ids: null`, every
    # rollout was a run_failed placeholder (HTTP 400 from Gym's request model).
    assert m["finalize/kept_rollouts"] == prompts * generations and m["finalize/placeholders"] == 0
    assert "finalize/placeholders/run_failed" not in m
    # Rows exist only once verify_and_linearize matched them to the worker's staged ids (exact by
    # construction); > 1 model call per rollout: tool results went back to the model.
    assert m["finalize/rows"] >= prompts * generations and m["finalize/calls_per_rollout"] > 1
    assert m["finalize/served_generated_tokens"] > 0 and m["finalize/kept_generated_token_fraction"] == 1.0
    assert 0.0 < m["reward/mean"] <= 1.0
    agent_log = next(log_dir.glob("gym_example_session_state_mgmt*agent*.log")).read_text(errors="replace")
    assert " -m responses_api_agents.simple_agent_with_compaction.app\n" in agent_log
