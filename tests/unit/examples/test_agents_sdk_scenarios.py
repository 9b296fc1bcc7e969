"""The Agents SDK scenario's pure parts: the driver's JSON line and the outcome the judge reads."""

from __future__ import annotations

import json

import pytest

from examples.harness.agents_sdk_scenarios import AgentsSdkRun, AgentsSdkRunError, parse_driver_line, sdk_outcome
from nemo_rl.token_capture.judge import TERMINAL_OUTPUT_TEXT_KEY, TERMINAL_RESPONSE_ID_KEY


def test_the_responses_run_declares_its_last_response_id():
    run = AgentsSdkRun("responses", "It is 5.", ("resp_a", "resp_b"), 1, None, 3.0)
    assert sdk_outcome(run) == {"reward": 1.0, "response": {"id": "resp_b", "output": []},
                                TERMINAL_RESPONSE_ID_KEY: "resp_b"}


def test_the_chat_run_has_no_response_id_and_declares_its_output_text():
    run = AgentsSdkRun("chat", "It is 5.", (None, None), 1, None, 3.0)
    assert sdk_outcome(run) == {"reward": 1.0, "response": {"output": []}, TERMINAL_OUTPUT_TEXT_KEY: "It is 5."}
    assert sdk_outcome(AgentsSdkRun("chat", "", (None,), 0, None, 1.0))["reward"] == 0.0


def test_the_driver_line_is_parsed_or_the_failure_named():
    line = json.dumps({"mode": "chat", "final_output": "5", "response_ids": [None], "tool_calls": 1})
    assert parse_driver_line(f"noise\n{line}\n", 2.5) == AgentsSdkRun("chat", "5", (None,), 1, None, 2.5)
    with pytest.raises(AgentsSdkRunError, match="printed no JSON line"):
        parse_driver_line("Traceback ...", 1.0)
    with pytest.raises(ValueError, match="mode='stream'"):
        AgentsSdkRun("stream", None, (), 0, None, 0.0)


def test_a_streamed_runs_line_carries_its_stream_counts():
    line = json.dumps({"mode": "responses", "streamed": True, "final_output": "5", "response_ids": ["r1", "r2"],
                       "tool_calls": 1, "stream_events": 40, "text_deltas": 12, "first_delta_s": 0.25})
    assert parse_driver_line(line, 4.0) == AgentsSdkRun("responses", "5", ("r1", "r2"), 1, None, 4.0, True, 40, 12, 0.25)
    # A line without them (Runner.run) is not streamed.
    plain = parse_driver_line(json.dumps({"mode": "chat", "final_output": "5", "response_ids": [None]}), 1.0)
    assert (plain.streamed, plain.stream_events, plain.text_deltas) == (False, None, None)
