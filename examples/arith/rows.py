"""Pure row logic of the arithmetic Gym environment: the /run body, the tool output, the final text.

Contract:
- `build_row(problem, sampling)` is the body of one agent `/run`: `responses_create_params`
  (system + user input, the Responses-form calculator tool, temperature, top_p,
  max_output_tokens) plus the ground truth as extra top-level fields `expression` and `answer`,
  the way Gym's example servers carry ground truth beside `responses_create_params`. The agent
  forwards every extra field to the resources server's `/verify` untouched.
- `problem_from_fields(expression, answer)` rebuilds the `Problem` and fails loudly when the
  row's answer does not match its expression (a corrupt dataset row is never scored).
- `calculator_tool_output(expression)` is the exact text the model sees as the tool result: the
  integer value, or `error: <reason>` for input outside the calculator grammar. It never raises,
  so a bad tool call costs the model a turn instead of failing the rollout.
- `final_assistant_text(output_items)` is the text of the assistant message(s) that end a
  Responses `output` list (reasoning items between them are skipped). An output that ends in
  anything else (a tool call cut off by max steps, a tool result) has no final text: "".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from examples.arith.task import (
    CALCULATOR_TOOL_RESPONSES,
    SYSTEM_PROMPT,
    CalculatorError,
    Problem,
    calculate,
    user_prompt,
)
from nemo_rl.environments.task import RowSampling

# Extra /run fields that carry the ground truth to /verify.
EXPRESSION_FIELD = "expression"
ANSWER_FIELD = "answer"
TOOL_ERROR_PREFIX = "error: "


class InvalidGroundTruthError(ValueError):
    """A dataset row's `answer` does not match its `expression`."""


def calculator_run_params(system_prompt: str, user_text: str, sampling: RowSampling) -> dict[str, Any]:
    """`responses_create_params` of a calculator task's /run body: system + user input, the tool, sampling."""
    return {
        "input": [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": user_text},
        ],
        "tools": [dict(CALCULATOR_TOOL_RESPONSES)],
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_output_tokens": sampling.max_output_tokens,
    }


def build_row(problem: Problem, sampling: RowSampling) -> dict[str, Any]:
    """The agent /run body for one problem (see the module docstring)."""
    return {
        "responses_create_params": calculator_run_params(SYSTEM_PROMPT, user_prompt(problem), sampling),
        EXPRESSION_FIELD: problem.expression,
        ANSWER_FIELD: problem.answer,
    }


def problem_from_fields(expression: str, answer: int) -> Problem:
    """The row's problem; a row whose answer disagrees with its expression is rejected."""
    try:
        return Problem(expression=expression, answer=answer)
    except (ValueError, CalculatorError) as e:
        raise InvalidGroundTruthError(
            f"dataset row has {EXPRESSION_FIELD}={expression!r} and {ANSWER_FIELD}={answer!r}, "
            f"which do not agree ({e}); rebuild the row with build_row(problem, sampling)"
        ) from e


def calculator_tool_output(expression: str) -> str:
    """The tool result text: the value, or `error: <reason>` (never an exception)."""
    try:
        return str(calculate(expression))
    except CalculatorError as e:
        return f"{TOOL_ERROR_PREFIX}{e}"


def _message_text(item: Mapping[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, Sequence) else []
    return "".join(
        part["text"]
        for part in parts
        if isinstance(part, Mapping) and part.get("type") == "output_text" and isinstance(part.get("text"), str)
    )


def final_assistant_text(output_items: Sequence[Mapping[str, Any]]) -> str:
    """Text of the trailing assistant message items of a Responses output ("" if none)."""
    texts: list[str] = []
    for item in reversed(output_items):
        kind = item.get("type")
        if kind == "reasoning":
            continue
        if kind == "message" and item.get("role") == "assistant":
            texts.append(_message_text(item))
            continue
        break
    return "".join(reversed(texts))
