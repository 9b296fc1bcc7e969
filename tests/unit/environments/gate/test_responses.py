"""The gate's streamed Responses path (pure parts): events from chat chunks, settling, commit before completed.

The shared relay (`streaming.relay_events`) is driven with scripted worker bytes, a scripted conversion and a recording
commit; the real gate in front of the real worker endpoint is in test_responses_http.py.
"""

from __future__ import annotations

import json

import pytest

from nemo_rl.environments.gate.responses import ResponsesEvents
from nemo_rl.environments.gate.streaming import SSE_DONE, StreamRelayError, relay_events, sse_event, typed_sse


def _chunk(delta, finish=None, **extra):
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


COORDS = {"model_call_id": "c1", "disposition": "staged"}
CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e":1}'}}
WORKER = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let "}), _chunk({"content": "me."}),
          _chunk({"tool_calls": [CALL]}), _chunk({}, "tool_calls", ng_commit_coords=COORDS)]


def skeleton(first: dict) -> dict:
    return {"id": first["id"], "object": "response", "created_at": first["created"], "model": "policy",
            "status": "completed", "output": [{"gym": "minted"}], "usage": {"x": 1}}


def final_response(text: str | None = "Let me.", calls=(("call_1", "calculator", '{"e":1}'),), status="completed"):
    output = []
    if text is not None:
        output.append({"id": "msg_gym", "type": "message", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
    output += [{"id": cid, "type": "function_call", "call_id": cid, "name": name, "arguments": args,
                "status": "completed"} for cid, name, args in calls]
    return {"id": "chatcmpl-1", "object": "response", "status": status, "output": output, "usage": {"total_tokens": 9}}


def _events() -> ResponsesEvents:
    return ResponsesEvents(skeleton, message_id="msg_s")


def test_chunks_become_created_then_added_then_deltas_in_order():
    events = _events()
    out = [e for c in WORKER for e in events.on_chunk(c)]
    assert [(e["type"], e["sequence_number"]) for e in out] == [
        ("response.created", 0), ("response.in_progress", 1), ("response.output_item.added", 2),
        ("response.content_part.added", 3), ("response.output_text.delta", 4), ("response.output_text.delta", 5),
        ("response.output_item.added", 6), ("response.function_call_arguments.delta", 7)]
    assert out[0]["response"] == {"id": "chatcmpl-1", "object": "response", "created_at": 5, "model": "policy",
                                  "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    assert out[2]["item"] == {"id": "msg_s", "type": "message", "role": "assistant", "status": "in_progress",
                              "content": []}
    assert [e["delta"] for e in out if e["type"].endswith(".delta")] == ["Let ", "me.", '{"e":1}']
    assert out[6] == {"type": "response.output_item.added", "sequence_number": 6, "output_index": 1, "item": {
        "id": "call_1", "type": "function_call", "call_id": "call_1", "name": "calculator", "arguments": "",
        "status": "in_progress"}}
    assert out[7]["output_index"] == 1 and out[7]["item_id"] == "call_1"


def test_settle_gives_the_final_response_the_streamed_message_id_and_closing_ends_with_completed():
    events = _events()
    for c in WORKER:
        events.on_chunk(c)
    final = events.settle(final_response())
    assert [item["id"] for item in final["output"]] == ["msg_s", "call_1"]
    closing = events.closing(final)
    assert [e["type"] for e in closing] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert closing[0]["text"] == "Let me." and closing[3]["arguments"] == '{"e":1}'
    assert closing[-1]["response"] == final and closing[-1]["sequence_number"] == 8 + 5


def test_a_reply_cut_by_max_output_tokens_ends_with_incomplete():
    events = _events()
    events.on_chunk(_chunk({"content": "Let"}))
    final = events.settle(final_response("Let", calls=(), status="incomplete"))
    assert events.closing(final)[-1]["type"] == "response.incomplete"


def test_an_empty_reply_opens_its_message_at_the_end():
    events = _events()
    events.on_chunk(_chunk({"role": "assistant", "content": ""}))
    final = events.settle(final_response("", calls=()))
    assert final["output"][0]["id"] == "msg_gym"
    assert [e["type"] for e in events.closing(final)] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]


@pytest.mark.parametrize(("final", "match"), [
    (final_response("Let me!"), "text is not the text streamed"),
    (final_response(None), r"output \['function_call'\] is not the streamed output \['message', 'function_call'\]"),
    (final_response(calls=(("call_1", "calculator", '{"e":2}'),)), "function call call_1 is not the one streamed"),
])
def test_a_final_response_that_differs_from_the_stream_is_refused(final, match):
    events = _events()
    for c in WORKER:
        events.on_chunk(c)
    with pytest.raises(StreamRelayError, match=match):
        events.settle(final)


def test_content_after_a_tool_call_and_a_nameless_call_are_refused():
    events = _events()
    events.on_chunk(_chunk({"tool_calls": [CALL]}))
    with pytest.raises(StreamRelayError, match="content after a tool call"):
        events.on_chunk(_chunk({"content": "late"}))
    with pytest.raises(StreamRelayError, match="started without an id and a name"):
        _events().on_chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}))


def test_sse_framing_names_the_event_type():
    assert typed_sse({"type": "response.completed", "n": 1}) == (
        b'event: response.completed\ndata: {"type":"response.completed","n":1}\n\n')


async def _bytes(raw: bytes, cut: int = 7):
    for at in range(0, len(raw), cut):
        yield raw[at : at + cut]


async def _relay(worker: list[bytes], final: dict) -> tuple[list[dict], list[dict], list[int], list[dict]]:
    converted: list[dict] = []
    commits: list[dict] = []
    seen_at_commit: list[int] = []
    out: list[bytes] = []

    def to_response(completion: dict) -> dict:
        converted.append(completion)
        return final

    async def commit(response: dict) -> None:
        commits.append(response)
        seen_at_commit.append(len(out))

    async for event in relay_events(_bytes(b"".join(worker)), _events(), to_response, commit):
        out.append(event)
    parsed = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in out]
    return parsed, commits, seen_at_commit, converted


async def test_relay_commits_the_settled_response_before_any_closing_event():
    parsed, commits, seen_at_commit, converted = await _relay([*(sse_event(c) for c in WORKER), SSE_DONE],
                                                             final_response())
    assert converted[0]["ng_commit_coords"] == COORDS  # the conversion gets the coords (Gym's prepare takes them)
    assert [item["id"] for item in commits[0]["output"]] == ["msg_s", "call_1"]
    assert seen_at_commit == [8]  # the 8 streamed events out, no done event yet
    assert parsed[-1]["type"] == "response.completed" and parsed[-1]["response"] == commits[0]
    assert all("ng_commit_coords" not in json.dumps(e) for e in parsed)


async def test_a_stream_cut_or_failed_commits_nothing_and_ends_with_response_failed():
    parsed, commits, _, _ = await _relay([sse_event(c) for c in WORKER[:3]], final_response())
    assert commits == [] and parsed[-1]["type"] == "response.failed"
    assert parsed[-1]["response"]["id"] == "chatcmpl-1" and "not committed" in parsed[-1]["response"]["error"]["message"]
    error = {"error": {"message": "generation timed out", "type": "generation_timeout", "param": None, "code": 503}}
    parsed, commits, _, _ = await _relay([sse_event(WORKER[1]), sse_event(error), SSE_DONE], final_response())
    assert commits == [] and parsed[-1]["response"]["error"]["message"] == (
        "the vLLM worker's stream failed: generation timed out; not committed")


async def test_a_final_response_unlike_the_stream_is_never_committed():
    with pytest.raises(StreamRelayError):
        await _relay([*(sse_event(c) for c in WORKER), SSE_DONE], final_response("other"))


def test_a_namespace_tools_call_streams_and_settles_under_its_client_visible_name():
    events = ResponsesEvents(skeleton, message_id="msg_s", namespaces={"files__read": ("files", "read")})
    call = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "files__read", "arguments": "{}"}}
    added = [e for e in events.on_chunk(_chunk({"tool_calls": [call]})) if e["type"] == "response.output_item.added"]
    assert (added[0]["item"]["namespace"], added[0]["item"]["name"]) == ("files", "read")
    final = {"id": "chatcmpl-1", "status": "completed", "output": [
        {"id": "call_9", "type": "function_call", "call_id": "call_9", "namespace": "files", "name": "read",
         "arguments": "{}", "status": "completed"}]}
    assert events.closing(events.settle(final))[0]["name"] == "read"
