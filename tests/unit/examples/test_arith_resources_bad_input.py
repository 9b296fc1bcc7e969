"""Bad input at our resources server: every case is a 4xx naming the field, never a 5xx.

The app is built in-process as Gym's `run_webserver` builds it (our `ArithResourcesServer` on
Gym's `SimpleResourcesServer`, Gym's exception middleware and validation handler) and driven
through httpx's ASGI transport.
"""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from examples.arith.gym_task import RESOURCES_SERVER as ARITH
from examples.arith.resources import ArithResourcesServer, ArithResourcesServerConfig
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import ServerClient, _validation_exception_handler, get_first_server_config_dict
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.nemo_gym_config import NemoGymConfig

RESPONSE = {"id": "resp_1", "created_at": 1, "model": "tiny", "object": "response", "output": [],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
VERIFY = {"responses_create_params": {"input": []}, "response": RESPONSE, "expression": "1 + 1", "answer": 2}


def _app(max_body_bytes: int = 64 * 1024):
    config = launch.build_global_config(NemoGymConfig(), worker_base_url="http://127.0.0.1:9/v1",
                                        ports=launch.ServerPorts(1001, 1002, 1003), capture=None, resources_server=ARITH)
    config[ARITH.name]["resources_servers"]["arith"]["max_body_bytes"] = max_body_bytes
    global_config = OmegaConf.create(config)
    block = OmegaConf.to_container(get_first_server_config_dict(global_config, ARITH.name), resolve=True)
    server = ArithResourcesServer(
        config=ArithResourcesServerConfig.model_validate(block | {"name": ARITH.name}),
        server_client=ServerClient(head_server_config=BaseServerConfig.model_validate(config["head_server"]),
                                   global_config_dict=global_config),
    )
    # The same steps as Gym's run_webserver.
    app = server.setup_webserver()
    server.setup_liveness(app)
    server.setup_exception_middleware(app)
    server.setup_cancellation_middleware(app)
    app.exception_handler(RequestValidationError)(_validation_exception_handler)
    return app


@pytest.fixture(scope="module")
def app():
    return _app()


async def _post(app, path: str, raw: bytes) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://res") as client:
        return await client.post(path, content=raw, headers={"Content-Type": "application/json"})


def _locs(resp: httpx.Response) -> list[list]:
    return [item["loc"] for item in resp.json()["detail"]]


@pytest.mark.parametrize(
    ("path", "raw", "status", "locs"),
    [
        ("/calculator", b"{bad", 422, [["body", 1]]),
        ("/calculator", b'{"expression": 5}', 422, [["body", "expression"]]),
        ("/calculator", b"{}", 422, [["body", "expression"]]),
        ("/calculator", b'{"expression": "1+1", "extra": 1}', 422, [["body", "extra"]]),
        ("/verify", b"{bad", 422, [["body", 1]]),
        ("/verify", json.dumps({**VERIFY, "answer": "two"}).encode(), 422, [["body", "answer"]]),
        ("/verify", json.dumps({k: v for k, v in VERIFY.items() if k != "expression"}).encode(), 422, [["body", "expression"]]),
        ("/verify", json.dumps({**VERIFY, "answer": 3}).encode(), 422, [["body", "answer"]]),
    ],
    ids=["calc-malformed", "calc-wrong-type", "calc-missing", "calc-extra", "verify-malformed", "verify-wrong-type",
         "verify-missing", "verify-ground-truth-mismatch"],
)
async def test_bad_requests_are_422_naming_the_field(app, path: str, raw: bytes, status: int, locs: list) -> None:
    resp = await _post(app, path, raw)
    assert (resp.status_code, _locs(resp)) == (status, locs)


async def test_a_ground_truth_mismatch_says_what_disagrees(app) -> None:
    resp = await _post(app, "/verify", json.dumps({**VERIFY, "answer": 3}).encode())
    assert resp.json()["detail"][0]["msg"].startswith("dataset row has expression='1 + 1' and answer=3, which do not agree")


async def test_good_requests_are_served(app) -> None:
    assert (await _post(app, "/calculator", b'{"expression": "12 + 5"}')).text == "17"
    verified = await _post(app, "/verify", json.dumps(VERIFY).encode())
    assert verified.status_code == 200 and verified.json()["reward"] == 0.0


async def test_an_oversized_body_is_413_before_it_is_parsed() -> None:
    resp = await _post(_app(max_body_bytes=2048), "/calculator", json.dumps({"expression": "1" * 5000}).encode())
    assert resp.status_code == 413
    assert resp.json()["error"] == {"message": "request body exceeds 2048 bytes (arith_resources.max_body_bytes)",
                                    "type": "request_too_large", "param": "body", "code": 413}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=120, deadline=None)
@given(path=st.sampled_from(["/calculator", "/verify", "/seed_session", "/close_session"]),
       body=st.one_of(st.binary(max_size=40).map(lambda b: ("raw", b)),
                      st.dictionaries(st.sampled_from(["expression", "answer", "response", "responses_create_params", "x"]),
                                      JSON, max_size=4).map(lambda d: ("json", d)),
                      JSON.map(lambda d: ("json", d)),
                      st.fixed_dictionaries({"expression": st.text(max_size=300)}).map(lambda d: ("json", d))))
def _fuzzed_request_is_never_a_5xx(app, statuses: list[int], path: str, body: tuple) -> None:
    kind, value = body
    raw = value if kind == "raw" else json.dumps(value).encode()
    resp = asyncio.run(_post(app, path, raw))
    statuses.append(resp.status_code)
    assert resp.status_code < 500, (resp.status_code, resp.text[:400], path, raw[:200])
    if resp.status_code == 422:
        assert all(item["loc"] for item in resp.json()["detail"])


def test_fuzzed_requests_never_get_a_5xx_and_reach_served_and_refused(app) -> None:
    statuses: list[int] = []
    _fuzzed_request_is_never_a_5xx(app, statuses)
    # The examples were served (200), refused as malformed (400) and refused naming a field (422):
    # "no 5xx" was shown on each outcome, not on one kind of refusal alone.
    assert {200, 400, 422} <= set(statuses), collections.Counter(statuses)
