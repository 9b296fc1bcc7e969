"""Bring the real stack up once, probe its HTTP surfaces and sockets, print one JSON object.

Real components only: a private Ray cluster (`init_local_ray`), TransferQueue, one vLLM CPU
worker in its flavored venv, our capture gate (Gym's model server with our policy), our
resources server and Gym's agent as loopback subprocesses. The stack is brought up with the same
public steps as `algorithms.setup.start_stack`, but the probe speaks while it comes up (the
start-up window), while it serves, and after it is gone:

- `startup`: the worker and the gate answered before the worker serves.
- `gate_cases` / `worker_cases`: a table of bad requests through the real gate, and straight to
  the worker (admission fields, duplicates, a prefix that disagrees with its chain), each as
  `{status, type, param}` (or `{"refused": ...}` when nothing listened).
- `integrity`: the manifests of the rollouts the bad cases named, and the staging partition's
  keys, after all cases (nothing staged or ledgered for a refused request).
- `control`: the worker's control route and the gate's manifest route without, with a wrong
  and with the right bearer.
- `token_leaks`: how many times either per-run token appears in the run's logs (Gym server logs,
  Ray's session logs); the tokens themselves are never printed.
- `sockets`: every listening TCP socket of this process and its descendants, with who owns it.
- `after_shutdown`: the worker and the gate once the stack is stopped.

Run by `tests/integration/conftest.py::reliability_probe` (a subprocess, so Ray stays private):
    python tests/integration/reliability_probe.py --log-dir DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import psutil

from examples.arith.tiny_model import TinyModelConfig, ensure_tiny_model
from nemo_rl.data_plane import DataPlaneConfig, attach_client, start_data_plane
from nemo_rl.data_plane import tq_backend
from nemo_rl.distributed.ray_cluster import init_local_ray
from nemo_rl.environments.gym_client import NemoGymEnvironment
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.launcher import await_workers, spawn_workers
from nemo_rl.token_capture.config import TokenCaptureConfig

MESSAGES = [{"role": "user", "content": "What is 2 + 3? Use the calculator."}]
CHAT = {"model": "tiny-policy", "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0}
FIVE_MB = "x" * (5 * 1024 * 1024)
RAY_DAEMONS = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "dashboard.py", "monitor.py",
               "log_monitor.py", "ray_client_server", "agent.py", "runtime_env/agent")


def chat_path(rollout_id: str) -> str:
    return f"/ng-rollout/{rollout_id}/training-token-capture/v1/chat/completions"


async def call(method: str, url: str, *, raw: bytes | None = None, body: Any = None, headers: dict | None = None,
               timeout_s: float = 120.0) -> dict[str, Any]:
    """One request; the answer as {status, type, param, message} (or {refused} when nothing listens)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            kwargs: dict[str, Any] = {"headers": {"Content-Type": "application/json", **(headers or {})}}
            if raw is not None:
                kwargs["data"] = raw
            elif body is not None:
                kwargs["data"] = json.dumps(body).encode()
            async with session.request(method, url, **kwargs) as resp:
                text = await resp.text()
    except aiohttp.ClientConnectorError as e:
        return {"refused": type(e).__name__}
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) and isinstance(payload.get("error"), dict) else {}
    return {"status": resp.status, "type": error.get("type"), "param": error.get("param"),
            "message": (error.get("message") or "")[:400], "body": payload if resp.status == 200 else None}


def gate_cases(gate: str) -> dict[str, tuple[str, str, bytes]]:
    chat = lambda rid: gate + chat_path(rid)  # noqa: E731
    dump = lambda obj: json.dumps(obj).encode()  # noqa: E731
    return {
        "malformed_json": ("POST", chat("bad-1"), b"{not json"),
        "not_an_object": ("POST", chat("bad-1"), b"[1, 2]"),
        "missing_messages": ("POST", chat("bad-1"), dump({"model": "tiny-policy"})),
        "wrong_type_messages": ("POST", chat("bad-1"), dump({"messages": "hi"})),
        "wrong_type_content": ("POST", chat("bad-1"), dump({"messages": [{"role": "user", "content": 5}]})),
        "negative_max_tokens": ("POST", chat("bad-1"), dump({**CHAT, "max_tokens": -5})),
        "huge_max_tokens": ("POST", chat("bad-1"), dump({**CHAT, "max_tokens": 10**9})),
        "string_max_tokens": ("POST", chat("bad-1"), dump({**CHAT, "max_tokens": "8"})),
        "stream_not_boolean": ("POST", chat("bad-1"), dump({**CHAT, "stream": "yes"})),
        "stream_options_without_stream": ("POST", chat("bad-1"), dump({**CHAT, "stream_options": {"include_usage": True}})),
        "n_2": ("POST", chat("bad-1"), dump({**CHAT, "n": 2})),
        "forged_admission": ("POST", chat("bad-1"), dump({**CHAT, "ng_capture": {"rollout_id": "good-1"}})),
        "five_mb_message": ("POST", chat("bad-1"), dump({**CHAT, "messages": [{"role": "user", "content": FIVE_MB}]})),
        "rollout_id_space": ("POST", gate + chat_path("a%20b"), dump(CHAT)),
        "rollout_id_overlong": ("POST", chat("r" * 300), dump(CHAT)),
        "rollout_id_traversal": ("POST", gate + chat_path("..%2F..%2Fetc"), dump(CHAT)),
        "responses_negative": ("POST", gate + "/ng-rollout/bad-2/v1/responses",
                               dump({"model": "tiny-policy", "input": "hi", "max_output_tokens": -1})),
        "responses_huge": ("POST", gate + "/ng-rollout/bad-2/v1/responses",
                           dump({"model": "tiny-policy", "input": "hi", "max_output_tokens": 10**9})),
    }


def worker_cases(worker: str, root_coords: dict) -> dict[str, tuple[str, str, bytes]]:
    chat = worker + "/chat/completions"

    def admitted(call_id: str, **fields: Any) -> bytes:
        admission = {"schema_version": 2, "rollout_id": "direct-1", "model_call_id": call_id, "parent_call_id": None,
                     "prev_len": 0, "mode": "text", "required_prefix_token_ids": [], "staging_chain": [],
                     "parent_chain_hash": None, **fields}
        return json.dumps({**CHAT, "ng_capture": admission}).encode()

    child = {"mode": "token_in", "parent_call_id": "c1", "prev_len": root_coords["cum_len"],
             "staging_chain": [root_coords["staging_key"]], "parent_chain_hash": root_coords["chain_hash"]}
    return {
        "malformed_json": ("POST", chat, b"{not json"),
        "negative_max_tokens": ("POST", chat, json.dumps({**CHAT, "max_tokens": -5}).encode()),
        "huge_max_tokens": ("POST", chat, json.dumps({**CHAT, "max_tokens": 10**9}).encode()),
        "five_mb_message": ("POST", chat, json.dumps({**CHAT, "messages": [{"role": "user", "content": FIVE_MB}]}).encode()),
        "oversized_body": ("POST", chat, json.dumps({**CHAT, "pad": "y" * (9 * 1024 * 1024)}).encode()),
        "invalid_admission": ("POST", chat, admitted("c9", prev_len="many")),
        # c1 again with another body (a re-send of the very same body would be replayed, not refused).
        "duplicate_model_call_id": ("POST", chat, json.dumps({**CHAT, "max_tokens": 7, "ng_capture": json.loads(
            admitted("c1"))["ng_capture"]}).encode()),
        "prefix_hash_disagrees": ("POST", chat, admitted("c2", **{**child, "parent_chain_hash": "0" * 64})),
        "prefix_len_disagrees": ("POST", chat, admitted("c3", **{**child, "prev_len": root_coords["cum_len"] + 1})),
        "inline_prefix_outside_vocab": ("POST", chat, admitted("c4", mode="token_in", parent_call_id="c1", prev_len=2,
                                                               required_prefix_token_ids=[1, 10**9],
                                                               parent_chain_hash="ab" * 32)),
        "unknown_staging_key": ("POST", chat, admitted("c5", **{**child, "staging_chain": ["direct-1/nope"]})),
    }


def listening_sockets(known: dict[int, str]) -> list[dict[str, Any]]:
    """Every LISTEN socket of this process and its descendants, with its owner."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    out = []
    for proc in procs:
        try:
            cmdline = " ".join(proc.cmdline())
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for conn in conns:
            if conn.status != psutil.CONN_LISTEN:
                continue
            port = conn.laddr.port
            if port in known:
                owner = known[port]
            elif proc.pid == me.pid:
                owner = "driver"
            elif any(daemon in cmdline for daemon in RAY_DAEMONS):
                owner = "ray_daemon"
            elif cmdline.startswith("ray::"):
                owner = "ray_worker"  # a Ray worker process (one of our actors): Ray's own core-worker server
            else:
                owner = "unattributed"
            out.append({"pid": proc.pid, "process": cmdline[:120], "ip": conn.laddr.ip, "port": port, "owner": owner})
    return sorted(out, key=lambda s: (s["owner"], s["port"]))


def token_leaks(paths: list[Path], tokens: dict[str, str]) -> dict[str, Any]:
    files = [p for root in paths if root.exists() for p in root.rglob("*") if p.is_file()]
    hits = {name: [] for name in tokens}
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for name, token in tokens.items():
            if token.encode() in data:
                hits[name].append(str(path))
    return {"files_scanned": len(files), "hits": hits}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = args.log_dir.resolve()
    report: dict[str, Any] = {}
    model_dir = ensure_tiny_model(TinyModelConfig(), progress=lambda m: print(m, file=sys.stderr, flush=True))
    generation = GenerationConfig()
    capture = TokenCaptureConfig(enabled=True)
    dp_cfg = DataPlaneConfig()
    ray_handle = init_local_ray(num_cpus=2)
    group = env = plane = client = None
    try:
        pending = spawn_workers(model_dir, generation, capture.model_dump(), dp_cfg.model_dump(),
                                progress=lambda m: print(m, file=sys.stderr, flush=True))
        group = pending.group
        worker = pending.base_urls[0]
        report["startup"] = {"worker_chat": await call("POST", worker + "/chat/completions", body=CHAT),
                             "worker_health": await call("GET", worker.removesuffix("/v1") + "/health")}
        plane = start_data_plane(dp_cfg)
        client = attach_client(dp_cfg)
        env = NemoGymEnvironment(NemoGymConfig(), capture, worker_base_url=pending.base_urls, log_dir=log_dir)
        await env.start()
        gate = env.servers.gate_url
        report["startup"]["gate_chat"] = await call("POST", gate + chat_path("startup-1"), body=CHAT)
        group = await asyncio.to_thread(await_workers, pending, progress=lambda m: print(m, file=sys.stderr, flush=True))

        good = await call("POST", gate + chat_path("good-1"), body=CHAT)
        report["good_gate_call"] = {k: v for k, v in good.items() if k != "body"}
        report["gate_cases"] = {}
        for name, (method, url, raw) in gate_cases(gate).items():
            report["gate_cases"][name] = {k: v for k, v in (await call(method, url, raw=raw)).items() if k != "body"}

        root = await call("POST", worker + "/chat/completions", raw=json.dumps({**CHAT, "ng_capture": {
            "schema_version": 2, "rollout_id": "direct-1", "model_call_id": "c1", "parent_call_id": None, "prev_len": 0,
            "mode": "text", "required_prefix_token_ids": [], "staging_chain": [], "parent_chain_hash": None}}).encode())
        report["good_worker_call"] = {k: v for k, v in root.items() if k != "body"}
        coords = root["body"]["ng_commit_coords"]
        report["worker_cases"] = {}
        for name, (method, url, raw) in worker_cases(worker, coords).items():
            report["worker_cases"][name] = {k: v for k, v in (await call(method, url, raw=raw)).items() if k != "body"}

        manifests = {rid: (await env.manifest(rid)).model_dump(mode="json") for rid in ("good-1", "bad-1", "bad-2", "startup-1")}
        # The served report is the write-behind barrier: every row staged for these rollouts is written after it.
        await group.served.take_served_async(["good-1", "bad-1", "bad-2", "startup-1", "direct-1"])
        keys = await asyncio.to_thread(client.list_keys, capture.staging_partition)
        report["integrity"] = {
            "manifest_records": {rid: [r["mode"] for r in m["records"]] for rid, m in manifests.items()},
            "manifest_failures": {rid: len(m["failures"]) for rid, m in manifests.items()},
            "staged_keys": sorted(keys),
            "good_call_key": f"good-1/{manifests['good-1']['records'][0]['model_call_id']}" if manifests["good-1"]["records"] else None,
            "worker_state": (await call("GET", worker.removesuffix("/v1") + "/control/state",
                                        headers={"Authorization": f"Bearer {group.control_token}"})),
        }
        state_url = worker.removesuffix("/v1") + "/control/state"
        manifest_url = gate + "/training-token-capture/control/rollouts/good-1/manifest"
        bearer = env.servers.bearer  # the gate's per-run bearer
        report["control"] = {
            "worker_none": await call("GET", state_url),
            "worker_wrong": await call("GET", state_url, headers={"Authorization": "Bearer wrong"}),
            "worker_right": await call("GET", state_url, headers={"Authorization": f"Bearer {group.control_token}"}),
            "gate_none": await call("GET", manifest_url),
            "gate_wrong": await call("GET", manifest_url, headers={"Authorization": "Bearer wrong"}),
            "gate_right": await call("GET", manifest_url, headers={"Authorization": f"Bearer {bearer}"}),
        }
        for answer in report["control"].values():
            answer.pop("body", None)

        conf = await asyncio.to_thread(tq_backend.fetch_published_conf, dp_cfg.call_timeout_s)
        infos = [conf.controller.zmq_info, *conf.backend.SimpleStorage.zmq_info.values()]
        known = {int(urlsplit(worker).port): "vllm_worker_http"}
        for name, url in (("gate", env.servers.gate_url), ("resources", env.servers.resources_url), ("agent", env.servers.agent_url)):
            known[int(urlsplit(url).port)] = f"gym_{name}"
        for info in infos:
            for port in info.ports.values():
                known[int(port)] = "transfer_queue"
        report["tq_bind_ips"] = sorted({info.ip for info in infos})
        report["sockets"] = listening_sockets(known)
        report["known_ports"] = {str(port): owner for port, owner in known.items()}
        report["token_leaks"] = token_leaks(
            [log_dir, Path(ray_handle.temp_dir)], {"gate_bearer": bearer, "worker_control_token": group.control_token})
    finally:
        urls = (worker if group is not None else None, env.servers.gate_url if env is not None and env.servers.pids() else None)
        if env is not None:
            await env.aclose()
        if group is not None:
            group.shutdown()
        if client is not None:
            client.close()
        if plane is not None:
            plane.shutdown()
        ray_handle.shutdown()
    worker_url, gate_url = urls
    report["after_shutdown"] = {
        "worker": await call("POST", worker_url + "/chat/completions", body=CHAT, timeout_s=10.0) if worker_url else None,
        "gate": await call("POST", gate_url + chat_path("late-1"), body=CHAT, timeout_s=10.0) if gate_url else None,
    }
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", type=Path, required=True)
    started = time.monotonic()
    result = asyncio.run(main(parser.parse_args()))
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(result), flush=True)
