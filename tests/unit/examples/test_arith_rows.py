"""The example task's pure row logic: the /run body, ground truth, tool text, final text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from examples.arith.task import CALCULATOR_TOOL_RESPONSES, SYSTEM_PROMPT, CalculatorError, Problem, calculate
from examples.arith.rows import (
    InvalidGroundTruthError,
    build_row,
    calculator_tool_output,
    final_assistant_text,
    problem_from_fields,
)
from nemo_rl.environments.task import RowSampling

SAMPLING = RowSampling(temperature=0.7, top_p=0.9, max_output_tokens=128)


def test_build_row_carries_prompt_tool_sampling_and_ground_truth() -> None:
    row = build_row(Problem("12 + 5", 17), SAMPLING)
    assert row == {
        "responses_create_params": {
            "input": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "What is 12 + 5?"},
            ],
            "tools": [CALCULATOR_TOOL_RESPONSES],
            "temperature": 0.7,
            "top_p": 0.9,
            "max_output_tokens": 128,
        },
        "expression": "12 + 5",
        "answer": 17,
    }


def test_ground_truth_mismatch_is_rejected() -> None:
    assert problem_from_fields("2 * 3", 6) == Problem("2 * 3", 6)
    with pytest.raises(InvalidGroundTruthError, match=r"expression='2 \* 3' and answer=7"):
        problem_from_fields("2 * 3", 7)
    with pytest.raises(InvalidGroundTruthError, match="unexpected character"):
        problem_from_fields("2 / 3", 0)


def test_calculator_tool_output_examples() -> None:
    assert calculator_tool_output("12 + 5 * 3") == "27"
    assert calculator_tool_output("3 - 10") == "-7"
    assert calculator_tool_output("") == "error: calculator: expression '' is not `int (op int)*`"


@given(st.text(max_size=40))
def test_calculator_tool_output_never_raises(expression: str) -> None:
    out = calculator_tool_output(expression)
    try:
        expected = str(calculate(expression))
    except CalculatorError as e:
        expected = f"error: {e}"
    assert out == expected


def _msg(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}


def test_final_assistant_text() -> None:
    call = {"type": "function_call", "name": "calculator", "arguments": "{}", "call_id": "c"}
    result = {"type": "function_call_output", "call_id": "c", "output": "17"}
    reasoning = {"type": "reasoning", "summary": []}
    assert final_assistant_text([call, result, _msg("The answer is 17.")]) == "The answer is 17."
    assert final_assistant_text([_msg("The answer is "), reasoning, _msg("17.")]) == "The answer is 17."
    assert final_assistant_text([_msg("I will call"), call]) == ""
    assert final_assistant_text([call, result]) == ""
    assert final_assistant_text([]) == ""
