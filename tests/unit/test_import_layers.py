"""The package import graph of `nemo_rl` runs one way: down the layers of `LAYERS`.

Contract:
- `LAYERS` (lowest first) is the order docs/design-docs/architecture.md states. A module may
  import its own package and any package of a LOWER layer; packages that share a layer
  (`models.generation`, `models.policy`: two different processes) do not import each other.
- Every `import` / `from ... import` of `nemo_rl.*` counts, absolute or relative, at module
  level or inside a function (both run in the same process). Modules are parsed with `ast`,
  never imported. Module paths passed as strings (subprocess and Ray entry points) are process
  boundaries, not imports, and are not checked.
- An upward import fails, naming module, line and fix, unless its (module, package) pair is in
  `KNOWN_UPWARD` (today's, until the Layout move); a `KNOWN_UPWARD` entry that no longer occurs
  fails too, so the list only shrinks. The architecture doc shows `LAYERS` and `KNOWN_UPWARD`
  as rendered here (`render_layers`, `render_known_upward`).
- No `nemo_rl` module imports the repository's packages outside the library (`OUTSIDE_LIBRARY`:
  the example task and its tiny model, benchmarks, tests), at any depth (`outside_imports`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "nemo_rl"
ARCHITECTURE_DOC = REPO / "docs" / "design-docs" / "architecture.md"

# Lowest first, as shared/DESIGN.md's "Where things live" lists the target. One choice of ours:
# `data` holds the cross-process records (Layout issue, item 1): it imports no other package.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("data",),
    ("utils",),
    ("distributed",),
    ("data_plane",),
    ("token_capture",),
    ("models.generation", "models.policy"),
    ("environments",),
    ("experience",),
    ("algorithms",),
)
# Top-level packages of this repository outside the library: `nemo_rl` never imports them (the
# example task is reached through `env.task`, benchmark hooks through NRL_INSTRUMENTATION).
OUTSIDE_LIBRARY = ("examples", "benchmarks", "tests")

# Today's upward imports: (importing module, imported package) -> where it goes in the Layout move.
# Only ever delete entries; a new upward import is fixed, not listed.
KNOWN_UPWARD: dict[tuple[str, str], str] = {
}

# (line, imported module) per importing module, every module named as dotted `nemo_rl.*`.
ImportMap = Mapping[str, Sequence[tuple[int, str]]]


def package_of(module: str) -> str | None:
    """The package of `LAYERS` granularity that `module` belongs to (`models.<x>` for models);
    None for the namespaces `nemo_rl` and `nemo_rl.models` themselves."""
    rest = module.split(".")[1:]
    if not rest:
        return None
    if rest[0] == "models":
        return f"models.{rest[1]}" if len(rest) > 1 else None
    return rest[0]


def imported_modules(module: str, is_package: bool, source: str) -> list[tuple[int, str]]:
    """Every `nemo_rl.*` module `source` imports, anywhere in the file, with relative imports resolved.

    `from nemo_rl import x` (a namespace) counts as importing `nemo_rl.x`, so the target has a package."""
    own_package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = own_package[: len(own_package) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.startswith("nemo_rl") and package_of(base) is None:
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
    # ast.walk is breadth first: sort so a function's imports sit at their own lines.
    return sorted((line, name) for line, name in found if name == "nemo_rl" or name.startswith("nemo_rl."))


def import_map(root: Path) -> dict[str, list[tuple[int, str]]]:
    """`imported_modules` of every module under `root` (the `nemo_rl` folder), keyed by dotted name."""
    result: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        result[module] = imported_modules(module, is_package, path.read_text())
    return result


def outside_imports(root: Path, outside: Sequence[str]) -> list[str]:
    """`module:line imports name` for every absolute import, anywhere under `root`, of a package in `outside`."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import)
                else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                else []
            )
            found += [f"{module}:{node.lineno} imports {name}" for name in names if name.split(".")[0] in outside]
    return sorted(found)


def layer_index(layers: Sequence[Sequence[str]]) -> dict[str, int]:
    return {package: i for i, layer in enumerate(layers) for package in layer}


def check_layers(
    imports: ImportMap, layers: Sequence[Sequence[str]], known_upward: Iterable[tuple[str, str]]
) -> list[str]:
    """One message per import that runs up or across the layers and is not known, and one per
    known pair that no longer occurs; empty when the graph follows `layers`."""
    index = layer_index(layers)
    known = set(known_upward)
    seen_upward: set[tuple[str, str]] = set()
    errors: list[str] = []
    for module in sorted(imports):
        source = package_of(module)
        for line, target in imports[module]:
            dest = package_of(target)
            unplaced = [p for p in (source, dest) if p not in index]
            if unplaced:
                errors.append(
                    f"{module}:{line} imports {target}: package {unplaced[0]!r} is not in LAYERS; "
                    f"place it in LAYERS (tests/unit/test_import_layers.py) and in {ARCHITECTURE_DOC.relative_to(REPO)}"
                )
                continue
            if dest == source or index[dest] < index[source]:
                continue
            seen_upward.add((module, dest))
            if (module, dest) in known:
                continue
            errors.append(
                f"{module}:{line} imports {target}: {dest!r} (layer {index[dest]}) is not below {source!r} "
                f"(layer {index[source]}). Fix: move what it needs down to a layer below {source!r} "
                f"(records that cross processes go to nemo_rl/data), or move this module up to the "
                f"package of the process that runs it; do not add it to KNOWN_UPWARD"
            )
    for module, dest in sorted(known - seen_upward):
        errors.append(
            f"KNOWN_UPWARD lists ({module!r}, {dest!r}) but {module} no longer imports {dest!r} upward: "
            f"delete the entry and its row in {ARCHITECTURE_DOC.relative_to(REPO)}"
        )
    return errors


def render_layers(layers: Sequence[Sequence[str]]) -> str:
    return " -> ".join(" | ".join(layer) for layer in layers)


def render_known_upward(known_upward: Mapping[tuple[str, str], str]) -> str:
    rows = [f"| `{module}` | `{dest}` | {where} |" for (module, dest), where in sorted(known_upward.items())]
    return "\n".join(["| importing module | imports (upward) | moves to |", "|---|---|---|", *rows])


def test_nemo_rl_imports_run_down_the_layers() -> None:
    assert check_layers(import_map(PACKAGE_ROOT), LAYERS, KNOWN_UPWARD) == []


def test_the_library_imports_no_example_benchmark_or_test_module() -> None:
    assert outside_imports(PACKAGE_ROOT, OUTSIDE_LIBRARY) == []


def test_outside_imports_are_found_at_any_depth(tmp_path: Path) -> None:
    (tmp_path / "nemo_rl" / "algorithms").mkdir(parents=True)
    (tmp_path / "nemo_rl" / "algorithms" / "setup.py").write_text(
        "import os\nfrom nemo_rl.utils import config\ndef f():\n    from examples.arith.tiny_model import build\n"
        "import benchmarks.wire_metrics as wm\n"
    )
    assert outside_imports(tmp_path / "nemo_rl", OUTSIDE_LIBRARY) == [
        "nemo_rl.algorithms.setup:4 imports examples.arith.tiny_model",
        "nemo_rl.algorithms.setup:5 imports benchmarks.wire_metrics",
    ]


def test_the_checker_names_an_upward_import_its_line_and_the_fix() -> None:
    imports = {
        "nemo_rl.utils.logger": [(3, "nemo_rl.utils.aio"), (7, "nemo_rl.algorithms.grpo")],
        "nemo_rl.algorithms.grpo": [(5, "nemo_rl.utils.logger")],
    }
    assert check_layers(imports, LAYERS, known_upward=()) == [
        "nemo_rl.utils.logger:7 imports nemo_rl.algorithms.grpo: 'algorithms' (layer 8) is not below 'utils' "
        "(layer 1). Fix: move what it needs down to a layer below 'utils' (records that cross processes go to "
        "nemo_rl/data), or move this module up to the package of the process that runs it; do not add it to "
        "KNOWN_UPWARD"
    ]
    assert check_layers(imports, LAYERS, known_upward=[("nemo_rl.utils.logger", "algorithms")]) == []


def test_a_sibling_import_and_a_vanished_known_entry_fail() -> None:
    imports = {"nemo_rl.models.policy.worker": [(9, "nemo_rl.models.generation.vllm.serving")]}
    sibling, stale = check_layers(imports, LAYERS, known_upward=[("nemo_rl.distributed.stack", "environments")])
    assert sibling.startswith(
        "nemo_rl.models.policy.worker:9 imports nemo_rl.models.generation.vllm.serving: 'models.generation' (layer 5) "
        "is not below 'models.policy' (layer 5). Fix:"
    )
    assert stale == (
        "KNOWN_UPWARD lists ('nemo_rl.distributed.stack', 'environments') but nemo_rl.distributed.stack no longer "
        "imports 'environments' upward: delete the entry and its row in docs/design-docs/architecture.md"
    )


def test_relative_function_level_and_namespace_imports_are_collected() -> None:
    source = (
        "from . import client\n"
        "from ..utils.aio import gather_cancelling\n"
        "from nemo_rl.models import policy\n"
        "import numpy\n"
        "def f():\n"
        "    import nemo_rl.algorithms.grpo as g\n"
    )
    assert imported_modules("nemo_rl.data_plane.plane", False, source) == [
        (1, "nemo_rl.data_plane"), (2, "nemo_rl.utils.aio"), (3, "nemo_rl.models.policy"), (6, "nemo_rl.algorithms.grpo"),
    ]
    assert imported_modules("nemo_rl.data_plane", True, "from .client import X\n") == [(1, "nemo_rl.data_plane.client")]


def test_the_architecture_doc_states_these_layers_and_known_upward_imports() -> None:
    doc = ARCHITECTURE_DOC.read_text()
    assert render_layers(LAYERS) in doc, f"{ARCHITECTURE_DOC}: state the layers as `{render_layers(LAYERS)}`"
    assert render_known_upward(KNOWN_UPWARD) in doc, (
        f"{ARCHITECTURE_DOC}: replace its upward-imports table with\n{render_known_upward(KNOWN_UPWARD)}"
    )
