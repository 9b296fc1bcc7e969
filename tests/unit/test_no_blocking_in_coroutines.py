"""No blocking call runs on an event loop: `async def` bodies in `nemo_rl` offload or await.

Contract:
- Every `async def` in `nemo_rl` is parsed with `ast` (never imported). Its own body may not
  call what blocks the thread it runs on: `ray.get` / `ray.wait`, `time.sleep`, `subprocess.*`
  runners, `requests.*`, a thread's `.join()`, the project's sync Ray and process helpers
  (`BLOCKING_FUNCTIONS`) and teardowns (`BLOCKING_TEARDOWNS`), or a sync `DataPlaneClient` call
  (`attach_client`; `put`/`put_many`/`get`/`list_keys`/`clear`/`close` on a receiver named `*client`).
- An awaited call is a coroutine, not a blocking call. Nested sync `def`s and lambdas are not
  the body (they run where they are sent, typically `asyncio.to_thread`); a callable passed by
  name (`asyncio.to_thread(ray.get, ref)`) is not a call.
- A finding names module:line, the call and the fix. `ALLOWED` lists the unavoidable ones, each
  with its reason; an entry that no longer occurs fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "nemo_rl"

_RAY_FIX = "await the ObjectRef(s) (`await_with_deadline`) or `await asyncio.to_thread(ray.get, ...)`"
_OFFLOAD = "`await asyncio.to_thread(...)` it"
# (module name as written, attribute) -> fix. `None` as attribute: every attribute of the module.
BLOCKING_MODULE_CALLS: dict[tuple[str, str | None], str] = {
    ("ray", "get"): _RAY_FIX,
    ("ray", "wait"): "`asyncio.wait` on the awaited refs, or " + _OFFLOAD,
    ("time", "sleep"): "`await asyncio.sleep(...)`",
    ("subprocess", "run"): "`asyncio.create_subprocess_exec` or " + _OFFLOAD,
    ("subprocess", "call"): "`asyncio.create_subprocess_exec` or " + _OFFLOAD,
    ("subprocess", "check_call"): "`asyncio.create_subprocess_exec` or " + _OFFLOAD,
    ("subprocess", "check_output"): "`asyncio.create_subprocess_exec` or " + _OFFLOAD,
    ("requests", None): "aiohttp with a per-request `aiohttp.ClientTimeout`",
}
# Project functions that block on Ray or on processes (called by bare name or as an attribute).
BLOCKING_FUNCTIONS: dict[str, str] = {
    "call_with_deadline": "`await await_with_deadline(...)` (nemo_rl.distributed.actor_call)",
    "actor_node_ids": _OFFLOAD,
    "terminate_processes": _OFFLOAD,
    "start_or_join_ray": _OFFLOAD + " (or run it before the loop starts)",
    "start_ray_for_stack": _OFFLOAD + " (or run it before the loop starts)",
    "start_data_plane": _OFFLOAD,
    "attach_client": "`await attach_client_async(...)` (nemo_rl.data_plane.plane)",
    "spawn_workers": _OFFLOAD,
    "await_workers": _OFFLOAD,
}
# The project's sync teardowns, by method and the name their receiver ends with: each joins
# processes or waits on Ray actors.
BLOCKING_TEARDOWNS: dict[tuple[str, str], str] = {
    ("stop", "env"): "`await env.aclose()` (NemoGymEnvironment)",
    ("stop", "stack"): "`await stack.aclose()` (Stack)",
    ("close", "run"): "`await run.aclose()` (GRPORun)",
    ("shutdown", "workers"): _OFFLOAD + " (WorkerGroup.shutdown waits on every worker)",
}
# Sync DataPlaneClient methods (nemo_rl/data_plane/client.py); each waits on the client's loop thread.
DATA_PLANE_SYNC_METHODS = frozenset({"put", "put_many", "get", "list_keys", "clear", "close"})
_DATA_PLANE_FIX = "`await asyncio.to_thread(client.<method>, ...)` (the client's calls block until its loop answers)"

# (module relative to the repo, call as reported) -> why it stays. Only ever delete entries.
ALLOWED: dict[tuple[str, str], str] = {
    ("nemo_rl/algorithms/setup.py", "start_ray_for_stack"): (
        "ray.init installs its SIGTERM handler only on the main thread, and it runs first in "
        "start_stack, before anything else is scheduled on the loop"
    ),
}


@dataclass(frozen=True)
class Finding:
    module: str
    line: int
    call: str
    fix: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: `{self.call}` blocks the event loop inside an async def; fix: {self.fix}"


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _terminal_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def classify_call(call: ast.Call) -> tuple[str, str] | None:
    """(call as written, fix) if `call` blocks the calling thread, else None."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in BLOCKING_FUNCTIONS:
        return func.id, BLOCKING_FUNCTIONS[func.id]
    if not isinstance(func, ast.Attribute):
        return None
    written = _dotted(func) or f"<expr>.{func.attr}"
    if func.attr in BLOCKING_FUNCTIONS:
        return written, BLOCKING_FUNCTIONS[func.attr]
    if isinstance(func.value, ast.Name):
        for key in ((func.value.id, func.attr), (func.value.id, None)):
            if key in BLOCKING_MODULE_CALLS:
                return written, BLOCKING_MODULE_CALLS[key]
    receiver = _terminal_name(func.value)
    for (method, suffix), fix in BLOCKING_TEARDOWNS.items():
        if func.attr == method and receiver is not None and receiver.lower().endswith(suffix):
            return written, fix
    if func.attr in DATA_PLANE_SYNC_METHODS and receiver is not None and receiver.lower().endswith("client"):
        return written, _DATA_PLANE_FIX.replace("<method>", func.attr)
    # A thread's join takes no positional argument (str.join and os.path.join take at least one).
    if func.attr == "join" and not call.args and not isinstance(func.value, ast.Constant):
        return written, _OFFLOAD + " (a thread's join waits on the thread)"
    return None


class _AsyncBodyVisitor(ast.NodeVisitor):
    """Collects blocking calls in the bodies of async defs, not in nested sync defs or lambdas."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.findings: list[Finding] = []
        self._in_async = False
        self._awaited: set[int] = set()  # ids of calls that are `await`ed: coroutines, not blocking

    def visit_Await(self, node: ast.Await) -> None:
        if isinstance(node.value, ast.Call):
            self._awaited.add(id(node.value))
        self.generic_visit(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        outer, self._in_async = self._in_async, True
        self.generic_visit(node)
        self._in_async = outer

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer, self._in_async = self._in_async, False
        self.generic_visit(node)
        self._in_async = outer

    def visit_Lambda(self, node: ast.Lambda) -> None:
        outer, self._in_async = self._in_async, False
        self.generic_visit(node)
        self._in_async = outer

    def visit_Call(self, node: ast.Call) -> None:
        if self._in_async and id(node) not in self._awaited:
            found = classify_call(node)
            if found is not None:
                self.findings.append(Finding(self.module, node.lineno, *found))
        self.generic_visit(node)


def blocking_calls(source: str, module: str) -> list[Finding]:
    """Every blocking call in an async def body of `source` (see the contract)."""
    visitor = _AsyncBodyVisitor(module)
    visitor.visit(ast.parse(source, filename=module))
    return visitor.findings


def package_findings() -> list[Finding]:
    findings: list[Finding] = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        findings.extend(blocking_calls(path.read_text(), str(path.relative_to(REPO))))
    return findings


def test_no_blocking_call_in_any_coroutine_of_nemo_rl() -> None:
    findings = [f for f in package_findings() if (f.module, f.call) not in ALLOWED]
    assert not findings, "blocking calls on the event loop:\n" + "\n".join(map(str, findings))


def test_every_allowed_entry_still_occurs() -> None:
    present = {(f.module, f.call) for f in package_findings()}
    stale = sorted(set(ALLOWED) - present)
    assert not stale, f"ALLOWED entries that no longer occur (delete them): {stale}"


PLANTED = '''
import asyncio, ray, time, subprocess, threading

async def bad(ref, thread, client, cfg):
    ray.get(ref)
    ray.wait([ref])
    time.sleep(1)
    subprocess.run(["true"], timeout=1)
    thread.join()
    thread.join(timeout=2)
    self_client = client
    self_client.put_many("p", [], [])
    attach_client(cfg)
    call_with_deadline(ref, actor="a", op="b", timeout_s=1)
    requests.get("http://x", timeout=1)
    self.stack.stop()
    run.close()
'''


def test_the_checker_catches_planted_blocking_calls() -> None:
    findings = blocking_calls(PLANTED, "planted.py")
    calls = [f.call for f in findings]
    assert calls == [
        "ray.get", "ray.wait", "time.sleep", "subprocess.run", "thread.join", "thread.join",
        "self_client.put_many", "attach_client", "call_with_deadline", "requests.get",
        "self.stack.stop", "run.close",
    ]
    first = str(findings[0])
    assert first.startswith("planted.py:5: `ray.get` blocks the event loop") and "await_with_deadline" in first


def test_offloaded_and_nested_sync_calls_pass() -> None:
    source = '''
import asyncio, ray, time

async def good(ref, thread, client, parts):
    await asyncio.to_thread(ray.get, ref, timeout=5)
    await asyncio.to_thread(thread.join, 5)
    await asyncio.to_thread(client.put_many, "p", [], [])
    await asyncio.sleep(0.1)
    await asyncio.to_thread(lambda: ray.get(ref))
    await env.aclose()
    await client.close()  # an async client's close (e.g. openai.AsyncOpenAI) is awaited
    loop.stop()
    ", ".join(parts)

    def blocking_part():
        time.sleep(1)
        return ray.get(ref)

    return await asyncio.to_thread(blocking_part)

def sync_caller(ref):
    return ray.get(ref)
'''
    assert blocking_calls(source, "good.py") == []


def test_a_nested_async_def_in_a_sync_def_is_checked() -> None:
    source = '''
import time

def outer():
    async def inner():
        time.sleep(1)
    return inner
'''
    assert [f.call for f in blocking_calls(source, "nested.py")] == ["time.sleep"]
