"""Shared integration fixtures.

`reliability_probe` runs `reliability_probe.py` once per session (one real stack start, shared by
`test_bad_input.py` and `test_loopback.py`) as a subprocess, so its private Ray cluster never
meets another test's, and returns the JSON report it prints last.

`l1_legs` runs the L1 functional script once per session (its flag-off leg, then its capture leg,
2 steps of 4 groups x 4 each, as the users' recipe runs them); `test_l1_functional.py` asserts the
script's verdict and `test_grpo_single_controller.py` asserts the metrics contract on the same
two legs, so the main job's two modes cost two runs, not four.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_S = 1500
L1_SCRIPT = REPO / "tests" / "functional" / "L1_Functional_Tests_SingleController.sh"
L1_TIMEOUT_S = 2400
# 4 groups of 4: a group whose 4 rewards are all equal carries no gradient; with four groups per
# step the chance that every group is flat (and the weights cannot move) is tiny.
L1_PROMPTS_PER_STEP = 4


@pytest.fixture(scope="session")
def reliability_probe(tmp_path_factory) -> dict:
    log_dir = tmp_path_factory.mktemp("reliability") / "logs"
    proc = subprocess.run(
        [sys.executable, "tests/integration/reliability_probe.py", "--log-dir", str(log_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (
        f"reliability probe exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    report = json.loads(lines[-1])
    report["_stdout"] = proc.stdout
    report["_stderr"] = proc.stderr
    return report


@dataclass(frozen=True)
class L1Legs:
    out_dir: Path  # <leg>/ log dirs (legacy, capture) and <leg>.log
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"L1 exited {self.returncode}\nstdout:\n{self.stdout[-6000:]}\nstderr:\n{self.stderr[-3000:]}"


@pytest.fixture(scope="session")
def l1_legs(tmp_path_factory) -> L1Legs:
    out_dir = tmp_path_factory.mktemp("l1")
    proc = subprocess.run(
        ["bash", str(L1_SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=L1_TIMEOUT_S,
        env={**os.environ, "L1_OUT_DIR": str(out_dir), "L1_OVERRIDES": f"grpo.num_prompts_per_step={L1_PROMPTS_PER_STEP}"},
    )
    return L1Legs(out_dir, proc.returncode, proc.stdout, proc.stderr)
