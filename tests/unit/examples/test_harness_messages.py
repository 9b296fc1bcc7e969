"""The `messages_streamed` scenario's pure parts: its event clock, its tool results and its declared outcome."""

from __future__ import annotations

from anthropic.lib.streaming import TextEvent
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from examples.arith.rows import calculator_tool_output
from examples.harness_scenarios import MessagesClock, declared_terminal, message_text, tool_result_blocks
from nemo_rl.token_capture.judge import TERMINAL_RESPONSE_ID_KEY

EVENT = TypeAdapter(RawMessageStreamEvent)
MESSAGE = {"id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "tiny", "stop_reason": "tool_use",
           "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 4}}


def _event(payload: dict):
    return EVENT.validate_python(payload)


def test_the_clock_counts_wire_events_and_deltas_by_kind_and_times_the_deltas():
    clock = MessagesClock()
    wire = [
        {"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "It"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " is"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {}}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": '{"expression": "2 + 3"}'}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"output_tokens": 4}},
        {"type": "message_stop"},
    ]
    for at, payload in enumerate(wire):
        clock.see(_event(payload), float(at))
        if payload["type"] == "content_block_delta" and payload["delta"]["type"] == "text_delta":
            # The `messages.stream` helper's own `text` event after each text delta: not a wire event.
            clock.see(TextEvent(type="text", text=payload["delta"]["text"], snapshot=""), 100.0)
    assert (clock.events, clock.text_deltas, clock.input_json_deltas, clock.deltas) == (10, 2, 1, 3)
    assert (clock.start_id, clock.first_s, clock.last_s) == ("chatcmpl-1", 2.0, 6.0)


def test_each_tool_use_is_answered_by_a_tool_result_block_and_the_outcome_declares_the_message_id():
    message = Message.model_validate({**MESSAGE, "content": [
        {"type": "text", "text": "Let me compute."},
        {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {"expression": "2 + 3"}},
    ]})
    assert tool_result_blocks(message) == [
        {"type": "tool_result", "tool_use_id": "call_1", "content": calculator_tool_output("2 + 3")}]
    assert message_text(message) == "Let me compute."
    assert declared_terminal(message.id, message_text(message)) == {
        "reward": 1.0, "response": {"id": "chatcmpl-1", "output": []}, TERMINAL_RESPONSE_ID_KEY: "chatcmpl-1"}
    assert declared_terminal("chatcmpl-2", " ")["reward"] == 0.0
