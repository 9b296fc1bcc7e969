"""Checkpoint and resume through the real stack: SIGKILL the driver after step 1's checkpoint, resume.

Two stack starts: the run that is killed, and the resumed run that finishes. There is no third,
uninterrupted reference run: the recipe's prompt source (the built-in arithmetic environment) is
a pure function of (seed, step) — `tests/unit/algorithms/test_grpo_checkpoint.py` proves it for
every source — so the prompt sequence an uninterrupted run dispatches is computed here from the
source itself (`make_prompt_source`, the function the loop calls) and compared with what the two
parts logged in `dispatched_prompts.jsonl`.

The kill lands while step 2 is in flight (after step 1's checkpoint is complete and step 2's
groups were dispatched), as a pre-emption would. Every process the killed driver left behind
(its Ray cluster, the Gym servers in their own sessions, the vLLM worker) is found by an
environment tag that all of them inherit and by the driver's process tree, killed by PID, and
checked gone; never by name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.process_family import (
    TAG_VAR,
    _command,
    _descendants,
    _kill_leftovers,
    _mentioning,
    _ray_temp_dirs,
    _snapshot,
    _still_there,
    _tagged,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = "examples/configs/grpo_capture_tiny_cpu.yaml"
STEPS = 3
KILL_AFTER = 1  # the step whose checkpoint is complete when the driver is killed
PROMPTS_PER_STEP = 4  # 4 groups: a step whose every group has equal rewards (no gradient) is unlikely
RUN_DEADLINE_S = 1800
LINGER_S = 15.0  # how long a process of an exited run may take to go before it counts as left behind


def _overrides(log_dir: Path, ckpt: Path) -> list[str]:
    return [
        f"grpo.max_num_steps={STEPS}", f"grpo.num_prompts_per_step={PROMPTS_PER_STEP}", f"logger.log_dir={log_dir}",
        "checkpointing.enabled=true", "checkpointing.save_period=1", f"checkpointing.checkpoint_dir={ckpt}",
        "checkpointing.keep_last=2",
    ]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _wait_for_kill_point(proc: subprocess.Popen, ckpt: Path, log_dir: Path, out: Path) -> None:
    """Until step KILL_AFTER's checkpoint is complete and step KILL_AFTER+1 has been dispatched."""
    marker = ckpt / f"step_{KILL_AFTER}" / "CHECKPOINT_COMPLETE"
    dispatched = log_dir / "dispatched_prompts.jsonl"
    end = time.monotonic() + RUN_DEADLINE_S
    while True:
        # Whole lines only: the driver may be appending while we read.
        lines = dispatched.read_text().split("\n")[:-1] if dispatched.exists() else []
        if marker.is_file() and any(json.loads(line)["step"] == KILL_AFTER + 1 for line in lines):
            return
        if proc.poll() is not None:
            pytest.fail(f"the first run exited ({proc.returncode}) before the kill point:\n{out.read_text()[-6000:]}")
        if time.monotonic() > end:
            pytest.fail(f"no kill point within {RUN_DEADLINE_S}s:\n{out.read_text()[-6000:]}")
        time.sleep(0.2)


@pytest.mark.integration
def test_sigkill_after_a_checkpoint_then_resume_continues_exactly(tmp_path: Path) -> None:
    from nemo_rl.algorithms.grpo_checkpoint import batch_digest
    from nemo_rl.algorithms.grpo_config import load_master_config
    from nemo_rl.environments.datasets import make_prompt_source
    from nemo_rl.environments.task import RowSampling

    log_dir, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    overrides = _overrides(log_dir, ckpt)
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), TAG_VAR: tag}
    command = [sys.executable, "examples/run_grpo_single_controller.py", "--config", RECIPE]

    # Part 1: run until step 1's checkpoint is complete and step 2 is in flight, then SIGKILL.
    out1 = tmp_path / "part1.out"
    family: dict[int, int] = {}
    ray_dirs: set[str] = set()
    t0 = time.monotonic()
    with out1.open("wb") as sink:
        proc = subprocess.Popen([*command, *overrides], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        _wait_for_kill_point(proc, ckpt, log_dir, out1)
        family = _snapshot(_descendants(proc.pid) | _tagged(tag))
        ray_dirs = _ray_temp_dirs(set(family))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        time.sleep(2.0)  # what dies with the driver (Ray's fate-sharing) has had time to go
        family.update(_snapshot(_tagged(tag)))  # anything started between the snapshot and the kill
        family.pop(proc.pid, None)
        survivors = {pid: _command(pid) for pid in _still_there(family)}
        _kill_leftovers(family)
        for d in ray_dirs:
            shutil.rmtree(d, ignore_errors=True)  # the killed driver's private Ray dir; no one else uses it
    part1_s = time.monotonic() - t0
    assert len(ray_dirs) == 1, ray_dirs
    assert _tagged(tag) == set(), "a process of the killed run is still alive"
    assert _mentioning(next(iter(ray_dirs))) == [], "a Ray process of the killed run's cluster is still alive"
    print(f"[test] part 1 killed after {part1_s:.0f}s; {len(survivors)} of its {len(family)} processes outlived "
          f"the driver and were killed: {survivors}")

    saved = json.loads((ckpt / f"step_{KILL_AFTER}" / "trainer_state.json").read_text())
    assert saved["step"] == KILL_AFTER
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step_{KILL_AFTER}"]  # step 2's was never started

    # Part 2: resume with the same recipe and checkpointing.resume=latest, to the end.
    t1 = time.monotonic()
    resumed = subprocess.run([*command, *overrides, "checkpointing.resume=latest"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=RUN_DEADLINE_S)
    part2_s = time.monotonic() - t1
    assert resumed.returncode == 0, f"exit {resumed.returncode}\n{resumed.stdout[-4000:]}\n{resumed.stderr[-6000:]}"
    # Ray stops its daemons asynchronously: on a loaded host one may still be exiting when the driver returns.
    linger_end = time.monotonic() + LINGER_S
    while _tagged(tag) and time.monotonic() < linger_end:
        time.sleep(0.5)
    left = {pid: _command(pid) for pid in _tagged(tag)}
    assert left == {}, f"the resumed run left processes behind {LINGER_S:g}s after it exited: {left}"
    print(f"[test] part 2 (resume + {STEPS - KILL_AFTER} steps) took {part2_s:.0f}s")
    said = resumed.stdout
    assert f"dispatched_prompts.jsonl: dropped {PROMPTS_PER_STEP} record(s) after step {KILL_AFTER}" in said
    assert f"continuing at step {KILL_AFTER + 1}" in said

    # metrics.jsonl continues with the next step: one line per step over both parts.
    lines = _jsonl(log_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))

    # The prompt sequence over both parts equals the uninterrupted run's: the source's, step by step.
    cfg = load_master_config(REPO / RECIPE, overrides)
    sampling = RowSampling(temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p, max_output_tokens=cfg.grpo.max_output_tokens)
    source = make_prompt_source(cfg.env, seed=cfg.grpo.seed, sampling=sampling, model_dir=tmp_path,  # arith: no model needed
                                max_model_len=cfg.generation.vllm.max_model_len, progress=lambda _: None)
    expected = [(s, g, batch_digest([row])) for s in range(1, STEPS + 1)
                for g, row in enumerate(source.batch(s, PROMPTS_PER_STEP))]
    logged = [(r["step"], r["group"], r["digest"]) for r in _jsonl(log_dir / "dispatched_prompts.jsonl")]
    assert logged == expected  # no group dropped, none repeated, none out of order

    # The restored policy and optimizer are the saved ones, bit for bit.
    info = json.loads((log_dir / "run_info.json").read_text())["resume"]
    assert info["checkpoint"] == str(ckpt / f"step_{KILL_AFTER}")
    assert (info["policy_fingerprint"], info["optimizer_fingerprint"], info["policy_steps_taken"]) == (
        saved["policy_fingerprint"], saved["optimizer_fingerprint"], saved["policy_steps_taken"])
    assert info["weight_version"] == saved["weight_version"] == KILL_AFTER  # step 1 trained and refit

    # The engine serves the restored weights: its probe is the one it gave when step 1 was saved,
    # it agrees with the restored trainer, it moved off the initial weights the new engine loaded,
    # and the resumed rows carry the saved weight version, then the next.
    first = lines[KILL_AFTER]
    assert first["resume/from_step"] == KILL_AFTER
    assert first["resume/engine_probe_vs_saved_max_abs_diff"] < 1e-4, first
    assert first["resume/engine_trainer_max_abs_diff"] < 0.02, first
    assert first["resume/engine_probe_change"] > 1e-4, first
    assert [(m["weight_version/min"], m["weight_version/max"]) for m in lines] == [
        (float(s - 1), float(s - 1)) for s in range(1, STEPS + 1)]
    for m in lines:
        assert m["rollouts/dispatched"] == m["finalize/kept_rollouts"] + m["finalize/placeholders"]
        assert m["token_mult_prob_error"] < 1.01
    assert all(not k.startswith("resume/") for m in lines[KILL_AFTER + 1:] for k in m)

    # Checkpoints after step 2 and 3; keep_last=2 removed step 1's; nothing half-written is left.
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_3"]
    final = json.loads((ckpt / f"step_{STEPS}" / "trainer_state.json").read_text())
    assert (final["step"], final["weight_version"], final["policy_steps_taken"]) == (STEPS, STEPS, STEPS)
