"""SIGKILL the async loop's driver with groups in flight, resume it, and lose no prompt.

Two stack starts (the killed run, the resumed run) of `examples/configs/grpo_async_tiny_cpu.yaml`
with two steps' groups in flight (`max_in_flight_groups` = 2P, `max_trajectory_age_steps` 2, so
no group is dropped as stale and every position is dispatched once per launch) and calls spread
in time (`slow_calls_hook`), so groups are running when the kill lands. The kill follows step 1's
checkpoint, once steps 2 and 3's groups are dispatched. Read from the runs' own records: the
checkpoint's prompt-ledger snapshot lists exactly the positions dispatched and not consumed; the
resumed run dispatches those first, each under a higher generation and a new run id; and every
step trains exactly the prompts of the uninterrupted sequence (computed from the prompt source),
none twice, none missing. Process-family handling is `process_family.run_then_sigkill`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.process_family import TAG_VAR, left_after_exit, run_then_sigkill
from tests.integration.resume_support import read_jsonl, uninterrupted_prompts

REPO = Path(__file__).resolve().parents[2]
RECIPE = "examples/configs/grpo_async_tiny_cpu.yaml"
STEPS, KILL_AFTER, P, N = 3, 1, 2, 4  # P and N are the recipe's
CAP, MAX_AGE = 2 * P, 2  # two steps in flight; ages stay <= 2, so nothing is dropped
RUN_DEADLINE_S = 1500
LINGER_S = 15.0


def _overrides(log_dir: Path, ckpt: Path) -> list[str]:
    return [f"grpo.max_num_steps={STEPS}", f"grpo.async_rollouts.max_in_flight_groups={CAP}",
            f"grpo.async_rollouts.max_trajectory_age_steps={MAX_AGE}", f"logger.log_dir={log_dir}",
            "checkpointing.enabled=true", "checkpointing.save_period=1", f"checkpointing.checkpoint_dir={ckpt}"]


def _kill_point(ckpt: Path, log_dir: Path):
    """Step KILL_AFTER's checkpoint is complete and groups of a step after KILL_AFTER + 1 are dispatched."""
    marker = ckpt / f"step_{KILL_AFTER}" / "CHECKPOINT_COMPLETE"
    return lambda: marker.is_file() and any(
        r["step"] > KILL_AFTER + 1 for r in read_jsonl(log_dir / "dispatched_prompts.jsonl"))


@pytest.mark.integration
def test_sigkill_with_groups_in_flight_then_resume_trains_every_prompt_once(tmp_path: Path) -> None:
    log_dir, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    overrides = _overrides(log_dir, ckpt)
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), TAG_VAR: tag, "NRL_INSTRUMENTATION": "tests.integration.slow_calls_hook"}
    command = [sys.executable, "examples/run_grpo_single_controller.py", "--config", RECIPE, *overrides]

    killed = run_then_sigkill(command, cwd=REPO, env=env, out=tmp_path / "part1.out",
                              ready=_kill_point(ckpt, log_dir), deadline_s=RUN_DEADLINE_S)
    print(f"[test] part 1 killed after {killed.seconds:.0f}s; {len(killed.survivors)} of its {killed.family_size} "
          f"processes outlived the driver and were killed")
    before = read_jsonl(log_dir / "dispatched_prompts.jsonl")
    run_id_before = json.loads((log_dir / "run_info.json").read_text())["run_id"]
    state = json.loads((ckpt / f"step_{KILL_AFTER}" / "trainer_state.json").read_text())
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step_{KILL_AFTER}"]

    # Groups of later steps were dispatched before the kill: in flight at step KILL_AFTER's checkpoint.
    consumed = KILL_AFTER * P
    later = [r for r in before if r["position"] >= consumed]
    assert any(r["dispatched_during_step"] == KILL_AFTER + 1 for r in later), before
    # The snapshot lists exactly the positions dispatched and not consumed when the step was saved
    # (dispatched before step KILL_AFTER+1 committed; with nothing dropped, no later dispatch).
    ledger = state["prompt_ledger"]
    assert (state["format"], ledger["step"], ledger["groups_per_step"]) == (2, KILL_AFTER, P)
    in_flight = [p for p in ledger["pending"] if p["state"] != "queued"]
    assert [p["position"] for p in ledger["pending"]] == [p["position"] for p in in_flight]
    assert [p["position"] for p in in_flight] == sorted(
        r["position"] for r in later if r["dispatched_during_step"] <= KILL_AFTER + 1) == list(range(consumed, consumed + CAP))
    assert ledger["next_draw"] == consumed + CAP

    resumed = subprocess.run([*command, "checkpointing.resume=latest"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=RUN_DEADLINE_S)
    assert resumed.returncode == 0, f"exit {resumed.returncode}\n{resumed.stdout[-4000:]}\n{resumed.stderr[-6000:]}"
    left = left_after_exit(tag, LINGER_S)
    assert left == {}, f"the resumed run left processes behind {LINGER_S:g}s after it exited: {left}"
    positions = list(range(consumed, consumed + CAP))
    assert (f"[async] restored the prompt ledger of step {KILL_AFTER}: positions {positions} are dispatched first"
            in resumed.stdout), resumed.stdout[-4000:]

    # Rollout ids are fresh because the run id is per launch (the re-dispatched generations are too).
    run_id_after = json.loads((log_dir / "run_info.json").read_text())["run_id"]
    assert run_id_after != run_id_before

    after = read_jsonl(log_dir / "dispatched_prompts.jsonl")
    kept = [r for r in before if r["step"] <= KILL_AFTER]
    assert after[:len(kept)] == kept  # the resume cut the records of steps after the checkpoint, only those
    redispatched = after[len(kept):]
    # The prompts in flight come first, in order, each under a generation higher than any before the kill.
    assert [r["position"] for r in redispatched[:len(in_flight)]] == positions
    generations_before = {p: max(r["generation"] for r in before if r["position"] == p) for p in positions}
    for record in redispatched[:len(in_flight)]:
        assert record["generation"] == ledger["pending"][record["position"] - consumed]["generations"]
        assert record["generation"] > generations_before[record["position"]]

    # Every step trained exactly the uninterrupted run's prompts: each position dispatched once over
    # the surviving log (nothing was dropped), in the source's order, none missing, none twice.
    lines = read_jsonl(log_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        assert m["rollouts/dispatched"] == m["finalize/kept_rollouts"] + m["finalize/placeholders"] == P * N
        assert m["async/dropped_stale_groups"] == 0
    assert lines[KILL_AFTER]["resume/from_step"] == KILL_AFTER
    by_position = sorted(after, key=lambda r: r["position"])
    assert [r["position"] for r in by_position] == list(range(STEPS * P))
    expected = uninterrupted_prompts(REPO / RECIPE, overrides, STEPS, model_dir=tmp_path)  # arith: no model needed
    assert [(r["step"], r["group"], r["digest"]) for r in by_position] == expected

    # The last checkpoint holds the ledger with nothing pending: every drawn prompt was consumed.
    final = json.loads((ckpt / f"step_{STEPS}" / "trainer_state.json").read_text())
    assert (final["format"], final["prompt_ledger"]["step"], final["prompt_ledger"]["pending"]) == (2, STEPS, [])
    assert final["prompt_ledger"]["next_draw"] == STEPS * P
