"""The gate's streamed Messages path (pure parts): Anthropic events from chat chunks, settling, commit before message_stop.

The shared relay (`streaming.relay_events`) is driven with scripted worker bytes, a scripted
conversion and a recording commit; the real gate in front of the real worker endpoint, read by
the `anthropic` client, is in test_messages_http.py.
"""

from __future__ import annotations

import json

import pytest

from nemo_rl.environments.gate.messages import MessagesEvents
from nemo_rl.environments.gate.streaming import SSE_DONE, StreamRelayError, relay_events, sse_event


def _chunk(delta, finish=None, **extra):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


COORDS = {"model_call_id": "c1", "disposition": "staged"}
CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e":'}}
MORE = {"index": 0, "function": {"arguments": "1}"}}
WORKER = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let "}), _chunk({"content": "me."}),
          _chunk({"tool_calls": [CALL]}), _chunk({"tool_calls": [MORE]}),
          _chunk({}, "tool_calls", ng_commit_coords=COORDS)]


def shell(first: dict) -> dict:
    """What Gym's converter makes of the empty completion (its id, model, a text block, a stop reason)."""
    return {"id": first["id"], "type": "message", "role": "assistant", "model": "tiny",
            "content": [{"type": "text", "text": ""}], "stop_reason": "end_turn", "usage": {"input_tokens": 0,
                                                                                          "output_tokens": 0}}


def final_message(text: str | None = "Let me.", calls=(("call_1", "calculator", {"e": 1}),), stop="tool_use",
                  message_id="resp_minted"):
    content = [] if text is None else [{"type": "text", "text": text}]
    content += [{"type": "tool_use", "id": cid, "name": name, "input": args} for cid, name, args in calls]
    return {"id": message_id, "type": "message", "role": "assistant", "model": "tiny", "content": content,
            "stop_reason": stop, "usage": {"input_tokens": 11, "output_tokens": 7}}


def test_chunks_become_message_start_then_blocks_one_at_a_time():
    events = MessagesEvents(shell)
    out = [e for c in WORKER for e in events.on_chunk(c)]
    assert [(e["type"], e.get("index")) for e in out] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_delta", 1)]
    assert out[0]["message"] == {"id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "tiny",
                                 "content": [], "stop_reason": None, "stop_sequence": None,
                                 "usage": {"input_tokens": 0, "output_tokens": 0}}
    assert out[1]["content_block"] == {"type": "text", "text": ""}
    assert [e["delta"] for e in out[2:4]] == [{"type": "text_delta", "text": "Let "},
                                             {"type": "text_delta", "text": "me."}]
    assert out[5]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {}}
    assert [e["delta"] for e in out[6:]] == [{"type": "input_json_delta", "partial_json": '{"e":'},
                                             {"type": "input_json_delta", "partial_json": "1}"}]


def test_settle_keeps_the_streamed_id_and_closing_stops_the_block_then_delta_then_stop():
    events = MessagesEvents(shell)
    for c in WORKER:
        events.on_chunk(c)
    final = events.settle(final_message())
    assert final == {**final_message(), "id": "chatcmpl-1"}
    assert events.closing(final) == [
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"input_tokens": 11, "output_tokens": 7}},
        {"type": "message_stop"}]


def test_an_empty_reply_opens_its_text_block_at_the_end():
    events = MessagesEvents(shell)
    events.on_chunk(_chunk({"role": "assistant", "content": ""}))
    final = events.settle(final_message("", calls=(), stop="max_tokens"))
    assert [(e["type"], e.get("index")) for e in events.closing(final)] == [
        ("content_block_start", 0), ("content_block_stop", 0), ("message_delta", None), ("message_stop", None)]


@pytest.mark.parametrize(("final", "match"), [
    (final_message("Let me!"), "text is not the text streamed"),
    (final_message(None), r"content \['tool_use'\] is not the streamed content \['text', 'tool_use'\]"),
    (final_message(calls=(("call_1", "calculator", {"e": 2}),)), "tool_use call_1 is not the one streamed"),
    (final_message(calls=(("call_2", "calculator", {"e": 1}),)), "tool_use call_2 is not the one streamed"),
])
def test_a_final_message_that_differs_from_the_stream_is_refused(final, match):
    events = MessagesEvents(shell)
    for c in WORKER:
        events.on_chunk(c)
    with pytest.raises(StreamRelayError, match=match):
        events.settle(final)


def test_content_after_a_tool_call_late_arguments_and_a_nameless_call_are_refused():
    events = MessagesEvents(shell)
    events.on_chunk(_chunk({"tool_calls": [CALL]}))
    with pytest.raises(StreamRelayError, match="content after a tool call"):
        events.on_chunk(_chunk({"content": "late"}))
    second = {"index": 1, "id": "call_2", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    events.on_chunk(_chunk({"tool_calls": [second]}))
    with pytest.raises(StreamRelayError, match="arguments of tool call 0 after the next block started"):
        events.on_chunk(_chunk({"tool_calls": [MORE]}))
    with pytest.raises(StreamRelayError, match="started without an id and a name"):
        MessagesEvents(shell).on_chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}))


async def _bytes(raw: bytes, cut: int = 7):
    for at in range(0, len(raw), cut):
        yield raw[at : at + cut]


async def _relay(worker: list[bytes], final: dict) -> tuple[list[tuple[str, dict]], list[dict], list[int], list[dict]]:
    converted: list[dict] = []
    commits: list[dict] = []
    seen_at_commit: list[int] = []
    out: list[bytes] = []

    def to_message(completion: dict) -> dict:
        converted.append(completion)
        return final

    async def commit(message: dict) -> None:
        commits.append(message)
        seen_at_commit.append(len(out))

    async for event in relay_events(_bytes(b"".join(worker)), MessagesEvents(shell), to_message, commit):
        out.append(event)
    parsed = []
    for raw in out:
        head, data = raw.decode().split("\ndata: ", 1)
        parsed.append((head.removeprefix("event: "), json.loads(data)))
    return parsed, commits, seen_at_commit, converted


async def test_relay_commits_the_settled_message_before_the_closing_events():
    parsed, commits, seen_at_commit, converted = await _relay([*(sse_event(c) for c in WORKER), SSE_DONE],
                                                             final_message())
    assert converted[0]["ng_commit_coords"] == COORDS  # the conversion gets the coords (Gym's prepare takes them)
    assert commits == [{**final_message(), "id": "chatcmpl-1"}]
    assert seen_at_commit == [8]  # the 8 streamed events out; the last block's stop not yet
    assert [kind for kind, _ in parsed[8:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(kind == event["type"] for kind, event in parsed)  # the SSE `event:` line names the data's type
    assert all("ng_commit_coords" not in json.dumps(e) for _, e in parsed)


async def test_a_stream_cut_or_failed_commits_nothing_and_ends_with_an_error_event():
    parsed, commits, _, _ = await _relay([sse_event(c) for c in WORKER[:3]], final_message())
    assert commits == [] and [kind for kind, _ in parsed] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "error"]
    assert parsed[-1][1] == {"type": "error", "error": {"type": "api_error", "message": (
        "the vLLM worker's stream ended before data: [DONE]; the call is not committed")}}
    error = {"error": {"message": "generation timed out", "type": "generation_timeout", "param": None, "code": 503}}
    parsed, commits, _, _ = await _relay([sse_event(WORKER[1]), sse_event(error), SSE_DONE], final_message())
    assert commits == [] and parsed[-1][1]["error"]["message"] == (
        "the vLLM worker's stream failed: generation timed out; not committed")


async def test_a_final_message_unlike_the_stream_is_never_committed():
    with pytest.raises(StreamRelayError):
        await _relay([*(sse_event(c) for c in WORKER), SSE_DONE], final_message("other"))
