"""The gate's streamed relay (pure parts): SSE splitting, chunk assembly, commit before [DONE].

`relay_stream` is driven with scripted worker bytes and a recording commit; the real gate in
front of a real worker runs in the `streamed` harness scenario.
"""

from __future__ import annotations

import json

import pytest

from nemo_rl.environments.gate.streaming import (
    SSE_DONE,
    ChunkAssembler,
    SseSplitter,
    StreamRelayError,
    relay_stream,
    sse_event,
)


def _chunk(delta, finish=None, **extra):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


COORDS = {"model_call_id": "c1", "disposition": "staged"}
CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e":1}'}}
WORKER_EVENTS = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"content": "Let "}),
    _chunk({"content": "me."}),
    _chunk({"tool_calls": [CALL]}),
    _chunk({}, "tool_calls", ng_commit_coords=COORDS),
]


def test_splitter_cuts_events_across_reads_and_drops_comments():
    splitter = SseSplitter()
    assert splitter.feed(b'data: {"a"') == []
    assert splitter.feed(b':1}\n\n: keep-alive\n\ndata: [DONE]\r\n\r\ndata: x') == ['{"a":1}', "[DONE]"]
    assert splitter.pending == b"data: x"


def test_assembler_adds_up_content_and_tool_calls_and_keeps_coords_off_the_client_chunk():
    assembler = ChunkAssembler()
    forwarded = [assembler.add(c) for c in WORKER_EVENTS]
    assert "ng_commit_coords" not in forwarded[-1] and "ng_commit_coords" in WORKER_EVENTS[-1]
    completion = assembler.completion()
    assert completion["choices"][0]["message"] == {
        "role": "assistant", "content": "Let me.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e":1}'}}],
    }
    assert completion["choices"][0]["finish_reason"] == "tool_calls"
    assert completion["ng_commit_coords"] == COORDS and completion["id"] == "chatcmpl-1"


def test_assembler_merges_tool_call_pieces_by_index_and_empty_content_is_null():
    assembler = ChunkAssembler()
    assembler.add(_chunk({"role": "assistant", "content": ""}))
    assembler.add(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "calc", "arguments": '{"e"'}}]}))
    assembler.add(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "tool_calls"))
    message = assembler.completion()["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == '{"e":1}'


def test_assembler_refuses_a_stream_without_a_finish_reason_and_a_foreign_chunk():
    assembler = ChunkAssembler()
    assembler.add(_chunk({"content": "x"}))
    with pytest.raises(StreamRelayError, match="finish_reason"):
        assembler.completion()
    with pytest.raises(StreamRelayError, match="chat.completion.chunk"):
        assembler.add({"object": "chat.completion"})


async def _bytes(events: list[bytes], cut: int = 7):
    """The worker's bytes, in reads that cut events at arbitrary places."""
    raw = b"".join(events)
    for at in range(0, len(raw), cut):
        yield raw[at : at + cut]


async def _relay(events: list[bytes]) -> tuple[list[dict | str], list[dict], list[int]]:
    commits: list[dict] = []
    seen_at_commit: list[int] = []
    out: list[bytes] = []

    async def commit(completion: dict) -> None:
        commits.append(completion)
        seen_at_commit.append(len(out))

    async for event in relay_stream(_bytes(events), commit):
        out.append(event)
    parsed = [e[6:-2].decode() if e == SSE_DONE else json.loads(e[6:]) for e in out]
    return parsed, commits, seen_at_commit


async def test_relay_forwards_every_chunk_and_commits_before_done():
    parsed, commits, seen_at_commit = await _relay([*(sse_event(c) for c in WORKER_EVENTS), SSE_DONE])
    assert parsed[-1] == "[DONE]" and len(parsed) == len(WORKER_EVENTS) + 1
    assert all("ng_commit_coords" not in chunk for chunk in parsed[:-1])
    assert [c["choices"][0]["delta"] for c in parsed[:-1]] == [c["choices"][0]["delta"] for c in WORKER_EVENTS]
    assert len(commits) == 1 and commits[0]["ng_commit_coords"] == COORDS
    assert seen_at_commit == [len(WORKER_EVENTS)]  # every chunk out, [DONE] not yet


async def test_a_stream_cut_before_done_commits_nothing_and_ends_with_an_error_event():
    parsed, commits, _ = await _relay([sse_event(c) for c in WORKER_EVENTS[:3]])
    assert commits == []
    assert "error" in parsed[-1] and "not committed" in parsed[-1]["error"]["message"]


async def test_the_workers_error_event_is_passed_on_and_nothing_is_committed():
    error = {"error": {"message": "generation timed out", "type": "generation_timeout", "param": None, "code": 504}}
    parsed, commits, _ = await _relay([sse_event(WORKER_EVENTS[0]), sse_event(error), SSE_DONE])
    assert commits == [] and parsed[-1] == error


async def test_an_event_that_is_not_json_is_a_relay_error():
    with pytest.raises(StreamRelayError, match="not JSON"):
        await _relay([b"data: {oops\n\n"])
