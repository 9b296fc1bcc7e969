"""vLLM's own tool-call and reasoning parsers through `parsers.py`, in the worker's venv.

`vllm_parsers_probe.py` runs once (a subprocess of the worker venv's python, with a deadline) on
the tiny model's real tokenizers and reports what it observed; this module holds the
expectations:
- the committed name lists (`parser_names.py`, what the driver validates recipes against) equal
  vLLM's two registries exactly, both ways;
- hermes and llama3_json tool calls, qwen3 reasoning (`<think>...</think>`, then content, then a
  `<tool_call>`), tool_choice none, parallel_tool_calls off, hidden reasoning: the whole reply
  field by field as stock vLLM's chat completion builds it, tool-call ids minted by us;
- the streamed deltas concatenate to the whole reply (reasoning, content, each call's name and
  arguments), the first delta of a call carries its id, type and name, and the stream closes on
  the same reply;
- every whole reply, every streamed delta and every finish reason equals what stock vLLM's own
  chat server (its whole-reply and streaming generators, fed the same engine output) returns,
  tool-call ids aside (stock mints `chatcmpl-tool-...`, we mint ours, in the same places);
- names vLLM cannot build are `GenerationSetupError`s naming the field, the value and the fix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from nemo_rl.models.generation.vllm.parser_names import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
from nemo_rl.utils.venvs import REPO_ROOT, ensure_venv, venv_python, vllm_spec

pytestmark = pytest.mark.integration

PROBE = Path(__file__).with_name("vllm_parsers_probe.py")
PROBE_TIMEOUT_S = 600.0  # vLLM's imports and two tokenizer trainings on a shared 2-core machine

ARGS = '{"expression": "12 + 5"}'
CALL = {"type": "function", "function": {"name": "calculator", "arguments": ARGS}}
HERMES_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 5"}}\n</tool_call>'
# Tool-call ids: stock mints `chatcmpl-tool-<16 hex>`, the probe's counter `call_<n>`.
STOCK_ID, OUR_ID = re.compile(r'"chatcmpl-tool-[0-9a-f]{16}"'), re.compile(r'"call_\d+"')


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm_parsers") / "observed.json"
    python = venv_python(ensure_venv(vllm_spec("cpu")))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    try:
        proc = subprocess.run(
            [str(python), str(PROBE), str(out)],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the parsers probe did not finish within {PROBE_TIMEOUT_S:.0f} s: {(e.stderr or '')[-3000:]}")
    assert proc.returncode == 0, f"the parsers probe exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _assistant(content, reasoning=None, calls=()) -> dict:
    msg = {"role": "assistant", "content": content, "reasoning": reasoning}
    if calls:
        msg["tool_calls"] = [{"id": i, **CALL} for i in calls]
    return msg


def _joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def _streamed_calls(deltas: list[dict]) -> dict[int, dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            seen = calls.setdefault(c["index"], {"ids": [], "name": "", "arguments": ""})
            if c.get("id") is not None:
                seen["ids"].append(c["id"])
            fn = c.get("function") or {}
            seen["name"] += fn.get("name") or ""
            seen["arguments"] += fn.get("arguments") or ""
    return calls


def _first_call_deltas(deltas: list[dict]) -> list[dict]:
    return [c for d in deltas for c in d.get("tool_calls", []) if c.get("id") is not None]


def test_committed_names_are_vllms_registries_both_ways(observed):
    registries = observed["registries"]
    for field, committed in (("tool_call_parser", TOOL_CALL_PARSER_NAMES), ("reasoning_parser", REASONING_PARSER_NAMES)):
        vllm_names = set(registries[field])
        assert vllm_names - committed == set(), f"{field}: vLLM has names parser_names.py lacks"
        assert committed - vllm_names == set(), f"{field}: parser_names.py has names vLLM lacks"
    assert len(TOOL_CALL_PARSER_NAMES) == 54 and len(REASONING_PARSER_NAMES) == 38


def test_hermes_tool_call_whole_and_streamed(observed):
    case = observed["cases"]["hermes_call"]
    # hermes asks vLLM to keep special tokens when tools may be called (its adjust_request).
    assert case["skip_special_tokens"] is False
    assert case["text"] == "Let me compute." + HERMES_TEXT
    assert case["whole"] == {"message": _assistant("Let me compute.", calls=["call_0"]), "finish_reason": "tool_calls"}
    assert case["closed"] == {"message": _assistant("Let me compute.", calls=["call_1"]), "finish_reason": "tool_calls"}
    deltas = case["deltas"]
    assert _joined(deltas, "content") == "Let me compute." and _joined(deltas, "reasoning") == ""
    assert _streamed_calls(deltas) == {0: {"ids": ["call_1"], "name": "calculator", "arguments": ARGS}}
    assert _first_call_deltas(deltas) == [
        {"id": "call_1", "type": "function", "index": 0, "function": {"name": "calculator"}}
    ]


def test_hermes_two_calls_and_parallel_tool_calls_off(observed):
    both = observed["cases"]["hermes_two_calls"]
    assert both["whole"] == {"message": _assistant(None, calls=["call_0", "call_1"]), "finish_reason": "tool_calls"}
    assert both["closed"] == {"message": _assistant(None, calls=["call_2", "call_3"]), "finish_reason": "tool_calls"}
    assert _streamed_calls(both["deltas"]) == {
        0: {"ids": ["call_2"], "name": "calculator", "arguments": ARGS},
        1: {"ids": ["call_3"], "name": "calculator", "arguments": ARGS},
    }
    one = observed["cases"]["hermes_parallel_off"]
    # parallel_tool_calls false: only the first call, whole and streamed (vLLM's own filter).
    assert one["whole"] == {"message": _assistant(None, calls=["call_0"]), "finish_reason": "tool_calls"}
    assert one["closed"] == {"message": _assistant(None, calls=["call_1"]), "finish_reason": "tool_calls"}
    assert _streamed_calls(one["deltas"]) == {0: {"ids": ["call_1"], "name": "calculator", "arguments": ARGS}}


def test_hermes_without_tools_or_with_tool_choice_none_is_content(observed):
    plain = observed["cases"]["hermes_plain"]
    assert plain["skip_special_tokens"] is True
    assert plain["whole"] == plain["closed"] == {"message": _assistant("The answer is 17."), "finish_reason": "stop"}
    assert _joined(plain["deltas"], "content") == "The answer is 17."
    none = observed["cases"]["hermes_tool_choice_none"]
    text = "Let me compute." + HERMES_TEXT
    # tool_choice none: the parser does not adjust decoding and no call is parsed.
    assert none["skip_special_tokens"] is True and none["text"] == text
    assert none["whole"] == none["closed"] == {"message": _assistant(text), "finish_reason": "stop"}
    assert _joined(none["deltas"], "content") == text and _streamed_calls(none["deltas"]) == {}


def test_llama3_json_tool_call_and_plain_answer(observed):
    call = observed["cases"]["llama3_json_call"]
    assert call["text"] == '{"name": "calculator", "parameters": {"expression": "12 + 5"}}'
    assert call["whole"] == {"message": _assistant(None, calls=["call_0"]), "finish_reason": "tool_calls"}
    assert call["closed"] == {"message": _assistant(None, calls=["call_1"]), "finish_reason": "tool_calls"}
    assert _joined(call["deltas"], "content") == ""
    assert _streamed_calls(call["deltas"]) == {0: {"ids": ["call_1"], "name": "calculator", "arguments": ARGS}}
    plain = observed["cases"]["llama3_json_plain"]
    assert plain["whole"] == plain["closed"] == {"message": _assistant("The answer is 17."), "finish_reason": "stop"}
    assert _joined(plain["deltas"], "content") == "The answer is 17."


def test_qwen3_reasoning_then_content_then_a_tool_call(observed):
    case = observed["cases"]["qwen3_think_content_call"]
    reasoning, content = "\nI add 12 and 5.\n", "\n\nLet me compute."
    assert case["text"] == "<think>\nI add 12 and 5.\n</think>\n\nLet me compute." + HERMES_TEXT
    assert case["whole"] == {"message": _assistant(content, reasoning, ["call_0"]), "finish_reason": "tool_calls"}
    assert case["closed"] == {"message": _assistant(content, reasoning, ["call_1"]), "finish_reason": "tool_calls"}
    deltas = case["deltas"]
    assert _joined(deltas, "reasoning") == reasoning and _joined(deltas, "content") == content
    assert _streamed_calls(deltas) == {0: {"ids": ["call_1"], "name": "calculator", "arguments": ARGS}}
    # Reasoning is streamed first, then content, then the call: no delta goes back to an earlier part.
    order = [next(k for k in ("reasoning", "content", "tool_calls") if d.get(k)) for d in deltas if any(map(d.get, ("reasoning", "content", "tool_calls")))]
    assert order == sorted(order, key=["reasoning", "content", "tool_calls"].index)


def test_qwen3_reasoning_then_answer_and_hidden_reasoning(observed):
    shown = observed["cases"]["qwen3_think_answer"]
    expected = {"message": _assistant("\n\nThe answer is 17.", "\nI add 12 and 5.\n"), "finish_reason": "stop"}
    assert shown["whole"] == shown["closed"] == expected
    assert _joined(shown["deltas"], "reasoning") == "\nI add 12 and 5.\n"
    hidden = observed["cases"]["qwen3_reasoning_hidden"]
    assert hidden["whole"] == hidden["closed"] == {"message": _assistant("\n\nThe answer is 17."), "finish_reason": "stop"}
    assert _joined(hidden["deltas"], "reasoning") == "" and _joined(hidden["deltas"], "content") == "\n\nThe answer is 17."


def test_names_vllm_cannot_build_are_setup_errors(observed):
    errors = observed["setup_errors"]
    assert errors["unknown_tool"] == {
        "kind": "tool_call_parser",
        "message": "generation.tool_call_parser='no_such_parser' cannot be set up in the worker's vLLM: vLLM's "
        "tool-parser registry (54 names) lacks it (fix: set generation.tool_call_parser to a name stock vLLM's "
        "--tool-call-parser accepts for this model and tokenizer)",
    }
    assert errors["unknown_reasoning"] == {
        "kind": "reasoning_parser",
        "message": "generation.reasoning_parser='no_such_parser' cannot be set up in the worker's vLLM: vLLM's "
        "reasoning-parser registry (38 names) lacks it (fix: set generation.reasoning_parser to a name stock "
        "vLLM's --reasoning-parser accepts for this model and tokenizer)",
    }
    # A registered name the tokenizer cannot serve: vLLM's own start-up check, named by our knob.
    hf = errors["hf_without_template"]
    assert hf["kind"] == "reasoning_parser"
    assert hf["message"].startswith("generation.reasoning_parser='hf' cannot be set up in the worker's vLLM: TypeError: ")
    assert "response_template" in hf["message"] and hf["message"].endswith("for this model and tokenizer)")


def test_well_formed_replies_stream_as_they_parse_whole(observed):
    assert {name: (c["agrees"], c["disagreement"]) for name, c in observed["cases"].items()} == {
        name: (True, None) for name in observed["cases"]
    }


def test_where_vllms_stream_and_whole_parse_differ_the_stream_is_the_reply_and_the_difference_is_named(observed):
    # A hermes call cut by max_tokens inside its name: streamed, the text before the call and
    # nothing of it; whole, the text stays content, markup included.
    cut = observed["disagreements"]["hermes_call_cut"]
    assert cut["text"] == 'Hi<tool_call>\n{"name": "calculat'
    assert cut["closed"] == {"message": _assistant("Hi"), "finish_reason": "length"}
    assert cut["whole"] == cut["closed_whole"] == {"message": _assistant(cut["text"]), "finish_reason": "length"}
    assert cut["agrees"] is False
    assert cut["disagreement"] == (
        "the streamed deltas add up to (None, 'Hi', (), 'length'), the whole reply parses as "
        f"(None, {cut['text']!r}, (), 'length')"
    )
    # llama3_json with text before the JSON: streamed, all content; whole, one call and no content.
    text_first = observed["disagreements"]["llama3_json_text_then_call"]
    assert text_first["closed"] == {"message": _assistant(text_first["text"]), "finish_reason": "stop"}
    assert text_first["whole"] == {"message": _assistant(None, calls=["call_0"]), "finish_reason": "tool_calls"}
    assert text_first["closed_whole"] == {"message": _assistant(None, calls=[""]), "finish_reason": "tool_calls"}
    assert _joined(text_first["deltas"], "content") == text_first["text"] and text_first["agrees"] is False


def test_a_body_vllm_refuses_and_a_misused_stream_are_named_errors(observed):
    assert observed["misuse"] == {
        "bad_body": ["InvalidChatRequest", "vLLM's chat request model refuses the body: 1 validation error for ChatCompletionRequest"],
        "close_early": ["StreamConsistencyError", "the stream was closed before its finishing step was pushed"],
        "push_late": ["StreamConsistencyError", "a step was pushed after the finishing step"],
    }


def _ids_as(text_of: object, pattern: re.Pattern) -> str:
    return pattern.sub('"<id>"', json.dumps(text_of, sort_keys=True))


def test_every_reply_and_delta_is_stock_vllms_own(observed):
    cases = {**observed["cases"], **observed["disagreements"]}
    assert len(cases) == 12
    for name, case in cases.items():
        stock = case["stock"]
        assert _ids_as(stock["whole"], STOCK_ID) == _ids_as(case["whole"], OUR_ID), name
        assert _ids_as(stock["deltas"], STOCK_ID) == _ids_as(case["deltas"], OUR_ID), name
        assert stock["finish_reasons"] == [case["closed"]["finish_reason"]], name
        ours = {k: v for k, v in case.items() if k != "stock"}
        assert STOCK_ID.search(json.dumps(ours)) is None, f"{name}: a vLLM-minted id reached our reply"
