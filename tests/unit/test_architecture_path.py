"""The architecture doc's rollout path (docs/design-docs/architecture.md) stays true to the code.

The doc names the modules one rollout runs twice: in the path table (a module in full, or relative to
the module before it in the same cell, as `serving` -> `custody`) and in a `path-modules` block, with
the count in a sentence "The path runs N modules in M packages". This checks that every listed module
exists, that the table and the block name the same modules, and that N and M are what the block
holds (packages as `test_import_layers.LAYERS` names them: `models.generation`, not `models`).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_import_layers import ARCHITECTURE_DOC, LAYERS, PACKAGE_ROOT

PACKAGES = tuple(sorted((p for layer in LAYERS for p in layer), key=len, reverse=True))
# Rows run by servers of Gym or the example task, not by `nemo_rl`.
FOREIGN_PROCESSES = ("Gym agent", "Gym resources server")
_COUNT = re.compile(r"The path runs (\d+) modules in (\d+) packages")
_BLOCK = re.compile(r"```path-modules\n(.*?)```", re.S)
_TOKEN = re.compile(r"`([a-z_][a-z0-9_.]*)`")


def module_exists(root: Path, dotted: str) -> bool:
    return (root / (dotted.replace(".", "/") + ".py")).is_file()


def package_of(module: str) -> str:
    for package in PACKAGES:
        if module == package or module.startswith(package + "."):
            return package
    raise ValueError(f"{module} is in none of the layered packages {PACKAGES}")


def resolve(token: str, previous: str | None, root: Path) -> str | None:
    """`token` as a module: in full, or beside `previous`; trailing attributes (`mod.func`) dropped."""
    bases = [""] if token.split(".")[0] in {p.split(".")[0] for p in PACKAGES} else []
    if previous is not None:
        bases.append(previous.rsplit(".", 1)[0] + ".")
    for base in bases:
        parts = (base + token).split(".")
        for end in range(len(parts), 0, -1):
            if module_exists(root, ".".join(parts[:end])):
                return ".".join(parts[:end])
    return None


def table_modules(doc: str, root: Path) -> tuple[set[str], list[str]]:
    """The modules the path table names, and the tokens of its module column that name none."""
    section = doc[doc.index("## One rollout's path"):]
    found: set[str] = set()
    unresolved: list[str] = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 5 or not cells[1].isdigit() or any(p in cells[3] for p in FOREIGN_PROCESSES):
            continue
        previous = None
        for token in _TOKEN.findall(re.sub(r"\([^)]*\)", "", cells[2])):
            module = resolve(token, previous, root)
            if module is None:
                unresolved.append(token)
            else:
                found.add(module)
                previous = module
    return found, unresolved


def check_path(doc: str, root: Path = PACKAGE_ROOT) -> list[str]:
    """Every way the doc's path disagrees with itself or the code; empty when it is true."""
    block = _BLOCK.search(doc)
    count = _COUNT.search(doc)
    if block is None or count is None:
        return ["the doc needs a ```path-modules block and the sentence 'The path runs N modules in M packages'"]
    listed = block.group(1).split()
    problems = [f"{m}: no such module under nemo_rl/" for m in listed if not module_exists(root, m)]
    if len(set(listed)) != len(listed):
        problems.append(f"the block lists a module twice: {sorted(m for m in listed if listed.count(m) > 1)}")
    in_table, unresolved = table_modules(doc, root)
    problems += [f"the table names {t!r}, which is no module" for t in unresolved]
    if in_table != set(listed):
        problems.append(
            f"table and block differ: only in the table {sorted(in_table - set(listed))}, "
            f"only in the block {sorted(set(listed) - in_table)}"
        )
    packages = {package_of(m) for m in listed if module_exists(root, m)}
    stated = (int(count.group(1)), int(count.group(2)))
    if stated != (len(listed), len(packages)):
        problems.append(f"the doc says {stated[0]} modules in {stated[1]} packages; the block holds "
                        f"{len(listed)} in {len(packages)} ({sorted(packages)})")
    return problems


def test_the_architecture_docs_rollout_path_is_true_to_the_code() -> None:
    assert check_path(ARCHITECTURE_DOC.read_text()) == []


def test_a_wrong_count_a_missing_module_and_a_table_mismatch_are_each_named() -> None:
    doc = ARCHITECTURE_DOC.read_text()
    count = _COUNT.search(doc)
    assert count is not None
    n, m = int(count.group(1)), int(count.group(2))

    miscounted = doc.replace(count.group(0), f"The path runs {n + 1} modules in {m} packages")
    assert check_path(miscounted) == [
        f"the doc says {n + 1} modules in {m} packages; the block holds {n} in {m} "
        f"({sorted({package_of(x) for x in _BLOCK.search(doc).group(1).split()})})"
    ]

    vanished = doc.replace("data_plane.client\n", "data_plane.stage_shredder\n", 1)
    problems = check_path(vanished)
    assert "data_plane.stage_shredder: no such module under nemo_rl/" in problems
    assert any(p.startswith("table and block differ") and "'data_plane.client'" in p for p in problems)

    dropped = doc.replace("token_capture.metrics\n", "", 1)
    assert any("only in the table ['token_capture.metrics']" in p for p in check_path(dropped))
