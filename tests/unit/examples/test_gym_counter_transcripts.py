"""Synthetic transcripts of Gym's `example_session_state_mgmt`: they are that environment's own tool calls."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from examples.arith.tiny_model import TinyModelConfig
from examples.arith.tiny_model.chat_template import CHATML, TOOL_CALL_PATTERN
from examples.gym_tools import session_counter as sc
from examples.gym_tools import warm_start
from resources_servers.example_session_state_mgmt.app import (
    GetCounterValueResponse,
    IncrementCounterRequest,
    IncrementCounterResponse,
)


def _assistant_turns(messages: list[dict]) -> list[str]:
    rendered, _ = render_jinja_template(conversations=[messages], tools=sc.env_tools(), chat_template=CHATML.chat_template)
    return re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", rendered[0], flags=re.S)


def test_the_tools_are_the_shipped_rows_tools_in_chat_form() -> None:
    rows = sc.env_rows()
    assert len(rows) == 5
    shipped = rows[0]["responses_create_params"]["tools"]
    assert [t["function"]["name"] for t in sc.env_tools()] == ["increment_counter", "get_counter_value"]
    assert [t["function"]["parameters"] for t in sc.env_tools()] == [t["parameters"] for t in shipped]
    assert all("strict" not in t["function"] for t in sc.env_tools())


def test_the_generator_phrases_prompts_as_the_shipped_rows_do() -> None:
    for row in sc.env_rows():
        (message,) = row["responses_create_params"]["input"]
        a, b = map(int, re.fullmatch(r"add (\d+) then add (\d+) then get the count", message["content"]).groups())
        problem = sc.CounterProblem(a=a, b=b, initial=row["initial_count"])
        assert sc.user_prompt(problem) == message["content"]
        assert problem.total == row["expected_count"]


def test_a_transcript_parses_as_the_envs_tool_calls_and_replays_to_the_expected_count() -> None:
    problem = sc.CounterProblem(a=13, b=14, initial=15)
    messages = sc.counter_conversation(problem)
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
    turns = _assistant_turns(messages)
    calls = [json.loads(re.fullmatch(TOOL_CALL_PATTERN, t, flags=re.S).group(1)) for t in turns[:3]]
    assert calls == [
        {"name": "increment_counter", "arguments": {"count": 13}},
        {"name": "increment_counter", "arguments": {"count": 14}},
        {"name": "get_counter_value", "arguments": {}},
    ]
    assert turns[3] == "The count is 42."
    counter = problem.initial  # what the env's server does with these calls (seed, then increments)
    for call in calls[:2]:
        counter += IncrementCounterRequest.model_validate(call["arguments"]).count
    assert counter == 42 == problem.total
    # The tool outputs are the server's own response bodies.
    outputs = [m["content"] for m in messages if m["role"] == "tool"]
    assert outputs == [IncrementCounterResponse(success=True).model_dump_json()] * 2 + [
        GetCounterValueResponse(count=42).model_dump_json()
    ]
    assert outputs == ['{"success":true}', '{"success":true}', '{"count":42}']


def test_problems_are_a_pure_function_of_the_seed_and_stay_in_range() -> None:
    problems = sc.make_problems(7, 200)
    assert problems == sc.make_problems(7, 200) != sc.make_problems(8, 200)
    assert all(1 <= p.a <= sc.MAX_ADD and 1 <= p.b <= sc.MAX_ADD and 0 <= p.initial <= sc.MAX_INITIAL for p in problems)


def test_a_non_function_tool_is_refused_with_its_shape() -> None:
    with pytest.raises(sc.CounterTranscriptError, match="not a Responses function tool"):
        sc.chat_tool({"type": "web_search"})


def test_the_warm_start_has_its_own_cache_folder_keyed_by_the_fine_tune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = TinyModelConfig()
    folder = warm_start.counter_cache_folder(cfg, tmp_path)
    assert folder.name == "gymcounter-" + warm_start.counter_cache_key(cfg)[:24]
    assert folder.parent == tmp_path / "tiny_model"
    before = warm_start.counter_cache_key(cfg)
    monkeypatch.setattr(warm_start, "FINE_TUNE_STEPS", warm_start.FINE_TUNE_STEPS + 1)
    assert warm_start.counter_cache_key(cfg) != before
