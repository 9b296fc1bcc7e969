"""Streamed `/v1/responses` through the real gate in front of the real worker endpoint, read by the official client.

The stack of test_guard.py (Gym's `VLLMModel` app with our ledger, normaliser, guard and streamed
paths, over httpx's ASGI transport; our worker's HTTP app over `ChatService` with Gym's capture on
loopback; only the engine is scripted). The official `openai` client parses the events, both as a
raw iterator and through its accumulating `responses.stream` helper.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import pytest
from openai import AsyncOpenAI

from examples.arith.tiny_model.corpus import tool_call_arguments
from tests.unit.environments.gate.test_guard import BEARER, BEARER_ENV, _close, _stack, tokenizer  # noqa: F401

INPUT = [{"role": "user", "content": "What is 2 + 2?"}]
TOOL = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}
MANIFEST = "/training-token-capture/control/rollouts/{}/manifest"


@pytest.fixture
async def stack(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(BEARER_ENV, BEARER)
    built, worker, _ = await _stack(tokenizer, tmp_path)
    yield built
    await _close(built, worker)


def _client(stack, rollout_id: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://gate/ng-rollout/{rollout_id}/training-token-capture/v1", api_key="k",
                       http_client=stack.gate, max_retries=0)


async def _manifest(stack, rollout_id: str) -> dict:
    resp = await stack.gate.get(MANIFEST.format(rollout_id), headers={"Authorization": f"Bearer {BEARER}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_a_streamed_responses_call_arrives_in_deltas_and_is_ledgered_before_completed(stack) -> None:
    client = _client(stack, "r1")
    stream = await client.responses.create(model="tiny", input=INPUT, max_output_tokens=8, stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "The answer is 17." and len(deltas) >= 2  # token by token, not one replay
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == "The answer is 17."
    assert final.output[0].id == events[2].item.id and final.usage.output_tokens == len(stack.engine.ids)
    manifest = await _manifest(stack, "r1")
    [record] = manifest["records"]
    assert manifest["failures"] == [] and record["mode"] == "text" and record["response_id"] == final.id
    assert list(stack.staging.records) == [f"r1/{record['model_call_id']}"]
    # The client's next turn (the history it holds, as the Agents SDK sends it) is token-in on the streamed call.
    history = [*INPUT, *[item.model_dump(exclude_none=True) for item in final.output],
               {"role": "user", "content": "And 3 + 3?"}]
    follow = await client.responses.create(model="tiny", input=history, max_output_tokens=8)
    assert follow.output_text == "The answer is 17."
    manifest = await _manifest(stack, "r1")
    assert [(r["mode"], r["parent_call_id"]) for r in manifest["records"]] == [
        ("text", None), ("token_in", record["model_call_id"])]


async def test_the_clients_accumulating_helper_rebuilds_the_same_response(stack) -> None:
    async with _client(stack, "r2").responses.stream(model="tiny", input=INPUT, max_output_tokens=8) as stream:
        texts = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(texts) == final.output_text == "The answer is 17."
    assert [r["response_id"] for r in (await _manifest(stack, "r2"))["records"]] == [final.id]


async def test_a_streamed_tool_call_is_a_function_call_item_with_its_arguments(stack, tokenizer) -> None:  # noqa: F811
    call = json.dumps({"name": "calculator", "arguments": json.loads(tool_call_arguments("12 + 5"))})
    stack.engine.ids = tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False) + [
        tokenizer.eos_token_id]
    client = _client(stack, "r3")
    stream = await client.responses.create(model="tiny", input=INPUT, tools=[TOOL], max_output_tokens=64, stream=True)
    events = [event async for event in stream]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"] and added[0].name == "calculator"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(tool_call_arguments("12 + 5"))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(o.type, o.call_id, o.arguments) for o in final.output] == [("function_call", added[0].call_id, args)]
    manifest = await _manifest(stack, "r3")
    assert [r["response_id"] for r in manifest["records"]] == [final.id] and manifest["failures"] == []


SETTLE_S = 10.0  # far above the slow engine's 8 tokens x 50 ms: a call left mid-stream has ended by then


async def until(condition: Callable[[], bool], timeout_s: float) -> None:
    """Return once `condition()` holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not settled within {timeout_s} s"
        await asyncio.sleep(0.01)


class SlowEngine:
    """The scripted engine, one token every 50 ms (so a client can leave mid-generation)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate_stream(self, prompt_ids, sampling, request_id):
        async for step in self._engine.generate_stream(prompt_ids, sampling, request_id):
            await asyncio.sleep(0.05)
            yield step


async def leave_mid_stream(app, path: str, body: dict) -> tuple[int, bytes]:
    """POST `body` to `path` on the ASGI `app` as a client that reads the first events and goes away
    (the server is told `http.disconnect`); the status and the bytes sent before the app ended."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    first_body = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await first_body.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            first_body.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"gate"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())], "client": ("127.0.0.1", 1),
             "server": ("gate", 80)}
    await asyncio.wait_for(app(scope, receive, send), 30)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_a_client_gone_mid_stream_leaves_an_off_chain_call_never_committed(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(BEARER_ENV, BEARER)
    built, worker, svc = await _stack(tokenizer, tmp_path)
    try:
        svc._engine = SlowEngine(svc._engine)
        body = {"model": "tiny", "input": INPUT, "max_output_tokens": 8, "stream": True}
        status, streamed = await leave_mid_stream(built.gate._transport.app,
                                                  "/ng-rollout/r4/training-token-capture/v1/responses", body)
        assert status == 200 and b"response.created" in streamed
        assert b"response.completed" not in streamed
        manifest = await _manifest(built, "r4")
        assert manifest["records"] == []  # never committed: no chain holds it
        # Off-chain either way: the worker aborted it (`client_disconnected`, nothing staged) or it
        # finished first and its staged row is uncommitted (`staged_not_committed` for the judge).
        await until(lambda: svc.stats["client_disconnected"] + len(built.staging.records) > 0, SETTLE_S)
        assert (svc.stats["client_disconnected"], len(built.staging.records)) in ((1, 0), (0, 1)), dict(svc.stats)
    finally:
        await _close(built, worker)
