"""The main job on a real two-node Ray cluster on this host (`tests/two_node_cluster.py`).

The driver runs as a subprocess joined through RAY_ADDRESS (as `ultra_launch.sh` runs it), with
the multi-node knobs: `generation.vllm.bind=node_ip`, `data_plane.bind=node_ip`, two vLLM
workers spread one per node, and `grpo.refit_dir` outside the log dir. Two capture steps must
pass the usual contract (always-N, token-in, nothing poisoned, exact logprobs, refit to version
1), both workers must serve calls, and `run_info.json` must show worker 0 on the head (driver's
node, 127.0.0.1) and worker 1 on the second node (listening on 127.0.0.2), as planned, and the
policy on the second node (the head offers no CPU), so refit weights and train rows cross nodes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.two_node_cluster import SECOND_NODE_IP, two_node_cluster

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
ROLLOUTS_PER_STEP = 2 * 4  # grpo_base.yaml: 2 prompts x 4 generations
DRIVER_TIMEOUT_S = 1500  # a cold vLLM venv build plus the run; a warm run takes ~4 min here


def test_grpo_capture_runs_on_two_nodes(tmp_path: Path) -> None:
    log_dir = tmp_path / "run"
    refit_dir = tmp_path / "refit"
    # No CPU on the head: the policy (1 CPU) must run on the second node, so the refit folder is
    # written on one node and read on both, and its rows cross nodes through TransferQueue.
    with two_node_cluster(head_cpus=0, second_cpus=2) as cluster:
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "examples/run_grpo_single_controller.py", "--config",
             "examples/configs/grpo_capture_tiny_cpu.yaml", f"grpo.max_num_steps={STEPS}", f"logger.log_dir={log_dir}",
             f"grpo.refit_dir={refit_dir}", "generation.num_workers=2", "generation.vllm.bind=node_ip",
             "data_plane.bind=node_ip"],
            cwd=REPO, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S,
            env=cluster.driver_env({**os.environ, "PYTHONPATH": str(REPO)}),
        )
        print(f"[multinode test] driver exited {proc.returncode} after {time.monotonic() - t0:.0f}s")
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
        head, second = cluster.head_node_id, cluster.second_node_id

    assert re.search(rf"\[stack\] joined the Ray cluster at {re.escape(cluster.address)} \(RAY_ADDRESS\); stopping "
                     r"only disconnects; 2 alive node\(s\)", proc.stdout), proc.stdout[-4000:]
    placement = json.loads((log_dir / "run_info.json").read_text())["placement"]
    assert placement["nodes"] == 2
    workers = placement["workers"]
    assert [(w["worker"], w["planned_node"], w["node"]) for w in workers] == [(0, head, head), (1, second, second)]
    actors = placement["actors"]
    print(f"[multinode test] actor nodes: { {k: 'head' if v == head else 'second' for k, v in actors.items()} }")
    assert actors["policy"] == second
    assert set(actors) >= {"policy", "tq_controller", "tq_storage_unit_0", "finalizer_0"}
    assert set(actors.values()) <= {head, second}
    hosts = [re.fullmatch(r"http://([0-9.]+):\d+/v1", w["base_url"]).group(1) for w in workers]
    assert hosts == ["127.0.0.1", SECOND_NODE_IP]

    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        assert m["rollouts/dispatched"] == ROLLOUTS_PER_STEP
        assert m["finalize/kept_rollouts"] + m["finalize/placeholders"] == ROLLOUTS_PER_STEP
        assert m["finalize/capture_poisoned_rollouts"] == 0
        assert m["finalize/token_in_rate"] >= 0.99
        assert m["token_mult_prob_error"] < 1.01
        assert m["retention/train_keys_remaining"] == 0.0
    assert [(m["weight_version/min"], m["weight_version/max"]) for m in lines] == [(0.0, 0.0), (1.0, 1.0)]
    # Both workers served calls (the gate spreads sessions over both base URLs).
    for i in (0, 1):
        assert sum(m[f"generation/worker_{i}/calls"] for m in lines) > 0, [m[f"generation/worker_{i}/calls"] for m in lines]
    # The refit folder was the one the knob named: the policy exported there, the probe marker is gone.
    assert sorted(p.name for p in refit_dir.iterdir()) == [f"step_{STEPS}"]
