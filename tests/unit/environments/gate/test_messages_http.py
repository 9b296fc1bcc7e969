"""Streamed `/v1/messages` through the real gate in front of the real worker endpoint, read by the `anthropic` client.

The stack of test_guard.py (Gym's `VLLMModel` app with our ledger, normaliser, guard and streamed
paths, over httpx's ASGI transport; our worker's HTTP app over `ChatService` with Gym's capture on
loopback; only the engine is scripted). The real `anthropic` client parses the events, both as a
raw iterator and through its accumulating `messages.stream` helper; the same request unstreamed
(Gym's buffered route) is the reference for the final message.
"""

from __future__ import annotations

import json

import pytest
from anthropic import APIStatusError, AsyncAnthropic

from examples.arith.tiny_model.corpus import tool_call_arguments
from tests.unit.environments.gate.test_guard import BEARER, BEARER_ENV, _close, _stack, tokenizer  # noqa: F401
from tests.unit.environments.gate.test_responses_http import SETTLE_S, SlowEngine, _manifest, leave_mid_stream, until

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
TOOL = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}
TEXT_EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
               "message_stop"]


@pytest.fixture
async def stack(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(BEARER_ENV, BEARER)
    built, worker, svc = await _stack(tokenizer, tmp_path)
    built.svc = svc
    yield built
    await _close(built, worker)


def _client(stack, rollout_id: str) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=f"http://gate/ng-rollout/{rollout_id}/training-token-capture", api_key="k",
                          http_client=stack.gate, max_retries=0)


def _collapsed(kinds: list[str]) -> list[str]:
    """The event kinds with each run of one kind as one (the deltas' count varies with the tokenizer)."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def _without_ids(message) -> dict:
    """The message as JSON without the ids each call mints (its own, its tool_use blocks')."""
    out = message.model_dump(exclude_none=True, exclude={"id"})
    return {**out, "content": [{k: v for k, v in block.items() if k != "id"} for block in out["content"]]}


async def _buffered(stack, rollout_id: str, **kwargs) -> dict:
    """The same request unstreamed (Gym's buffered route), without its ids."""
    return _without_ids(await _client(stack, rollout_id).messages.create(model="tiny", messages=MESSAGES, **kwargs))


async def test_a_streamed_message_arrives_in_deltas_and_is_ledgered_before_message_stop(stack) -> None:
    stream = await _client(stack, "m1").messages.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert _collapsed(kinds) == TEXT_EVENTS
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "text_delta" and e.index == 0 for e in events if e.type == "content_block_delta")
    assert "".join(deltas) == "The answer is 17." and len(deltas) >= 2  # token by token, not one replay
    start = events[0].message
    assert (start.role, start.model, start.content, start.stop_reason) == ("assistant", "tiny", [], None)
    assert events[1].content_block.model_dump(exclude_none=True) == {"type": "text", "text": ""}
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.usage.output_tokens) == ("end_turn", len(stack.engine.ids))
    assert delta.usage.input_tokens == len(stack.engine.prompts[0])
    manifest = await _manifest(stack, "m1")
    [record] = manifest["records"]
    assert manifest["failures"] == [] and record["mode"] == "text" and record["response_id"] == start.id
    assert list(stack.staging.records) == [f"m1/{record['model_call_id']}"]


async def test_the_clients_accumulating_helper_rebuilds_the_buffered_message(stack) -> None:
    async with _client(stack, "m2").messages.stream(model="tiny", messages=MESSAGES, max_tokens=8) as stream:
        texts = [event.text async for event in stream if event.type == "text"]
        final = await stream.get_final_message()
    assert "".join(texts) == final.content[0].text == "The answer is 17."
    assert [r["response_id"] for r in (await _manifest(stack, "m2"))["records"]] == [final.id]
    assert _without_ids(final) == await _buffered(stack, "m2b", max_tokens=8)


async def test_a_streamed_tool_use_carries_its_arguments_as_input_json_deltas(stack, tokenizer) -> None:  # noqa: F811
    call = json.dumps({"name": "calculator", "arguments": json.loads(tool_call_arguments("12 + 5"))})
    stack.engine.ids = tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False) + [
        tokenizer.eos_token_id]
    client = _client(stack, "m3")
    stream = await client.messages.create(model="tiny", messages=MESSAGES, tools=[TOOL], max_tokens=64, stream=True)
    events = [event async for event in stream]
    assert _collapsed([e.type for e in events]) == TEXT_EVENTS
    block = events[1].content_block
    assert (block.type, block.name, block.input) == ("tool_use", "calculator", {})
    pieces = [e.delta for e in events if e.type == "content_block_delta"]
    assert {p.type for p in pieces} == {"input_json_delta"}
    assert json.loads("".join(p.partial_json for p in pieces)) == json.loads(tool_call_arguments("12 + 5"))
    assert events[-2].delta.stop_reason == "tool_use"
    async with client.messages.stream(model="tiny", messages=MESSAGES, tools=[TOOL], max_tokens=64) as helper:
        final = await helper.get_final_message()
    [tool_use] = final.content
    assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "calculator",
                                                               json.loads(tool_call_arguments("12 + 5")))
    assert _without_ids(final) == await _buffered(stack, "m3b", tools=[TOOL], max_tokens=64)
    manifest = await _manifest(stack, "m3")
    assert [r["response_id"] for r in manifest["records"]] == [events[0].message.id, final.id]
    assert manifest["failures"] == []


class CutEngine:
    """The scripted engine, whose stream stops after two tokens without a result (the worker's own error)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate_stream(self, prompt_ids, sampling, request_id):
        steps = 0
        async for step in self._engine.generate_stream(prompt_ids, sampling, request_id):
            if steps == 2:
                return
            steps += 1
            yield step


async def test_a_stream_the_worker_cuts_off_ends_with_an_error_event_and_commits_nothing(stack) -> None:
    stack.svc._engine = CutEngine(stack.svc._engine)
    stream = await _client(stack, "m4").messages.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True)
    events = []
    with pytest.raises(APIStatusError) as raised:
        async for event in stream:
            events.append(event)
    assert _collapsed([e.type for e in events]) == ["message_start", "content_block_start", "content_block_delta"]
    error = raised.value.body
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert error["error"]["message"].startswith("the vLLM worker's stream failed: ")
    assert error["error"]["message"].endswith(": the engine stream ended without a result; not committed")
    manifest = await _manifest(stack, "m4")
    assert manifest["records"] == [] and list(stack.staging.records) == []


async def test_a_client_gone_mid_stream_commits_nothing(stack) -> None:
    stack.svc._engine = SlowEngine(stack.svc._engine)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "stream": True}
    status, streamed = await leave_mid_stream(stack.gate._transport.app,
                                              "/ng-rollout/m5/training-token-capture/v1/messages", body)
    assert status == 200 and streamed.startswith(b"event: message_start\n")
    assert b"message_stop" not in streamed
    assert (await _manifest(stack, "m5"))["records"] == []  # never committed: no chain holds it
    # Off-chain either way: aborted in the worker, or staged and never committed.
    await until(lambda: stack.svc.stats["client_disconnected"] + len(stack.staging.records) > 0, SETTLE_S)
    assert (stack.svc.stats["client_disconnected"], len(stack.staging.records)) in ((1, 0), (0, 1))
