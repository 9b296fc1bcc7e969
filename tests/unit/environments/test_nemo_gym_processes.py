"""Real-process tests: Gym's gate, our arith resources server and Gym's simple agent on loopback.

The worker is a stand-in chat-completions server written here (aiohttp, 127.0.0.1, port 0):
turn 1 answers a calculator tool call for the expression in the user message, turn 2 (after the
tool result) answers `The answer is <tool result>.`. Token ids are the UTF-8 bytes of the
rendered text, logprobs a constant. In capture mode it uses Gym's own worker capture
(`RolloutTokenCapture` + `VLLMCaptureAdapter`) over an in-memory staging sink, so the gate gets
real `ng_commit_coords` and writes a real ledger.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from examples.arith.gym_task import RESOURCES_SERVER as ARITH
from examples.arith.rows import build_row
from examples.arith.task import Problem, final_answer_text
from nemo_gym.token_id_capture.adapters.vllm import VLLMCaptureAdapter
from nemo_gym.token_id_capture.staging.capture import RolloutTokenCapture
from nemo_gym.token_id_capture.staging.records import (
    CaptureAdmission,
    StagedCallRecord,
    StageResult,
    staging_key,
)
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gym_client import NemoGymEnvironment
from nemo_rl.environments.nemo_gym_config import GymServerStartError, ManifestError, NemoGymConfig
from nemo_rl.environments.task import RowSampling
from nemo_rl.token_capture.config import TokenCaptureConfig

pytestmark = pytest.mark.stand_in_worker

PROBLEM = Problem(expression="12 + 5 * 3", answer=27)
SAMPLING = RowSampling(temperature=1.0, top_p=1.0, max_output_tokens=64)
WEIGHT_VERSION = 3
_EXPR_RE = re.compile(r"What is (.+)\?")


class MemoryStagingSink:
    """StagingSink over a dict (one worker process, so no shared store is needed)."""

    def __init__(self) -> None:
        self.records: dict[str, StagedCallRecord] = {}
        self._lock = threading.Lock()

    def stage(self, record: StagedCallRecord, *, attachments: Any = None) -> StageResult:
        key = staging_key(record.rollout_id, record.model_call_id)
        with self._lock:
            self.records[key] = record
        return StageResult(ok=True, staging_key=key)


def _render(messages: list[dict]) -> list[int]:
    return list(json.dumps(messages, sort_keys=True).encode())


def _gen_ids(text: str) -> list[int]:
    return list(text.encode())


@dataclass
class StandInWorker:
    capture: RolloutTokenCapture | None
    sink: MemoryStagingSink | None
    requests: list[dict] = field(default_factory=list)
    port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _prompt_ids(self, body: dict, admission: CaptureAdmission | None) -> tuple[list[int], list[int] | None]:
        if admission is None or admission.mode == "text":
            return _render(body["messages"]), None
        prefix: list[int] = []
        for key in admission.staging_chain:
            prefix += self.sink.records[key].token_ids_delta
        # Only what follows the last assistant turn is new; the prefix is reused verbatim.
        last_assistant = max(i for i, m in enumerate(body["messages"]) if m["role"] == "assistant")
        return prefix + _render(body["messages"][last_assistant + 1 :]), prefix

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        messages = body["messages"]
        if messages[-1]["role"] == "tool":
            text = final_answer_text(int(messages[-1]["content"]))
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = "stop"
        else:
            expression = _EXPR_RE.search(messages[-1]["content"]).group(1)
            arguments = json.dumps({"expression": expression})
            text = f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{uuid.uuid4().hex[:12]}",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": arguments},
                    }
                ],
            }
            finish = "tool_calls"
        admission = CaptureAdmission.model_validate(body["ng_capture"]) if "ng_capture" in body else None
        prompt_ids, prefix = self._prompt_ids(body, admission)
        gen_ids = _gen_ids(text)
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "prompt_token_ids": prompt_ids,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "token_ids": gen_ids,
                    "logprobs": {
                        "content": [
                            {"token": f"token_id:{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []}
                            for t in gen_ids
                        ]
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(gen_ids),
                "total_tokens": len(prompt_ids) + len(gen_ids),
            },
        }
        if admission is not None:
            call = self.capture.begin_call(admission, prefix_token_ids=prefix)
            coords = self.capture.complete_call_from_response(call, response)
            response["ng_commit_coords"] = coords.model_dump(mode="json")
        return web.json_response(response)


async def _model_list(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "max_model_len": 2048}]})


async def _serve(worker: StandInWorker) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", worker.chat)
    # Our capture gate reads the context limit from the worker's model list before admitting calls.
    app.router.add_get("/v1/models", _model_list)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    worker.port = runner.addresses[0][1]
    return runner


def _env(worker: StandInWorker, log_dir: Path, capture: bool, **cfg: Any) -> NemoGymEnvironment:
    return NemoGymEnvironment(
        NemoGymConfig(**cfg),
        TokenCaptureConfig(enabled=capture),
        worker_base_url=worker.base_url,
        log_dir=log_dir,
    )


async def test_legacy_run_rewards_the_tool_answer_with_token_echo(tmp_path: Path) -> None:
    worker = StandInWorker(capture=None, sink=None)
    runner = await _serve(worker)
    env = _env(worker, tmp_path, capture=False)
    try:
        await env.start()
        t0 = time.monotonic()
        result = await env.run(None, build_row(PROBLEM, SAMPLING))
        run_s = time.monotonic() - t0
        wrong = json.loads(json.dumps(result["response"]))
        wrong["output"][-1]["content"][0]["text"] = "The answer is 26."
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{env.servers.resources_url}/calculator", json={"expression": "7 / 0"}) as resp:
                calc_status, calc_text = resp.status, await resp.text()
            verify_wrong = {**build_row(PROBLEM, SAMPLING), "response": wrong}
            async with session.post(f"{env.servers.resources_url}/verify", json=verify_wrong) as resp:
                wrong_status, wrong_json = resp.status, await resp.json()
            corrupt_row = {**build_row(PROBLEM, SAMPLING), "answer": 28, "response": result["response"]}
            async with session.post(f"{env.servers.resources_url}/verify", json=corrupt_row) as resp:
                corrupt_status, corrupt_text = resp.status, await resp.text()
    finally:
        await env.aclose()
        await runner.cleanup()
    print(f"legacy: startup {env.servers.startup_seconds:.2f}s, one rollout {run_s:.3f}s")
    assert result["reward"] == 1.0
    assert result["final_text"] == "The answer is 27."
    assert (result["expression"], result["answer"]) == (PROBLEM.expression, PROBLEM.answer)
    assert len(worker.requests) == 2
    assert all("ng_capture" not in body for body in worker.requests)
    assert all(body["logprobs"] is True and body["return_tokens_as_token_ids"] is True for body in worker.requests)
    assert worker.requests[0]["temperature"] == 1.0 and worker.requests[0]["max_tokens"] == 64
    assert worker.requests[1]["messages"][-1] == {
        "role": "tool",
        "content": "27",
        "tool_call_id": worker.requests[1]["messages"][-2]["tool_calls"][0]["id"],
    }
    output = result["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    assert output[1]["output"] == "27"
    assert output[2]["generation_token_ids"] == _gen_ids("The answer is 27.")
    assert output[2]["generation_log_probs"] == [-0.5] * len("The answer is 27.")
    assert output[2]["prompt_token_ids"] == _render(worker.requests[1]["messages"])
    assert (calc_status, calc_text) == (200, "error: calculator: unexpected character at 1 in expression '7 / 0'")
    assert (wrong_status, wrong_json["reward"], wrong_json["final_text"]) == (200, 0.25, "The answer is 26.")  # partial credit 0.5/(1+|26-27|)
    # Ground truth that disagrees with the expression is the caller's bad input: a 422 naming it.
    assert corrupt_status == 422 and "answer" in corrupt_text


async def test_capture_run_stages_both_turns_and_serves_the_manifest(tmp_path: Path) -> None:
    sink = MemoryStagingSink()
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: WEIGHT_VERSION, adapter=VLLMCaptureAdapter())
    worker = StandInWorker(capture=capture, sink=sink)
    runner = await _serve(worker)
    env = _env(worker, tmp_path, capture=True)
    try:
        await env.start()
        t0 = time.monotonic()
        result = await env.run("r1-step0-g0-i0-a0", build_row(PROBLEM, SAMPLING))
        run_s = time.monotonic() - t0
        manifest = await env.manifest("r1-step0-g0-i0-a0")
        unknown = await env.manifest("never-ran")
        env.servers._bearer = "wrong-bearer"
        with pytest.raises(ManifestError, match="HTTP 401") as raised:
            await env.manifest("r1-step0-g0-i0-a0")
        assert raised.value.kind == "auth"
    finally:
        await env.aclose()
        await runner.cleanup()
    print(f"capture: startup {env.servers.startup_seconds:.2f}s, one rollout {run_s:.3f}s")
    assert result["reward"] == 1.0
    admissions = [CaptureAdmission.model_validate(body["ng_capture"]) for body in worker.requests]
    assert [a.mode for a in admissions] == ["text", "token_in"]
    root, child = admissions
    assert child.parent_call_id == root.model_call_id
    assert child.staging_chain == [f"r1-step0-g0-i0-a0/{root.model_call_id}"]
    assert all(body["stream"] is False for body in worker.requests)
    assert [r.model_call_id for r in manifest.records] == [root.model_call_id, child.model_call_id]
    assert [r.mode for r in manifest.records] == ["text", "token_in"]
    assert manifest.failures == []
    assert manifest.records[1].response_id == result["response"]["id"]
    assert manifest.records[1].weight_version == WEIGHT_VERSION
    assert (unknown.rollout_id, unknown.records, unknown.failures) == ("never-ran", [], [])
    ledger_before = sorted(p.name for p in env.ledger_dir.iterdir())
    assert "r1-step0-g0-i0-a0.lineage.jsonl" in ledger_before
    removed = env.retire(["r1-step0-g0-i0-a0"])
    assert {p.name for p in removed} >= {
        "r1-step0-g0-i0-a0.lineage.jsonl",
        "r1-step0-g0-i0-a0.tokens.intents",
        "r1-step0-g0-i0-a0.tokens.lock",
    }
    assert sorted(p.name for p in env.ledger_dir.iterdir()) == ["never-ran.tokens.lock"]


async def test_start_failure_names_the_server_and_quotes_its_log(tmp_path: Path, monkeypatch) -> None:
    def broken_specs(
        ports: launch.ServerPorts,
        capture: launch.CaptureWiring | None = None,
        agent: str = "simple_agent",
        resources_server: launch.ResourcesServer = ARITH,
    ) -> tuple[launch.ServerSpec, ...]:
        return (launch.ServerSpec(launch.GATE, "nemo_rl.environments.no_such_module", ports.gate),)

    monkeypatch.setattr(launch, "server_specs", broken_specs)
    env = NemoGymEnvironment(
        NemoGymConfig(),
        TokenCaptureConfig(enabled=False),
        worker_base_url="http://127.0.0.1:9/v1",
        log_dir=tmp_path,
    )
    with pytest.raises(GymServerStartError, match="exited with code 1") as info:
        await env.start()
    assert info.value.server == launch.GATE
    assert "No module named nemo_rl.environments.no_such_module" in info.value.log_tail


async def test_start_timeout_stops_the_started_servers(tmp_path: Path) -> None:
    env = NemoGymEnvironment(
        NemoGymConfig(startup_timeout_s=0.3, stop_timeout_s=5.0),
        TokenCaptureConfig(enabled=False),
        worker_base_url="http://127.0.0.1:9/v1",
        log_dir=tmp_path,
    )
    with pytest.raises(GymServerStartError, match="within startup_timeout_s=0.3"):
        await env.start()
    assert env.servers._procs == {}


def test_terminate_escalates_to_sigkill_only_for_our_process() -> None:
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    stubborn.stdout.readline()  # SIGTERM is ignored from here on
    codes = launch.terminate_processes({"stubborn": stubborn, "polite": polite}, timeout_s=0.5)
    stubborn.stdout.close()
    assert codes == {"stubborn": -signal.SIGKILL, "polite": -signal.SIGTERM}
