"""Local training text for the tiny model: task transcripts and standard-library English.

Contract:
- `task_conversation(problem)` is the intended transcript of the arithmetic tool task as
  OpenAI chat messages: system, user question, assistant calculator call with the exact
  expression (arguments as the JSON string `json.dumps({"expression": ...})`), the tool
  result `str(calculate(expression))`, assistant `final_answer_text(answer)`.
- `english_text(modules)` returns the docstrings of the named standard-library modules and
  their public members, read from disk through `inspect` (no network), in a fixed order.
- Every function here is pure: equal inputs give equal outputs.
"""

from __future__ import annotations

import importlib
import inspect
import json

from nemo_rl.environments import arith_task

TASK_TOOLS: list[dict] = [arith_task.CALCULATOR_TOOL]


class CorpusError(ValueError):
    """Local corpus text could not be assembled."""


def tool_call_arguments(expression: str) -> str:
    """The arguments JSON text the model is taught to emit (and the worker re-serialises)."""
    return json.dumps({"expression": expression})


def task_conversation(problem: arith_task.Problem, call_id: str = "call_0") -> list[dict]:
    result = arith_task.calculate(problem.expression)
    return [
        {"role": "system", "content": arith_task.SYSTEM_PROMPT},
        {"role": "user", "content": arith_task.user_prompt(problem)},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": arith_task.TOOL_NAME,
                        "arguments": tool_call_arguments(problem.expression),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": str(result)},
        {"role": "assistant", "content": arith_task.final_answer_text(problem.answer)},
    ]


def _public_members(module: object) -> list[tuple[str, object]]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return [(n, getattr(module, n)) for n in sorted(names) if hasattr(module, n)]


def english_text(modules: tuple[str, ...]) -> list[str]:
    texts: list[str] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise CorpusError(
                f"english_modules entry {name!r} is not an importable standard-library module; "
                "remove it from TinyModelConfig.english_modules"
            ) from e
        members = [obj for _, obj in _public_members(module) if inspect.isroutine(obj) or inspect.isclass(obj)]
        docs = [inspect.getdoc(module)] + [inspect.getdoc(obj) for obj in members]
        texts.extend(d for d in docs if d)
    if not texts:
        raise CorpusError(f"english_modules={modules!r} yielded no docstrings; name modules that have them")
    return texts
