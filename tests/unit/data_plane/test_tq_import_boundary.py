"""Only `nemo_rl.data_plane.tq_backend` imports `transfer_queue` (its knobs are fixed there first).

Modules are parsed with `ast`, never imported; an import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PACKAGE_ROOT = REPO / "nemo_rl"
THE_IMPORTER = "nemo_rl/data_plane/tq_backend.py"


def imports_transfer_queue(source: str) -> list[int]:
    """Lines of `source` that import `transfer_queue` or one of its modules, anywhere in the file."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name == "transfer_queue" or name.startswith("transfer_queue.") for name in names):
            lines.append(node.lineno)
    return lines


def test_only_tq_backend_imports_transfer_queue() -> None:
    importers = {
        str(path.relative_to(REPO)): lines
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if (lines := imports_transfer_queue(path.read_text()))
    }
    assert set(importers) == {THE_IMPORTER}, (
        f"modules importing transfer_queue: {importers}; only {THE_IMPORTER} may (it sets TQ's import-time "
        "knobs first): take what you need from it (e.g. `tq_errors()`) instead"
    )


def test_the_scan_finds_a_nested_import() -> None:
    source = "import os\n\ndef f():\n    from transfer_queue.client import X\n    import transfer_queue\n"
    assert imports_transfer_queue(source) == [4, 5]
    assert imports_transfer_queue("from transfer_queue_other import y\nimport os\n") == []
