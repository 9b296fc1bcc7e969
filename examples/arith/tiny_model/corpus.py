"""Local training text for the tiny model: task transcripts and standard-library English.

Contract:
- `task_conversation(problem)` is the intended transcript of the arithmetic tool task as
  OpenAI chat messages: system, user question, assistant calculator call with the exact
  expression (arguments as the JSON string `json.dumps({"expression": ...})`), the tool
  result `str(calculate(expression))`, assistant `final_answer_text(answer)`.
- `english_text(modules)` returns the docstrings of the named pure-Python standard-library
  modules and of their public classes and functions, parsed from the source files on disk
  (`ast`, no import, no network) in source order: a function of those files alone.
- Every function here is deterministic: equal inputs (and source files) give equal outputs,
  whatever else the process has imported.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

from examples.arith import task as arith_task

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


def _source_path(name: str) -> Path:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        raise CorpusError(
            f"english_modules entry {name!r} cannot be located; remove it from TinyModelConfig.english_modules"
        ) from e
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise CorpusError(
            f"english_modules entry {name!r} has no Python source file (origin "
            f"{None if spec is None else spec.origin!r}); name a pure-Python standard-library module"
        )
    return Path(spec.origin)


def docstrings(source: str) -> list[str]:
    """The module docstring and those of its public classes and functions, in source order."""
    tree = ast.parse(source)
    docs = [ast.get_docstring(tree)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            docs.append(ast.get_docstring(node))
    return [d for d in docs if d]


def english_text(modules: tuple[str, ...]) -> list[str]:
    # Parsed from the source files rather than read off live objects: libraries imported in the
    # same process patch standard-library functions (and their docstrings), which would make
    # the corpus, and so the tokenizer, depend on what else the process imported.
    texts: list[str] = []
    for name in modules:
        texts.extend(docstrings(_source_path(name).read_text(encoding="utf-8")))
    if not texts:
        raise CorpusError(f"english_modules={modules!r} yielded no docstrings; name modules that have them")
    return texts
