"""The platform proof: one real multi-turn rollout captured, verified and audited end to end.

Real components only: private Ray, TransferQueue, the vLLM CPU engine in its flavored venv,
Gym's gate and simple_agent plus our resources server as loopback subprocesses.

The run also proves transport re-sends are idempotent: `--drop-first-reply` puts a loopback
forwarder between the gate and the worker that closes the gate's connection right after it read
the worker's reply to the rollout's first call. Gym re-sends then: its `server_utils.request`
encodes the JSON body once (`kwargs["data"] = orjson.dumps(kwargs.pop("json"))`) and
`_request_with_retries` loops on `client.request(...)`, catching `ServerDisconnectedError` and
`ClientOSError` ("Retrying forever is wrong if the endpoint is expected to sometimes die and
move": with `_max_connection_retries=None`, the gate's setting without an `endpoint_file`, it
sleeps 0.5 s and re-sends the same bytes, forever). A connection closed before any response byte
is exactly that case. The worker must replay the committed reply: the rollout is kept and exact,
one generation per call, one replay.
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
        [sys.executable, "examples/capture_one_rollout.py", "--log-dir", str(tmp_path / "logs"), "--seed", "3",
         "--drop-first-reply"],
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
    # The dropped reply was re-sent by the gate and replayed by the worker: one generation per call.
    assert summary["link"]["dropped"] == 1
    assert stats["calls"]["replayed_calls"] == 1
    assert stats["served_calls"] == summary["calls"] == summary["served_report_calls"]
    assert stats["calls"].get("duplicate_model_call_id", 0) == 0
