"""The chained task's resources server, in-process: a seeded session walks its chain; rows are checked.

The app is built as Gym's `run_webserver` builds it and driven through httpx's ASGI transport;
one client keeps the session cookie, as the agent does across one rollout.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.exceptions import RequestValidationError
from omegaconf import OmegaConf

from examples.arith.chain import Chain, build_chain_row
from examples.arith.chain_resources import ChainResourcesServer, call_counts, rollout_stats
from examples.arith.gym_task import CHAIN_RESOURCES_SERVER as CHAIN
from examples.arith.resources import ArithResourcesServerConfig
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import ServerClient, _validation_exception_handler, get_first_server_config_dict
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.environments.task import RowSampling

CHAIN_3 = Chain(start=7, links=(("+", 2), ("*", 3), ("-", 9)))
ROW = build_chain_row(CHAIN_3, RowSampling(temperature=1.0, top_p=1.0, max_output_tokens=48))


def _app():
    config = launch.build_global_config(NemoGymConfig(), worker_base_url="http://127.0.0.1:9/v1",
                                        ports=launch.ServerPorts(1001, 1002, 1003), capture=None, resources_server=CHAIN)
    global_config = OmegaConf.create(config)
    block = OmegaConf.to_container(get_first_server_config_dict(global_config, CHAIN.name), resolve=True)
    server = ChainResourcesServer(
        config=ArithResourcesServerConfig.model_validate(block | {"name": CHAIN.name}),
        server_client=ServerClient(head_server_config=BaseServerConfig.model_validate(config["head_server"]),
                                   global_config_dict=global_config),
    )
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    server.setup_cancellation_middleware(app)
    app.exception_handler(RequestValidationError)(_validation_exception_handler)
    return app


def _call(i: int, expression: str) -> list[dict]:
    args = json.dumps({"expression": expression})
    return [{"type": "function_call", "call_id": f"c{i}", "name": "calculator", "arguments": args, "id": f"fc{i}"},
            {"type": "function_call_output", "call_id": f"c{i}", "output": "..."}]


def _response(output: list[dict]) -> dict:
    return {"id": "resp_1", "created_at": 1, "model": "tiny", "object": "response", "output": output,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


FINAL = {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
         "content": [{"type": "output_text", "text": "The answer is 18.", "annotations": []}]}


async def test_a_seeded_rollout_walks_its_chain_and_verify_logs_its_calls(capsys: pytest.CaptureFixture) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://res") as client:
        assert (await client.post("/seed_session", json=ROW)).status_code == 200
        texts = [(await client.post("/calculator", json={"expression": e})).text
                 for e in ("7 + 2", "9 ** 3", "9 * 3", "27 - 9")]
        assert texts[0] == "9 (next: * 3)" and texts[1].startswith("error: ")
        assert texts[2:] == ["27 (next: - 9)", "18 (done)"]
        output = [item for i, e in enumerate(CHAIN_3.expressions()) for item in _call(i, e)] + [FINAL]
        verified = await client.post("/verify", json=ROW | {"response": _response(output)})
    body = verified.json()
    assert verified.status_code == 200, verified.text
    assert (body["reward"], body["tool_calls"], body["model_calls"], body["final_text"]) == (1.0, 3, 4, "The answer is 18.")
    (record,) = rollout_stats(capsys.readouterr().out.splitlines())
    assert {k: v for k, v in record.items() if k != "seconds"} == {"calls": 3, "model_calls": 4, "reward": 1.0, "tool_calls": 3}
    assert 0.0 <= record["seconds"] < 60.0


async def test_sessions_are_per_rollout_and_an_unseeded_calculator_is_plain() -> None:
    app = _app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://res") as a, \
            httpx.AsyncClient(transport=transport, base_url="http://res") as b:
        await a.post("/seed_session", json=ROW)
        assert (await a.post("/calculator", json={"expression": "7 + 2"})).text == "9 (next: * 3)"
        assert (await b.post("/calculator", json={"expression": "7 + 2"})).text == "9"
        assert (await a.post("/calculator", json={"expression": "9 * 3"})).text == "27 (next: - 9)"


async def test_a_corrupt_row_is_refused_naming_the_field() -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://res") as client:
        seeded = await client.post("/seed_session", json=ROW | {"answer": 19})
        verified = await client.post("/verify", json=ROW | {"chain_links": [["+", 200]], "response": _response([])})
        missing = await client.post("/seed_session", json={k: v for k, v in ROW.items() if k != "chain_start"})
    assert seeded.status_code == 422 and seeded.json()["detail"][0]["loc"] == ["body", "chain_links"]
    assert "answer=19 but its chain evaluates to 18" in seeded.json()["detail"][0]["msg"]
    assert verified.status_code == 422 and "not a valid chain" in verified.json()["detail"][0]["msg"]
    assert missing.status_code == 422 and ["body", "chain_start"] in [d["loc"] for d in missing.json()["detail"]]


def test_call_counts_count_model_turns_between_tool_results() -> None:
    assert call_counts([]) == (0, 0)
    assert call_counts([FINAL]) == (0, 1)
    assert call_counts(_call(0, "1 + 1")) == (1, 1)  # cut off by max steps after a tool result
    assert call_counts(_call(0, "1 + 1") + _call(1, "2 + 1") + [FINAL]) == (2, 3)
    two_in_one = [_call(0, "1 + 1")[0], _call(1, "2 + 1")[0], _call(0, "")[1], _call(1, "")[1], FINAL]
    assert call_counts(two_in_one) == (2, 2)


def test_rollout_stats_reads_the_server_log_lines() -> None:
    lines = ["(arith_chain_resources) INFO: started",
             '(arith_chain_resources) chain_rollout {"calls": 2, "model_calls": 3, "reward": 1.0, "seconds": 0.5, "tool_calls": 2}']
    assert rollout_stats(lines) == [{"calls": 2, "model_calls": 3, "reward": 1.0, "seconds": 0.5, "tool_calls": 2}]
