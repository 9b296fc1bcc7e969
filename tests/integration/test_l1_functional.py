"""Runs the L1 functional test script (flag-off leg, then capture leg, then cross-leg checks).

The script holds the assertions (through `nemo_rl/utils/l1_checks.py`); this wrapper lets the
README's test command (and so CI) run it, and checks that both legs left the records the checks
read. Takes about 5 minutes on the 2-core CPU machine (two 2-step runs of the tiny recipe).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "functional" / "L1_Functional_Tests_SingleController.sh"


@pytest.mark.integration
def test_l1_functional_single_controller(tmp_path):
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=2400,
        env={**os.environ, "L1_OUT_DIR": str(tmp_path)},
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1].startswith("[L1] PASS"), \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "[l1] compare: PASS" in lines
    for leg in ("legacy", "capture"):
        assert [json.loads(l)["step"] for l in (tmp_path / leg / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        workers = json.loads((tmp_path / leg / "run_info.json").read_text())["generation/venv"]["workers"]
        assert len(workers) == 1 and workers[0]["spec_hash"] is not None
        records = [json.loads(l) for l in (tmp_path / leg / "first_call_prompt_ids.jsonl").read_text().splitlines()]
        assert {r["step"] for r in records} == {1, 2} and all(r["origin"] in (leg, None) for r in records)
