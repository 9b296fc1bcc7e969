"""Streamed chat completions: chunk building, SSE framing, custody of a streamed call, a client gone.

Pure parts with plain values; the worker core (ChatService + Gym's real RolloutTokenCapture) over a
scripted engine that yields one token per step (this is request logic, not the engine), with the
real tiny-model tokenizer. The real stack is exercised by the `streamed` harness scenario.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import pytest

from examples.arith import task as arith_task
from examples.arith.tiny_model.corpus import task_conversation
from examples.arith.tiny_model.tokenizer import train_tokenizer
from nemo_gym.token_id_capture.staging import StageResult, staging_key
from nemo_rl.data.errors import ApiError
from nemo_rl.data.calls import RequestFieldError, check_chat_request
from nemo_rl.models.generation.vllm.chat import SSE_DONE, ContentStreamer, derive_turn_end, final_chunks, hold_back, sse_event
from nemo_rl.models.generation.vllm.engine import StreamStep
from nemo_rl.models.generation.vllm.errors import StreamConsistencyError
from nemo_rl.models.generation.vllm.lifecycle import build_custody
from nemo_rl.models.generation.vllm.serving import CLIENT_DISCONNECTED, ChatService

TOOLS = [arith_task.CALCULATOR_TOOL]
MESSAGES = [
    {"role": "system", "content": arith_task.SYSTEM_PROMPT},
    {"role": "user", "content": arith_task.user_prompt(arith_task.Problem("12 + 5", 17))},
]
CALL_TEXT = 'Let me add. <tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 5"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    texts = [json.dumps(task_conversation(p)) for p in arith_task.make_problems(0, 200)]
    return train_tokenizer(texts, vocab_size=600, max_length=2048)


# --- pure: framing, hold-back, content deltas, closing chunks ---------------------------------


def test_sse_event_is_one_data_line_and_a_blank_line():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode("utf-8")
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_hold_back_keeps_only_a_possible_start_of_the_marker():
    assert hold_back("hello <tool", "<tool_call>") == 5
    assert hold_back("hello <", "<tool_call>") == 1
    assert hold_back("hello", "<tool_call>") == 0
    assert hold_back("a <b", "<tool_call>") == 0


def _streamer(pieces: list[str], mode: str) -> tuple[ContentStreamer, list[str]]:
    """A streamer whose id i decodes to pieces[i] (ids are indexes)."""
    streamer = ContentStreamer(lambda ids: "".join(pieces[i] for i in ids), mode)
    return streamer, [streamer.push([i]) for i in range(len(pieces))]


def test_all_mode_streams_every_character_and_waits_on_a_partial_character():
    _, deltas = _streamer(["Hel", "lo", "\ufffd", " wor", "ld"], "all")
    assert deltas == ["Hel", "lo", "", "\ufffd wor", "ld"]


def test_until_marker_mode_stops_before_the_tool_call_tag():
    streamer, deltas = _streamer(["Let ", "me <", "tool", "_call>", '{"x"', "}"], "until_marker")
    assert deltas == ["Let ", "me ", "", "", "", ""]
    assert streamer.streamed == "Let me "


def test_at_end_mode_streams_nothing():
    streamer, deltas = _streamer(["a", "b"], "at_end")
    assert deltas == ["", ""] and streamer.streamed == ""


def _reply(content, tool_calls=None, finish="stop"):
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            "ng_commit_coords": {"model_call_id": "c1"}}


def test_final_chunks_close_with_rest_tool_calls_coords_and_usage():
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e": 1}'}}
    out = final_chunks(_reply("Let me add.", [call], "tool_calls"), "Let me", include_usage=True)
    assert [c["choices"][0]["delta"] if c["choices"] else None for c in out] == [
        {"content": " add."},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "calculator", "arguments": '{"e": 1}'}}]},
        {},
        None,
    ]
    assert out[2]["choices"][0]["finish_reason"] == "tool_calls"
    assert out[2]["ng_commit_coords"] == {"model_call_id": "c1"}
    assert out[3]["usage"]["total_tokens"] == 7 and "ng_commit_coords" not in out[3]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in out)


def test_final_chunks_without_usage_and_nothing_left_to_stream():
    out = final_chunks(_reply("done"), "done", include_usage=False)
    assert len(out) == 1 and out[0]["choices"][0]["finish_reason"] == "stop"


def test_final_chunks_refuse_streamed_content_that_the_reply_does_not_start_with():
    with pytest.raises(StreamConsistencyError, match="not a prefix"):
        final_chunks(_reply("other"), "done", include_usage=False)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_stream_fields_are_checked(body, field):
    with pytest.raises(RequestFieldError) as info:
        check_chat_request({"messages": MESSAGES, **body}, max_model_len=2048)
    assert info.value.field == field


def test_stream_true_with_include_usage_is_a_valid_request():
    check_chat_request({"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}},
                       max_model_len=2048)


# --- the worker core over a token-by-token engine ----------------------------------------------


@dataclass(frozen=True)
class _Result:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class StepEngine:
    """Yields one scripted token per step, then the result; records aborted requests."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = list(script)
        self.weight_version = 2
        self.aborted: list[str] = []
        self.step_started = asyncio.Event()

    async def generate(self, prompt_ids, sampling, request_id):
        ids = self.script.pop(0)
        return _Result(request_id, list(prompt_ids), ids, [-0.1 * (i + 1) for i in range(len(ids))], "stop", 2)

    async def generate_stream(self, prompt_ids, sampling, request_id):
        ids = self.script.pop(0)
        finished = False
        try:
            for t in ids:
                await asyncio.sleep(0)
                yield StreamStep([t], None)
            finished = True
        finally:
            if not finished:
                self.aborted.append(request_id)
        yield StreamStep([], _Result(request_id, list(prompt_ids), ids, [-0.1 * (i + 1) for i in range(len(ids))],
                                     "stop", 2))


class MemorySink:
    def __init__(self) -> None:
        self.records = {}
        self._lock = threading.Lock()

    def stage(self, record, *, attachments=None):
        key = staging_key(record.rollout_id, record.model_call_id)
        with self._lock:
            self.records[key] = record
        return StageResult(ok=True, staging_key=key)

    def fetch(self, keys):
        raise AssertionError("a root call reads nothing")


def _service(tokenizer, script):
    engine, sink = StepEngine(script), MemorySink()
    custody = build_custody(sink, sink, weight_version_fn=lambda: 2, prefix_cache_max_tokens=10_000,
                            vocab_size=len(tokenizer), max_admitted_calls=100)
    svc = ChatService(engine, tokenizer, model_name="tiny", default_max_tokens=64, max_model_len=2048,
                      turn_end=derive_turn_end(tokenizer), custody=custody)
    return svc, engine, sink


def _admission(call_id):
    return {"schema_version": 2, "rollout_id": "r1", "model_call_id": call_id, "parent_call_id": None,
            "prev_len": 0, "mode": "text", "required_prefix_token_ids": [], "staging_chain": [],
            "parent_chain_hash": None}


def _events(raw: list[bytes]) -> list[dict]:
    out = []
    for event in raw:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        out.append(json.loads(event[6:]))
    return out


async def test_admitted_stream_streams_content_then_commits_exactly_as_a_plain_reply(tokenizer):
    ids = tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    svc, engine, sink = _service(tokenizer, [ids, ids])
    body = {"messages": MESSAGES, "tools": TOOLS, "stream": True, "stream_options": {"include_usage": True},
            "ng_capture": _admission("c1")}
    events = _events([e async for e in await svc.chat_completions_stream(body)])
    whole = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("c2")})

    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == whole["choices"][0]["message"]["content"] == "Let me add. "
    assert sum(1 for d in deltas if d.get("content")) >= 2  # streamed in pieces, not replayed at the end
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "calculator", {"expression": "12 + 5"})]
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "tool_calls"
    coords = finish[0]["ng_commit_coords"]
    assert coords["disposition"] == "staged" and coords["model_call_id"] == "c1"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(ids)
    streamed, plain = sink.records[staging_key("r1", "c1")], sink.records[staging_key("r1", "c2")]
    fields = ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta", "chain_hash")  # the digest names the call id
    assert [getattr(streamed, f) for f in fields] == [getattr(plain, f) for f in fields]
    served = svc.take_served(["r1"])
    assert [(c.model_call_id, c.staged, c.generated_tokens) for c in served] == [("c1", True, len(ids)), ("c2", True, len(ids))]
    assert engine.aborted == []


async def test_a_client_gone_mid_stream_aborts_and_leaves_an_off_chain_served_call(tokenizer):
    ids = tokenizer.encode("The answer is 17 and that is all.", add_special_tokens=False) + [tokenizer.eos_token_id]
    svc, engine, sink = _service(tokenizer, [ids])
    body = {"messages": MESSAGES, "stream": True, "ng_capture": _admission("c1")}
    events = await svc.chat_completions_stream(body)
    got = [await anext(events) for _ in range(3)]  # role chunk and two content deltas
    assert len(got) == 3
    await events.aclose()  # what the HTTP shell does when a write finds the client gone

    assert engine.aborted and sink.records == {}
    [served] = svc.take_served(["r1"])
    assert (served.staged, served.failure) == (False, CLIENT_DISCONNECTED)
    assert 2 <= served.generated_tokens < len(ids)
    assert svc.stats["client_disconnected"] == 1 and svc.stats["text_calls"] == 0
    with pytest.raises(ApiError) as info:  # the id is spent: never generated again, never replayed
        await svc.chat_completions_stream(body)
    assert info.value.err_type == "duplicate_model_call_id"


async def test_a_plain_stream_refuses_logprobs_before_any_byte(tokenizer):
    svc, _, _ = _service(tokenizer, [])
    with pytest.raises(ApiError) as info:
        await svc.chat_completions_stream({"messages": MESSAGES, "stream": True, "logprobs": True})
    assert info.value.param == "logprobs"


# --- the HTTP shell: SSE on the wire, refusals before any byte, a client gone while nothing is due ---


class SlowStepEngine(StepEngine):
    """`StepEngine` with a pause before each token (a reply that takes a while)."""

    def __init__(self, script, pause_s: float) -> None:
        super().__init__(script)
        self.pause_s = pause_s

    async def generate_stream(self, prompt_ids, sampling, request_id):
        async for step in super().generate_stream(prompt_ids, sampling, request_id):
            await asyncio.sleep(self.pause_s)
            yield step


async def _http_client(svc):
    from aiohttp.test_utils import TestClient, TestServer

    from nemo_rl.models.generation.vllm.http import Endpoint, build_app

    endpoint = Endpoint()
    endpoint.service = svc
    app = build_app(endpoint, model_name="tiny", max_model_len=2048, max_request_bytes=1 << 20, control_token="t" * 32)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client


async def test_http_stream_is_sse_ending_in_done_and_a_refusal_is_json_before_any_byte(tokenizer):
    ids = tokenizer.encode("The answer is 17.", add_special_tokens=False) + [tokenizer.eos_token_id]
    svc, _, _ = _service(tokenizer, [ids])
    client = await _http_client(svc)
    try:
        resp = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True,
                                                               "ng_capture": _admission("c1")})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
        assert raw.endswith(b"\n\ndata: [DONE]\n\n")
        events = _events([b"data: " + part + b"\n\n" for part in raw[len(b"data: "):-len(SSE_DONE)].split(b"\n\ndata: ") if part][:-1] + [raw[raw.rfind(b"data: {"):-len(SSE_DONE)]])
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == "The answer is 17."
        refused = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream_options": {}})
        assert refused.status == 400 and (await refused.json())["error"]["param"] == "stream_options"
    finally:
        await client.close()


async def test_http_client_gone_while_a_tool_call_is_held_back_aborts_the_call(tokenizer):
    ids = tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    svc, engine, sink = _service(tokenizer, [])
    slow = SlowStepEngine([ids], pause_s=0.02)
    svc._engine = slow  # the same service over a slow engine
    client = await _http_client(svc)
    try:
        resp = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "stream": True,
                                                               "ng_capture": _admission("c1")})
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the role chunk
        resp.close()  # gone; the content so far is streamed, the tool call text is held back: nothing is due
        for _ in range(100):
            if slow.aborted:
                break
            await asyncio.sleep(0.02)
        assert slow.aborted and sink.records == {}
        [served] = svc.take_served(["r1"])
        assert (served.staged, served.failure) == (False, CLIENT_DISCONNECTED)
        assert served.generated_tokens < len(ids)
    finally:
        await client.close()


async def test_a_client_gone_at_the_role_chunk_is_recorded_too(tokenizer):
    ids = tokenizer.encode("The answer is 17.", add_special_tokens=False) + [tokenizer.eos_token_id]
    svc, engine, sink = _service(tokenizer, [ids])
    events = await svc.chat_completions_stream({"messages": MESSAGES, "stream": True, "ng_capture": _admission("c1")})
    role = json.loads((await anext(events))[len(b"data: "):])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    await events.aclose()  # the first token is already generated: the call is under way, and recorded
    [served] = svc.take_served(["r1"])
    assert (served.staged, served.failure, served.generated_tokens) == (False, CLIENT_DISCONNECTED, 1)
    assert engine.aborted and sink.records == {}
