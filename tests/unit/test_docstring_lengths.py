"""Docstrings are contracts, not manuals: each stays short and the tables live once, in docs/.

Contract:
- Every module docstring in `nemo_rl` is at most `MAX_MODULE_LINES` lines (what the module
  owns, promises and keeps invariant, and where its docs page is); every class and function
  docstring at most `MAX_DEFINITION_LINES`. Modules are parsed with `ast`, never imported.
- Metric, reason, threshold and knob tables belong to the docs page the docstring points to
  (pydantic `Field(description=...)` keeps a one-line note next to a field). A docstring over
  its limit fails naming module:line, its length and the fix.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "nemo_rl"
# Today every module docstring is at most 12 lines and every other at most 10; the limits leave
# a little room for a contract that grows a line, never for a table.
MAX_MODULE_LINES = 15
MAX_DEFINITION_LINES = 15
_FIX = "keep the contract and invariants, move tables and per-item reasoning to the docs page it names"


def long_docstrings(source: str, module: str) -> list[str]:
    """One line per docstring of `source` over its limit (see the contract)."""
    tree = ast.parse(source, filename=module)
    found = []
    doc = ast.get_docstring(tree)
    if doc is not None and len(doc.splitlines()) > MAX_MODULE_LINES:
        found.append(f"{module}:1: module docstring has {len(doc.splitlines())} lines (> {MAX_MODULE_LINES}); {_FIX}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc is not None and len(doc.splitlines()) > MAX_DEFINITION_LINES:
                found.append(
                    f"{module}:{node.lineno}: docstring of {node.name} has {len(doc.splitlines())} lines "
                    f"(> {MAX_DEFINITION_LINES}); {_FIX}"
                )
    return found


def test_every_docstring_in_nemo_rl_is_within_its_limit() -> None:
    found = [
        line
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        for line in long_docstrings(path.read_text(), str(path.relative_to(REPO)))
    ]
    assert not found, "docstrings over their limit:\n" + "\n".join(found)


def test_the_check_names_a_long_docstring() -> None:
    body = "\n".join(f"    line {i}" for i in range(MAX_DEFINITION_LINES + 1))
    source = f'"""Short."""\n\nclass Thresholds:\n    """Summary.\n{body}\n    """\n'
    (finding,) = long_docstrings(source, "planted.py")
    assert finding.startswith("planted.py:3: docstring of Thresholds has") and "docs page" in finding
