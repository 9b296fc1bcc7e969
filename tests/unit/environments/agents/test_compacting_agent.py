"""The compacting agent: its pure compaction function, its episode loop, and the agent as a process.

The loop test drives `CompactingAgent._create_episode` in-process with a scripted stand-in for
Gym's ServerClient (two calculator calls, then an answer) at thresholds 1 and 2. The process test starts
`python -m nemo_rl.environments.agents.compacting_agent` (one process, capture wiring on) with the
global config `nemo_gym_launch.build_global_config` writes (its agent entry moved under
`compacting_agent`) and runs `/run` once without and once with a rollout id. The config points
at two fakes served here on 127.0.0.1: a model server answering `/v1/responses` (a calculator
function_call, then a final message) and a resources server (`/seed_session`, `/calculator`,
`/verify` with a fixed reward).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from examples.arith.gym_task import RESOURCES_SERVER as ARITH
from examples.arith.rows import build_row
from examples.arith.task import SYSTEM_PROMPT, Problem, user_prompt
from nemo_gym.openai_utils import (
    NeMoGymEasyInputMessage,
    NeMoGymFunctionCallOutput,
    NeMoGymResponseCreateParamsNonStreaming,
    NeMoGymResponseFunctionToolCall,
    NeMoGymResponseOutputMessage,
    NeMoGymResponseOutputText,
)
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.agents.compacting_agent import CompactingAgent, CompactingAgentConfig, compact_history
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.environments.task import RowSampling

PROBLEM = Problem(expression="12 + 5 * 3", answer=27)
ARGS = json.dumps({"expression": PROBLEM.expression})
SUMMARY_27 = f"Summary of the work so far: you called calculator({ARGS}) and it returned 27. Continue."
FAKE_REWARD = 0.75
AGENT_MODULE = "nemo_rl.environments.agents.compacting_agent"


def _dump(items: list[Any]) -> list[dict]:
    return [item.model_dump(exclude_unset=True) for item in items]


def test_compact_history_keeps_the_prompt_and_summarises_the_tool_calls() -> None:
    original = [
        NeMoGymEasyInputMessage(role="system", content="sys"),
        NeMoGymEasyInputMessage(role="developer", content="dev"),
        NeMoGymEasyInputMessage(role="assistant", content="an earlier assistant turn"),
        NeMoGymEasyInputMessage(role="user", content="What is 12 + 5 * 3?"),
    ]
    history = [
        NeMoGymResponseOutputMessage(
            id="msg_0", content=[NeMoGymResponseOutputText(text="Let me compute.", annotations=[])]
        ),
        NeMoGymResponseFunctionToolCall(call_id="c1", name="calculator", arguments=ARGS),
        NeMoGymFunctionCallOutput(call_id="c1", output="27"),
        NeMoGymResponseFunctionToolCall(call_id="c2", name="calculator", arguments='{"expression": "27 - 1"}'),
        NeMoGymFunctionCallOutput(call_id="c2", output="26"),
        NeMoGymResponseFunctionToolCall(call_id="c3", name="lookup", arguments="{}"),  # no output yet
    ]
    compacted = compact_history(original, history)
    assert _dump(compacted) == [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "What is 12 + 5 * 3?"},
        {
            "role": "user",
            "content": (
                f"Summary of the work so far: you called calculator({ARGS}) and it returned 27; "
                'then you called calculator({"expression": "27 - 1"}) and it returned 26; '
                "then you called lookup({}) and it returned no result. Continue."
            ),
        },
    ]
    assert compacted[0] is original[0]  # kept items are the originals, untouched
    # Dict items (as a client would send them) compact the same way.
    as_dicts = compact_history(_dump(original), [item.model_dump() for item in history[1:3]])
    assert as_dicts[:3] == _dump([original[0], original[1], original[3]])
    assert as_dicts[3].model_dump(exclude_unset=True) == {"role": "user", "content": SUMMARY_27}


def test_config_defaults_and_rejects_a_zero_threshold() -> None:
    base = {
        "name": "a",
        "host": "127.0.0.1",
        "port": 1,
        "entrypoint": "app.py",
        "model_server": {"type": "responses_api_models", "name": "m"},
    }
    assert CompactingAgentConfig.model_validate(base).compact_after_tool_results == 1
    with pytest.raises(ValueError):
        CompactingAgentConfig.model_validate(base | {"compact_after_tool_results": 0})


class _Reply:
    """The parts of aiohttp's ClientResponse that the agent and Gym's helpers read."""

    def __init__(self, payload: Any) -> None:
        self._bytes = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.ok, self.status, self.cookies = True, 200, {}
        self.content = self

    async def read(self) -> bytes:
        return self._bytes


class ScriptedClient:
    """Stands in for Gym's ServerClient: the model calls the calculator twice, then answers."""

    def __init__(self) -> None:
        self.model_inputs: list[list[dict]] = []
        self.tool_calls: list[tuple[str, dict]] = []

    async def post(self, server_name: str, url_path: str, json: Any, cookies: Any = None) -> _Reply:
        if server_name == "resources":
            self.tool_calls.append((url_path, json))
            return _Reply(str(len(self.tool_calls) * 10))
        self.model_inputs.append(json.model_dump(exclude_unset=True)["input"])
        n = len(self.model_inputs)
        if n <= 2:
            item = {"type": "function_call", "call_id": f"c{n}", "name": "calculator",
                    "arguments": f'{{"expression": "{n} + {n}"}}'}
        else:
            item = {"type": "message", "id": "m", "role": "assistant",
                    "content": [{"type": "output_text", "text": "The answer is 20.", "annotations": []}]}
        return _Reply(_response(f"resp_{n}", [item]))


def _summary(*pairs: tuple[int, str]) -> dict:
    said = "; then ".join(
        f'you called calculator({{"expression": "{n} + {n}"}}) and it returned {out}' for n, out in pairs
    )
    return {"role": "user", "content": f"Summary of the work so far: {said}. Continue."}


@pytest.mark.parametrize("every", [1, 2])
async def test_episode_loop_compacts_after_every_n_tool_results(every: int) -> None:
    config = CompactingAgentConfig(
        name="agent", host="127.0.0.1", port=1, entrypoint="app.py", compact_after_tool_results=every,
        resources_server={"type": "resources_servers", "name": "resources"},
        model_server={"type": "responses_api_models", "name": "model"}, max_steps=10,
    )
    client = ScriptedClient()
    agent = CompactingAgent.model_construct(config=config, server_client=client)
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    body = NeMoGymResponseCreateParamsNonStreaming.model_validate({"input": prompt})
    response, trajectory, _, _ = await agent._create_episode(body, model_url_path="/v1/responses")

    call1 = {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"expression": "1 + 1"}'}
    out1 = {"type": "function_call_output", "call_id": "c1", "output": "10"}
    if every == 1:
        expected_second = [*prompt, _summary((1, "10"))]
    else:
        expected_second = [*prompt, call1, out1]  # below the threshold: simple_agent's history
    assert client.model_inputs == [prompt, expected_second, [*prompt, _summary((1, "10"), (2, "20"))]]
    assert client.tool_calls == [("/calculator", {"expression": "1 + 1"}), ("/calculator", {"expression": "2 + 2"})]
    assert trajectory is None
    assert response.id == "resp_3"
    assert [item.type for item in response.output] == ["function_call", "function_call_output"] * 2 + ["message"]


# --- the process test -------------------------------------------------------------------------


def _response(response_id: str, output: list[dict]) -> dict:
    return {
        "id": response_id,
        "created_at": time.time(),
        "model": "fake",
        "object": "response",
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


class Fakes:
    def __init__(self) -> None:
        self.model_requests: list[tuple[str, dict]] = []
        self.tool_requests: list[tuple[dict, dict]] = []
        self.verify_requests: list[dict] = []
        self.runners: list[web.AppRunner] = []

    def reset(self) -> None:
        self.model_requests.clear()
        self.tool_requests.clear()
        self.verify_requests.clear()

    async def responses(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.model_requests.append((request.path, body))
        n = len(self.model_requests)
        if n == 1:
            output = [
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "calculator",
                 "arguments": ARGS, "status": "completed"}
            ]
        else:
            output = [
                {"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "The answer is 27.", "annotations": []}]}
            ]
        return web.json_response(_response(f"resp_{n}", output))

    async def seed_session(self, request: web.Request) -> web.Response:
        response = web.json_response({})
        response.set_cookie("fake_session", "s1")
        return response

    async def calculator(self, request: web.Request) -> web.Response:
        self.tool_requests.append((await request.json(), dict(request.cookies)))
        return web.Response(text="27")

    async def verify(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.verify_requests.append(body)
        return web.json_response({**body, "reward": FAKE_REWARD})

    async def serve(self, routes: list[tuple[str, Any]]) -> int:
        app = web.Application()
        for path, handler in routes:
            app.router.add_post(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.runners.append(runner)
        return runner.addresses[0][1]


async def _wait_healthy(proc, url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"agent exited with {proc.returncode}:\n{launch.read_log_tail(log_path, 40)}")
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise AssertionError(f"agent not healthy within {timeout_s}s:\n{launch.read_log_tail(log_path, 40)}")


def _check_run(fakes: Fakes, result: dict, expected_path: str) -> None:
    # Routing is simple_agent's: the (capture) path reaches the model server unchanged.
    assert [path for path, _ in fakes.model_requests] == [expected_path, expected_path]
    first, second = (body for _, body in fakes.model_requests)
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(PROBLEM)}]
    strip = lambda items: [{k: v for k, v in item.items() if k != "type"} for item in items]  # noqa: E731
    assert strip(first["input"]) == prompt
    # The second call carries the compacted conversation: no function_call / output items.
    assert strip(second["input"]) == [*prompt, {"role": "user", "content": SUMMARY_27}]
    assert not [item for item in second["input"] if item.get("type") in ("function_call", "function_call_output")]
    assert second["tools"] == first["tools"] and second["temperature"] == 1.0
    # The tool ran on the resources server with the seeded session cookie.
    assert fakes.tool_requests == [({"expression": PROBLEM.expression}, {"fake_session": "s1"})]

    # /run returns the fake verify's reward and the last model response (its id is the witness).
    assert result["reward"] == FAKE_REWARD
    assert result["response"]["id"] == "resp_2"
    output = result["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    assert output[-1]["content"][0]["text"] == "The answer is 27."
    (verify_body,) = fakes.verify_requests
    assert verify_body["response"]["id"] == "resp_2"
    assert (verify_body["expression"], verify_body["answer"]) == (PROBLEM.expression, PROBLEM.answer)
    sent = verify_body["responses_create_params"]["input"]
    assert [(item["role"], item["content"]) for item in sent] == [(item["role"], item["content"]) for item in prompt]


@pytest.mark.stand_in_worker
async def test_agent_process_compacts_before_the_second_model_call(tmp_path: Path) -> None:
    """One agent process with capture wiring; a run without a rollout id, then one with."""
    fakes = Fakes()
    model_port = await fakes.serve(
        [
            ("/v1/responses", fakes.responses),
            ("/ng-rollout/{rollout_id}/v1/responses", fakes.responses),
            ("/ng-rollout/{rollout_id}/training-token-capture/v1/responses", fakes.responses),
        ]
    )
    resources_port = await fakes.serve(
        [("/seed_session", fakes.seed_session), ("/calculator", fakes.calculator), ("/verify", fakes.verify)]
    )
    (agent_port,) = launch.pick_free_ports(1)
    ports = launch.ServerPorts(gate=model_port, resources=resources_port, agent=agent_port)
    wiring = launch.CaptureWiring(tmp_path / "ledger", "FAKE_CONTROL_TOKEN")
    config = launch.build_global_config(
        NemoGymConfig(), worker_base_url="http://127.0.0.1:9/v1", ports=ports, capture=wiring, resources_server=ARITH
    )
    (agent_entry,) = config[ARITH.agent_name]["responses_api_agents"].values()
    assert agent_entry["token_id_capture"] is True
    config[ARITH.agent_name] = {
        "responses_api_agents": {"compacting_agent": agent_entry | {"compact_after_tool_results": 1}}
    }
    spec = launch.ServerSpec(ARITH.agent_name, AGENT_MODULE, agent_port)
    log_path = tmp_path / "agent.log"
    env = launch.server_env(
        dict(os.environ),
        config_json=json.dumps(config),
        spec=spec,
        import_root=Path(__file__).resolve().parents[4],
        extra={},
    )
    proc = launch.start_server(spec, python=sys.executable, env=env, cwd=tmp_path, log_path=log_path)
    agent_url = f"http://127.0.0.1:{agent_port}"
    row = build_row(PROBLEM, RowSampling(temperature=1.0, top_p=1.0, max_output_tokens=64))
    runs = [
        (row, "/v1/responses"),
        (row | {"_ng_rollout_id": "r-compact-0"}, "/ng-rollout/r-compact-0/training-token-capture/v1/responses"),
    ]
    try:
        await _wait_healthy(proc, agent_url, log_path, timeout_s=30)
        async with aiohttp.ClientSession() as session:
            for body, expected_path in runs:
                fakes.reset()
                async with session.post(
                    f"{agent_url}/run", json=body, timeout=aiohttp.ClientTimeout(total=20)
                ) as resp:
                    status, text = resp.status, await resp.text()
                assert status == 200, f"{text}\n{launch.read_log_tail(log_path, 40)}"
                _check_run(fakes, json.loads(text), expected_path)
    finally:
        launch.terminate_processes({"agent": proc}, timeout_s=5)
        for runner in fakes.runners:
            await runner.cleanup()
    assert proc.poll() is not None
