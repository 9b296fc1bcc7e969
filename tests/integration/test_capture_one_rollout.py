"""The platform proof: one real multi-turn rollout captured, verified and audited end to end.

Real components only: private Ray, TransferQueue, the vLLM CPU engine in its flavored venv,
Gym's gate and simple_agent plus our resources server as loopback subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_capture_one_rollout_verifies_and_matches_engine(tmp_path):
    proc = subprocess.run(
        [sys.executable, "examples/capture_one_rollout.py", "--log-dir", str(tmp_path / "logs"), "--seed", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, f"no JSON summary; exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    summary = json.loads(lines[-1])
    assert proc.returncode == 0, summary
    assert summary["verified"] is True
    assert summary["ids_match_engine"] is True
    assert summary["calls"] >= 2
    assert summary["token_in_calls"] >= 1
    assert summary["token_in_calls"] == summary["calls"] - 1
    assert summary["staged"] == summary["calls"]
    assert summary["manifest_failures"] == []
    assert summary["max_abs_logprob_diff"] == 0.0
    assert summary["generated_tokens"] < summary["row_tokens"]
    # Yield from the worker's own counter: every generated token it served is in the loss once.
    assert summary["rows"] == 1
    assert summary["kept_generated_tokens"] == summary["generated_tokens"] == summary["served_generated_tokens"] > 0
    stats = summary["worker_capture_stats"]
    assert stats["capture_failures"] == []
    # Linear cost, no read-back: the worker seeded its prefix cache with every delta it staged, so
    # no continuation fetched its parent from TQ.
    assert stats["prefix_cache_fetched_keys"] == 0
    assert stats["prefix_cache_seeded_keys"] == summary["staged"]
