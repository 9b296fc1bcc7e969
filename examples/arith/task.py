"""The arithmetic tool task: problems, the calculator tool, the exact verifier.

Contract (shared by the tiny-model builder, the resources server and the tests):
- A problem is `a op b` with single-digit operands a, b in [1, 9] and op in + - *; its answer is
  the exact integer value. `make_problem(rng)` is a pure function of the RNG state. (Single
  digits keep the task within reach of the tiny CPU policy, so GRPO groups carry signal.)
- The policy sees SYSTEM_PROMPT, the tool CALCULATOR_TOOL and `user_prompt(problem)`.
  The intended transcript is: one `calculator` tool call with the expression, the tool result,
  then a final answer `The answer is <int>.`.
- `calculate(expression)` evaluates only that grammar (no `eval`); anything else is a
  `CalculatorError` whose message names the offending input.
- `is_exact(final_text, problem)`: the last integer in the final assistant text equals the answer.
- `verify(final_text, problem)` is the reward: 1.0 when exact; a wrong integer earns partial
  credit `0.5 / (1 + |error|)` (strictly below 0.5, shrinking with the error, so a weak policy's
  group is rarely all-equal); no integer at all earns 0.0.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool, then state the answer."
TOOL_NAME = "calculator"
CALCULATOR_TOOL: dict = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an integer expression with + - *.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
# The Responses-API form of the same tool (what Gym agents send).
CALCULATOR_TOOL_RESPONSES: dict = {
    "type": "function",
    "name": TOOL_NAME,
    "description": CALCULATOR_TOOL["function"]["description"],
    "parameters": CALCULATOR_TOOL["function"]["parameters"],
    "strict": False,
}

_OPS = ("+", "-", "*")
_TOKEN_RE = re.compile(r"\s*(\d+|[-+*])")
_INT_RE = re.compile(r"-?\d+")


class CalculatorError(ValueError):
    """The calculator was given something outside its grammar."""


@dataclass(frozen=True)
class Problem:
    expression: str
    answer: int

    def __post_init__(self) -> None:
        if calculate(self.expression) != self.answer:
            raise ValueError(f"Problem answer {self.answer} does not match {self.expression!r}")


def make_problem(rng: random.Random) -> Problem:
    expression = f"{rng.randint(1, 9)} {rng.choice(_OPS)} {rng.randint(1, 9)}"
    return Problem(expression=expression, answer=calculate(expression))


def make_problems(seed: int, count: int) -> list[Problem]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(count)]


def user_prompt(problem: Problem) -> str:
    return f"What is {problem.expression}?"


def _tokenize(expression: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    stripped = expression.rstrip()
    while pos < len(stripped):
        m = _TOKEN_RE.match(stripped, pos)
        if m is None:
            raise CalculatorError(f"calculator: unexpected character at {pos} in expression {expression!r}")
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


def calculate(expression: str) -> int:
    """Evaluate `int (op int)*` with * binding tighter than + and -."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise CalculatorError(f"calculator: expression must be a string of at most 200 chars, got {expression!r}")
    tokens = _tokenize(expression)
    if not tokens or len(tokens) % 2 == 0:
        raise CalculatorError(f"calculator: expression {expression!r} is not `int (op int)*`")
    terms: list[int] = []
    signs: list[int] = [1]
    current = None
    for i, tok in enumerate(tokens):
        if i % 2 == 0:
            if not tok.isdigit():
                raise CalculatorError(f"calculator: expected a number, got {tok!r} in {expression!r}")
            value = int(tok)
            current = value if current is None else current * value
        else:
            if tok not in _OPS:
                raise CalculatorError(f"calculator: expected an operator, got {tok!r} in {expression!r}")
            if tok == "*":
                continue
            terms.append(current)
            signs.append(1 if tok == "+" else -1)
            current = None
    terms.append(current)
    return sum(s * t for s, t in zip(signs, terms))


def final_answer_text(answer: int) -> str:
    return f"The answer is {answer}."


def _last_int(final_text: str) -> int | None:
    ints = _INT_RE.findall(final_text or "")
    return int(ints[-1]) if ints else None


def is_exact(final_text: str, problem: Problem) -> bool:
    return _last_int(final_text) == problem.answer


def verify(final_text: str, problem: Problem) -> float:
    value = _last_int(final_text)
    if value is None:
        return 0.0
    if value == problem.answer:
        return 1.0
    return 0.5 / (1 + abs(value - problem.answer))
