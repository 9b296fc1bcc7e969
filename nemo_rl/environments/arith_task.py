"""The arithmetic tool task: problems, the calculator tool, the exact verifier.

Contract (shared by the tiny-model builder, the resources server and the tests):
- A problem is a small integer expression over + - * with 2-3 operands in [0, 99]; its answer
  is the exact integer value. `make_problem(rng)` is a pure function of the RNG state.
- The policy sees SYSTEM_PROMPT, the tool CALCULATOR_TOOL and `user_prompt(problem)`.
  The intended transcript is: one `calculator` tool call with the expression, the tool result,
  then a final answer `The answer is <int>.`.
- `calculate(expression)` evaluates only that grammar (no `eval`); anything else is a
  `CalculatorError` whose message names the offending input.
- `verify(final_text, problem)` is exact: reward 1.0 iff the last integer in the final
  assistant text equals the answer, else 0.0.
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
    n_operands = rng.choice((2, 3))
    parts = [str(rng.randint(0, 99))]
    for _ in range(n_operands - 1):
        parts.append(rng.choice(_OPS))
        parts.append(str(rng.randint(0, 99)))
    expression = " ".join(parts)
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


def verify(final_text: str, problem: Problem) -> float:
    ints = _INT_RE.findall(final_text or "")
    return 1.0 if ints and int(ints[-1]) == problem.answer else 0.0
