"""Shared integration fixtures.

`reliability_probe` runs `reliability_probe.py` once per session (one real stack start, shared by
`test_bad_input.py` and `test_loopback.py`) as a subprocess, so its private Ray cluster never
meets another test's, and returns the JSON report it prints last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_S = 1500


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
