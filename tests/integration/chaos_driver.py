"""Drive a GRPO run through the real stack and SIGKILL its components by PID on trigger lines.

Shared by the chaos tests (`test_chaos.py`, `test_chaos_async.py`): `drive` starts the driver
(`examples/run_grpo_single_controller.py`) on a recipe, watches its output, and kills each
`Kill`'s component (its PID read from the run's own `run_info.json`, `components`) once the
trigger line appears; every process the run leaves behind is listed, killed by PID and reported
(`ChaosRun.leftovers`). `check_every_step` is the accounting every chaos run must keep.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.process_family import (
    TAG_VAR,
    _command,
    _descendants,
    _kill_leftovers,
    _ray_temp_dirs,
    _snapshot,
    _still_there,
    _tagged,
    _until_gone,
)

REPO = Path(__file__).resolve().parents[2]
RUN_DEADLINE_S = 1500
# A dead component must be named, and the step accounted, long before any rollout deadline
# (`env.run_timeout_s` is 600 s): detection is within component_check_interval_s (1 s).
STEP_AFTER_DEATH_MAX_S = 60.0


@dataclass
class Kill:
    trigger: str  # a regex matched against the driver's output lines
    component: str  # a key of run_info.json["components"]
    killed_at: float | None = None
    pid: int | None = None


@dataclass
class ChaosRun:
    returncode: int
    output: str
    metrics: list[dict]
    kills: list[Kill]
    exited_at: float
    log_dir: Path
    leftovers: dict[int, str] = field(default_factory=dict)

    def run_info(self) -> dict:
        return json.loads((self.log_dir / "run_info.json").read_text())


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def drive(tmp: Path, recipe: str, overrides: list[str], kills: list[Kill], env: dict[str, str] | None = None) -> ChaosRun:
    """Run the driver; SIGKILL each component when its trigger line appears (in order; kills whose
    triggers are already met go in the same round, within milliseconds of each other)."""
    log_dir = tmp / "logs"
    out = tmp / "driver.out"
    tag = uuid.uuid4().hex
    environ = {**os.environ, "PYTHONPATH": str(REPO), TAG_VAR: tag, **(env or {})}
    command = [sys.executable, "examples/run_grpo_single_controller.py", "--config", recipe,
               f"logger.log_dir={log_dir}", *overrides]
    family: dict[int, int] = {}
    pending = list(kills)
    end = time.monotonic() + RUN_DEADLINE_S
    with out.open("wb") as sink:
        proc = subprocess.Popen(command, cwd=REPO, env=environ, stdout=sink, stderr=subprocess.STDOUT)
    try:
        while proc.poll() is None:
            if time.monotonic() > end:
                pytest.fail(f"the run did not end within {RUN_DEADLINE_S}s:\n{out.read_text()[-6000:]}")
            family.update(_snapshot(_descendants(proc.pid)))
            text = out.read_text(errors="replace")
            while pending and re.search(pending[0].trigger, text, re.MULTILINE):
                kill = pending.pop(0)
                pids = json.loads((log_dir / "run_info.json").read_text())["components"]
                kill.pid = pids[kill.component]
                os.kill(kill.pid, signal.SIGKILL)
                kill.killed_at = time.monotonic()
                print(f"[chaos] SIGKILL {kill.component} (pid {kill.pid}) on /{kill.trigger}/")
            time.sleep(0.05)
        exited_at = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        family.update(_snapshot(_tagged(tag)))
        family.pop(proc.pid, None)
        ray_dirs = _ray_temp_dirs(set(family))
        _until_gone(family)  # what shares the driver's fate goes
        leftovers = {pid: _command(pid) for pid in _still_there(family)}
        _kill_leftovers(family)
        for d in ray_dirs:
            shutil.rmtree(d, ignore_errors=True)
    assert not pending, f"triggers never seen: {[k.trigger for k in pending]}\n{out.read_text()[-6000:]}"
    return ChaosRun(proc.returncode, out.read_text(errors="replace"), jsonl(log_dir / "metrics.jsonl"), kills,
                    exited_at, log_dir, leftovers)


def check_every_step(run: ChaosRun) -> None:
    """Every step: dispatched == kept + placeholders; trained steps train exactly the rows finalized."""
    for m in run.metrics:
        assert m["rollouts/dispatched"] == m["finalize/kept_rollouts"] + m["finalize/placeholders"], m
        if "train/num_samples" in m:  # trained: exactly the rows finalized this step
            assert m["train/num_samples"] == m["finalize/rows"] > 0, m
        else:
            assert m["finalize/kept_rollouts"] == 0, m


def driver_lines(output: str) -> list[str]:
    """The driver's own lines (worker logs reach it prefixed, in colour, with their actor)."""
    return [line for line in output.splitlines() if not re.sub(r"\x1b\[[0-9;]*m", "", line).startswith(("(", " "))]
