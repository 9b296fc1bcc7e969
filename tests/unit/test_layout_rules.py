"""The house's layout rules, checked on the source (parsed with `ast`, never imported).

Contract:
- (a) No import cycle between modules anywhere in `nemo_rl`. Every `import` / `from ... import`
  of a `nemo_rl` module counts, absolute or relative, at module level or inside a function (a
  lazy import still runs in the same process; an import under `TYPE_CHECKING` counts too: it is
  a dependency all the same). `from package import name` is an edge to the
  submodule `package.name` when that module exists, else to the package itself; a package's
  `__init__` is a module like any other. A cycle fails naming its modules and one line per edge,
  unless its module set is in `KNOWN_CYCLES` (today's, outside the vLLM package, each owned by
  another issue's work); a known cycle that no longer occurs fails too, so the list only shrinks.
- (b) The vLLM worker's package runs one way, by layer (`VLLM_LAYERS`, lowest first):
  errors (a leaf, with config) < engine < chat < custody (+custody_state) < serving < http <
  worker (the actor shell and its off-path helpers). A worker-side module imports only its
  own layer or lower ones. The driver's side (`client`) imports only the leaf layer, so it never
  imports `worker`, and no worker-side module imports `client` or `launcher` (the driver's
  spawning, which hands the actor class to Ray). Outside the package, `nemo_rl`, `examples` and
  `benchmarks` import only its driver-facing modules (`DRIVER_API`). Only `http` imports
  aiohttp; only `chat`, `serving` and `tool_parsers` itself import `tool_parsers`.
- Every module of the package is placed in exactly one of these rooms (a new one must be).
- The checkers fail on planted counter-examples.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "nemo_rl"
VLLM = "nemo_rl.models.generation.vllm"

# Lowest first; a module may import its own layer and the layers below it.
VLLM_LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "config", "parser_names"),
    ("engine", "worker_extension"),
    ("chat", "tool_parsers", "parsers"),
    ("custody_state", "custody"),
    ("serving",),
    ("http",),
    ("lifecycle", "refit", "diagnostics", "worker"),
)
# The driver's side: `client` (worker group, served report) and `launcher` (spawning). The
# launcher alone may reach the worker side: it hands the actor class to Ray.
DRIVER_SIDE = ("client", "launcher")
CLIENT_MAY_IMPORT = VLLM_LAYERS[0]
# What the rest of the house may import from the package (everything else runs in the worker).
DRIVER_API = ("errors", "config", "client", "launcher")
AIOHTTP_MODULES = ("http",)
# `launcher` refuses, before any engine starts, a parser name the chat path does not apply yet.
TOOL_PARSER_USERS = ("chat", "serving", "tool_parsers", "launcher")
OUTSIDE_PACKAGES = ("examples", "benchmarks")

# Today's cycles (outside the vLLM package; their packages are being reworked elsewhere). Only ever
# delete entries: a new cycle is fixed, not listed.
KNOWN_CYCLES: dict[frozenset[str], str] = {
    frozenset({"nemo_rl.algorithms.grpo_async", "nemo_rl.algorithms.grpo_single_controller"}):
        "the async loop imports the sync loop's helpers; the sync loop's `run` imports the async loop "
        "lazily to dispatch to it",
    frozenset({"nemo_rl.algorithms.grpo_health", "nemo_rl.algorithms.setup"}):
        "set-up imports `build_watch`; the health checks import set-up's `Stack` for an annotation "
        "(under TYPE_CHECKING, which counts here like any import)",
    frozenset({"nemo_rl.models.policy.state_io", "nemo_rl.models.policy.worker"}):
        "the actor imports its state I/O; the state I/O imports the actor's `PolicyCore` (TYPE_CHECKING) "
        "and its micro-batch helpers (lazily)",
}

# module -> [(line, imported module or package)], every target a dotted name.
Edges = Mapping[str, Sequence[tuple[int, str]]]


def module_names(root: Path) -> dict[str, Path]:
    """Every module under `root` (a top-level package folder) by dotted name (`__init__` as its package)."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(module: str, is_package: bool, source: str, known: set[str]) -> list[tuple[int, str]]:
    """Every import in `source` (any depth), resolved: `from p import n` is `p.n` when that module is
    `known`, else `p`; relative imports are resolved against `module`."""
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
            for alias in node.names:
                found.append((node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base))
    return sorted(found)


def import_edges(root: Path) -> dict[str, list[tuple[int, str]]]:
    """`imports_of` every module under `root`, keeping the targets that are modules of `root`'s package."""
    names = module_names(root)
    known = set(names)
    edges: dict[str, list[tuple[int, str]]] = {}
    for module, path in names.items():
        is_package = path.name == "__init__.py"
        edges[module] = [(line, t) for line, t in imports_of(module, is_package, path.read_text(), known) if t in known]
    return edges


def import_cycles(edges: Edges, known: Mapping[frozenset[str], str] | None = None) -> list[str]:
    """One message per import cycle (a strongly connected set of two or more modules, or a module
    importing itself) not in `known`: its modules and the edges that close it, `module:line ->
    target`; and one per `known` cycle that no longer occurs."""
    graph = {m: sorted({t for _, t in targets if t in edges}) for m, targets in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        # Tarjan's algorithm, iterative (the graph has hundreds of modules).
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    known = known or {}
    messages = []
    for component in sorted(components):
        members = frozenset(component)
        if members in known:
            continue
        closing = sorted({f"{m}:{line} -> {t}" for m in component for line, t in edges[m] if t in members})
        messages.append(f"import cycle between {', '.join(component)}: {'; '.join(closing)}")
    found = {frozenset(c) for c in components}
    for members in sorted(set(known) - found, key=sorted):
        messages.append(f"KNOWN_CYCLES lists {', '.join(sorted(members))} but they no longer form a cycle: delete the entry")
    return messages


def short(module: str) -> str | None:
    """The vLLM package's module name (`serving`), or None for a module outside the package."""
    prefix = VLLM + "."
    return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else None


def vllm_layer_problems(
    edges: Edges,
    layers: Sequence[Sequence[str]] = VLLM_LAYERS,
    driver_side: Sequence[str] = DRIVER_SIDE,
) -> list[str]:
    """One message per import inside the vLLM package that breaks rule (b), and per unplaced module."""
    layer = {name: i for i, names in enumerate(layers) for name in names}
    placed = set(layer) | set(driver_side)
    problems = [
        f"{m} is in no room: place it in VLLM_LAYERS or DRIVER_SIDE (tests/unit/test_layout_rules.py) "
        "and in docs/design-docs/vllm-worker-capture.md"
        for m in sorted(edges) if short(m) is not None and short(m) not in placed
    ]
    for module in sorted(edges):
        source = short(module)
        if source is None or source not in placed:
            continue
        for line, target in edges[module]:
            dest = short(target)
            if dest is None or dest == source:
                continue
            where = f"{module}:{line} imports {target}"
            if source == "client" and dest not in CLIENT_MAY_IMPORT:
                problems.append(f"{where}: the driver's side imports only {', '.join(CLIENT_MAY_IMPORT)}")
            elif source in layer and dest in driver_side:
                problems.append(f"{where}: a worker-side module never imports the driver's side ({dest})")
            elif source in layer and dest in layer and layer[dest] > layer[source]:
                problems.append(
                    f"{where}: {dest!r} (layer {layer[dest]}) is above {source!r} (layer {layer[source]}); "
                    "move what it needs down, or pass it in from the layer above"
                )
    return problems


def third_party_problems(root: Path) -> list[str]:
    """Imports of aiohttp outside `http`, and of `tool_parsers` outside its users, in the vLLM package."""
    problems = []
    names = module_names(root)
    known = set(names)
    for module, path in names.items():
        name = short(module)
        if name is None:
            continue
        for line, target in imports_of(module, path.name == "__init__.py", path.read_text(), known):
            if target.split(".")[0] == "aiohttp" and name not in AIOHTTP_MODULES:
                problems.append(f"{module}:{line} imports {target}: only {', '.join(AIOHTTP_MODULES)} speaks aiohttp")
            if short(target) == "tool_parsers" and name not in TOOL_PARSER_USERS:
                problems.append(f"{module}:{line} imports {target}: parsers are used only by {', '.join(TOOL_PARSER_USERS)}")
    return problems


def outside_problems(edges: Edges) -> list[str]:
    """Imports of the vLLM package's worker-side modules from outside the package."""
    return [
        f"{module}:{line} imports {target}: outside the worker, use only {', '.join(DRIVER_API)}"
        for module in sorted(edges) if short(module) is None
        for line, target in edges[module]
        if short(target) is not None and short(target) not in DRIVER_API
    ]


def repo_edges() -> dict[str, list[tuple[int, str]]]:
    """Edges of `nemo_rl` plus, for the outside rule, the imports `examples` and `benchmarks` make of it."""
    edges = import_edges(PACKAGE_ROOT)
    known = set(module_names(PACKAGE_ROOT))
    for package in OUTSIDE_PACKAGES:
        for module, path in module_names(REPO / package).items():
            found = imports_of(module, path.name == "__init__.py", path.read_text(), known)
            edges[module] = [(line, t) for line, t in found if t in known]
    return edges


# --- the rules on this repository ---------------------------------------------------------------


def test_no_import_cycle_between_modules_of_nemo_rl() -> None:
    assert import_cycles(import_edges(PACKAGE_ROOT), KNOWN_CYCLES) == []


def test_the_vllm_worker_runs_one_way_down_its_layers() -> None:
    assert vllm_layer_problems(import_edges(PACKAGE_ROOT)) == []


def test_only_http_speaks_aiohttp_and_only_chat_and_serving_use_the_tool_parsers() -> None:
    assert third_party_problems(PACKAGE_ROOT) == []


def test_the_driver_and_the_rest_of_the_house_import_only_the_workers_driver_api() -> None:
    assert outside_problems(repo_edges()) == []


def test_every_room_of_the_vllm_package_holds_a_module() -> None:
    present = {short(m) for m in module_names(PACKAGE_ROOT) if short(m) is not None}
    rooms = {name for names in VLLM_LAYERS for name in names} | set(DRIVER_SIDE)
    assert rooms <= present, f"rooms without a module: {sorted(rooms - present)}"


# --- the checkers fail on planted counter-examples ----------------------------------------------


def test_a_lazy_import_closing_a_cycle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "nemo_rl" / "data"
    pkg.mkdir(parents=True)
    (tmp_path / "nemo_rl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from nemo_rl.data import b\n")
    (pkg / "b.py").write_text("import os\n\n\ndef f():\n    from .a import thing\n")
    (pkg / "c.py").write_text("from nemo_rl.data.a import x\n")
    assert import_cycles(import_edges(tmp_path / "nemo_rl")) == [
        "import cycle between nemo_rl.data.a, nemo_rl.data.b: nemo_rl.data.a:1 -> nemo_rl.data.b; "
        "nemo_rl.data.b:5 -> nemo_rl.data.a"
    ]


def test_a_module_importing_itself_is_a_cycle_and_a_vanished_known_cycle_fails() -> None:
    edges = {"nemo_rl.x": [(3, "nemo_rl.x")], "nemo_rl.y": [(1, "nemo_rl.z")], "nemo_rl.z": [(2, "nemo_rl.y")]}
    known = {frozenset({"nemo_rl.y", "nemo_rl.z"}): "why", frozenset({"nemo_rl.a", "nemo_rl.b"}): "why"}
    assert import_cycles(edges, known) == [
        "import cycle between nemo_rl.x: nemo_rl.x:3 -> nemo_rl.x",
        "KNOWN_CYCLES lists nemo_rl.a, nemo_rl.b but they no longer form a cycle: delete the entry",
    ]


def test_an_upward_import_the_client_reaching_the_worker_and_an_unplaced_module_are_named() -> None:
    v = VLLM
    edges = {
        f"{v}.engine": [(12, f"{v}.serving"), (13, f"{v}.errors")],
        f"{v}.custody": [(40, f"{v}.client")],
        f"{v}.client": [(7, f"{v}.worker"), (8, f"{v}.errors")],
        f"{v}.streaming": [(1, f"{v}.chat")],
        f"{v}.worker": [(20, f"{v}.http"), (21, f"{v}.lifecycle")],
    }
    assert vllm_layer_problems(edges) == [
        f"{v}.streaming is in no room: place it in VLLM_LAYERS or DRIVER_SIDE (tests/unit/test_layout_rules.py) "
        "and in docs/design-docs/vllm-worker-capture.md",
        f"{v}.client:7 imports {v}.worker: the driver's side imports only errors, config, parser_names",
        f"{v}.custody:40 imports {v}.client: a worker-side module never imports the driver's side (client)",
        f"{v}.engine:12 imports {v}.serving: 'serving' (layer 4) is above 'engine' (layer 1); "
        "move what it needs down, or pass it in from the layer above",
    ]


def test_the_driver_importing_the_actor_module_is_named() -> None:
    edges = {
        "nemo_rl.experience.rollout_manager": [(36, f"{VLLM}.worker"), (37, f"{VLLM}.errors")],
        "benchmarks.engine_ab": [(130, f"{VLLM}.config")],
    }
    assert outside_problems(edges) == [
        f"nemo_rl.experience.rollout_manager:36 imports {VLLM}.worker: outside the worker, use only "
        "errors, config, client, launcher"
    ]
