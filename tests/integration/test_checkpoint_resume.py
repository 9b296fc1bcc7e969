"""Checkpoint and resume through the real stack: SIGKILL the driver after step 2's checkpoint, resume.

Two stack starts: the run that is killed, and the resumed run that finishes. There is no third,
uninterrupted reference run: the recipe's prompt source (the built-in arithmetic environment) is
a pure function of (seed, step) — `tests/unit/algorithms/test_grpo_checkpoint.py` proves it for
every source — so the prompt sequence an uninterrupted run dispatches is computed here from the
source itself (`resume_support.uninterrupted_prompts`, over the function the loop calls) and
compared with what the two parts logged in `dispatched_prompts.jsonl`.

The kill lands while step 3 is in flight (after step 2's checkpoint is complete and step 3's
groups were dispatched), as a pre-emption would. Two steps before it, not one: the resume must be
seen to restore weights that moved off the initial ones, and a step whose every group has equal
rewards trains nothing (the tiny model under the compacting agent does that at some steps). Every process the killed driver left behind
(its Ray cluster, the Gym servers in their own sessions, the vLLM worker) is found by an
environment tag that all of them inherit and by the driver's process tree, killed by PID, and
checked gone; never by name (`process_family.run_then_sigkill`).

The run uses our compacting agent (`env.agent=compacting_agent`; the resume does not depend on the
agent), so the same two starts also prove the agent keeps every rollout (`metrics_contract.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.metrics_contract import check_compacting_lines, check_step_lines
from tests.integration.process_family import TAG_VAR, left_after_exit, run_then_sigkill
from tests.integration.resume_support import read_jsonl, uninterrupted_prompts

REPO = Path(__file__).resolve().parents[2]
RECIPE = "examples/configs/grpo_capture_tiny_cpu.yaml"
STEPS = 4
KILL_AFTER = 2  # the step whose checkpoint is complete when the driver is killed
PROMPTS_PER_STEP = 4  # 4 groups: a step whose every group has equal rewards (no gradient) is unlikely
RUN_DEADLINE_S = 1800
LINGER_S = 15.0  # how long a process of an exited run may take to go before it counts as left behind


def _overrides(log_dir: Path, ckpt: Path) -> list[str]:
    return [
        f"grpo.max_num_steps={STEPS}", f"grpo.num_prompts_per_step={PROMPTS_PER_STEP}", f"logger.log_dir={log_dir}",
        "checkpointing.enabled=true", "checkpointing.save_period=1", f"checkpointing.checkpoint_dir={ckpt}",
        "checkpointing.keep_last=2", "env.agent=compacting_agent",
    ]


def _kill_point(ckpt: Path, log_dir: Path):
    """Step KILL_AFTER's checkpoint is complete and step KILL_AFTER+1 has been dispatched."""
    marker = ckpt / f"step_{KILL_AFTER}" / "CHECKPOINT_COMPLETE"
    return lambda: marker.is_file() and any(
        r["step"] == KILL_AFTER + 1 for r in read_jsonl(log_dir / "dispatched_prompts.jsonl"))


@dataclass(frozen=True)
class ResumeRun:
    log_dir: Path
    ckpt: Path
    overrides: list[str]
    saved: dict  # step KILL_AFTER's trainer_state.json, read right after the kill
    ckpt_after_kill: list[str]  # the checkpoint folder's entries right after the kill
    resumed: subprocess.CompletedProcess
    left: dict  # processes of the resumed run still there LINGER_S after it exited


@pytest.fixture(scope="module")
def resume_run(tmp_path_factory) -> ResumeRun:
    """The killed run and the resumed run, once for the module's tests (two stack starts)."""
    tmp_path = tmp_path_factory.mktemp("resume")
    log_dir, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    overrides = _overrides(log_dir, ckpt)
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), TAG_VAR: tag}
    command = [sys.executable, "examples/run_grpo_single_controller.py", "--config", RECIPE]

    # Part 1: run until step KILL_AFTER's checkpoint is complete and the next step is in flight, then SIGKILL.
    killed = run_then_sigkill([*command, *overrides], cwd=REPO, env=env, out=tmp_path / "part1.out",
                              ready=_kill_point(ckpt, log_dir), deadline_s=RUN_DEADLINE_S)
    print(f"[test] part 1 killed after {killed.seconds:.0f}s; {len(killed.survivors)} of its {killed.family_size} "
          f"processes outlived the driver and were killed: {killed.survivors}")
    saved = json.loads((ckpt / f"step_{KILL_AFTER}" / "trainer_state.json").read_text())
    ckpt_after_kill = sorted(p.name for p in ckpt.iterdir())

    # Part 2: resume with the same recipe and checkpointing.resume=latest, to the end.
    t1 = time.monotonic()
    resumed = subprocess.run([*command, *overrides, "checkpointing.resume=latest"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=RUN_DEADLINE_S)
    print(f"[test] part 2 (resume + {STEPS - KILL_AFTER} steps) took {time.monotonic() - t1:.0f}s")
    return ResumeRun(log_dir, ckpt, overrides, saved, ckpt_after_kill, resumed, left_after_exit(tag, LINGER_S))


@pytest.mark.integration
def test_sigkill_after_a_checkpoint_then_resume_continues_exactly(resume_run: ResumeRun, tmp_path: Path) -> None:
    log_dir, ckpt, overrides, saved, resumed = (resume_run.log_dir, resume_run.ckpt, resume_run.overrides,
                                                resume_run.saved, resume_run.resumed)
    assert saved["step"] == KILL_AFTER
    assert saved["format"] == 1 and "prompt_ledger" not in saved  # the synchronous loop's, as before
    # keep_last=2 holds steps 1 and 2; the next step's was never started
    assert resume_run.ckpt_after_kill == [f"step_{s}" for s in range(1, KILL_AFTER + 1)]

    assert resumed.returncode == 0, f"exit {resumed.returncode}\n{resumed.stdout[-4000:]}\n{resumed.stderr[-6000:]}"
    assert resume_run.left == {}, f"the resumed run left processes behind {LINGER_S:g}s after it exited: {resume_run.left}"
    said = resumed.stdout
    assert f"dispatched_prompts.jsonl: dropped {PROMPTS_PER_STEP} record(s) after step {KILL_AFTER}" in said
    assert f"continuing at step {KILL_AFTER + 1}" in said

    # metrics.jsonl continues with the next step: one line per step over both parts.
    lines = read_jsonl(log_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))

    # The prompt sequence over both parts equals the uninterrupted run's: the source's, step by step.
    expected = uninterrupted_prompts(REPO / RECIPE, overrides, STEPS, model_dir=tmp_path)  # arith: no model needed
    logged = [(r["step"], r["group"], r["digest"]) for r in read_jsonl(log_dir / "dispatched_prompts.jsonl")]
    assert logged == expected  # no group dropped, none repeated, none out of order

    # The restored policy and optimizer are the saved ones, bit for bit.
    info = json.loads((log_dir / "run_info.json").read_text())["resume"]
    assert info["checkpoint"] == str(ckpt / f"step_{KILL_AFTER}")
    assert (info["policy_fingerprint"], info["optimizer_fingerprint"], info["policy_steps_taken"]) == (
        saved["policy_fingerprint"], saved["optimizer_fingerprint"], saved["policy_steps_taken"])
    assert info["weight_version"] == saved["weight_version"] == KILL_AFTER  # steps 1..KILL_AFTER trained and refit

    # The engine serves the restored weights: its probe is the one it gave when step KILL_AFTER was saved,
    # it agrees with the restored trainer, it moved off the initial weights the new engine loaded,
    # and the resumed rows carry the saved weight version, then the next.
    first = lines[KILL_AFTER]
    assert first["resume/from_step"] == KILL_AFTER
    assert first["resume/engine_probe_vs_saved_max_abs_diff"] < 1e-4, first
    assert first["resume/engine_trainer_max_abs_diff"] < 0.02, first
    assert first["resume/engine_probe_change"] > 1e-4, (
        f"the restored weights are the initial ones: grad norms before the kill "
        f"{[m['train/grad_norm'] for m in lines[:KILL_AFTER]]}", first)
    assert [(m["weight_version/min"], m["weight_version/max"]) for m in lines] == [
        (float(s - 1), float(s - 1)) for s in range(1, STEPS + 1)]
    for m in lines:
        assert m["rollouts/dispatched"] == m["finalize/kept_rollouts"] + m["finalize/placeholders"]
        assert m["token_mult_prob_error"] < 1.01
    assert all(not k.startswith("resume/") for m in lines[KILL_AFTER + 1:] for k in m)

    # The last two steps' checkpoints (keep_last=2 removed the others); nothing half-written is left.
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step_{STEPS - 1}", f"step_{STEPS}"]
    final = json.loads((ckpt / f"step_{STEPS}" / "trainer_state.json").read_text())
    assert (final["step"], final["weight_version"], final["policy_steps_taken"]) == (STEPS, STEPS, STEPS)


@pytest.mark.integration
def test_a_compacting_agent_keeps_every_rollout_on_both_sides_of_the_resume(resume_run: ResumeRun) -> None:
    """The compacting agent's proof (`metrics_contract.check_compacting_lines`), on this run's steps, both sides of the resume."""
    resumed = resume_run.resumed
    assert resumed.returncode == 0, f"exit {resumed.returncode}\n{resumed.stdout[-4000:]}\n{resumed.stderr[-6000:]}"
    lines = read_jsonl(resume_run.log_dir / "metrics.jsonl")
    check_step_lines(lines, steps=STEPS, rollouts_per_step=PROMPTS_PER_STEP * 4)
    check_compacting_lines(lines)
