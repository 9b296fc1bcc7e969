"""Wire metrics for the capture A/B benchmark: HTTP body bytes and per-call capture time.

A hook module of the library's instrumentation seam (`nemo_rl/utils/instrumentation.py`):
`benchmarks/capture_ab.py` sets `NRL_INSTRUMENTATION=benchmarks.wire_metrics` and
`NRL_WIRE_METRICS_DIR=<dir>` for the runs it measures, and every process of the run (the Gym
servers, the vLLM worker actor) then calls the hooks below. Without `NRL_WIRE_METRICS_DIR` every
hook is a no-op that adds no middleware, no thread and no file. Both are environment variables,
not recipe keys, because they must reach processes the benchmark does not configure directly,
and they change nothing about what a run computes.

Contract (on):
- One `WireMetrics` per process (`process_metrics(role)`), written atomically as
  `<dir>/<role>-<pid>.json` by a daemon thread every `FLUSH_INTERVAL_S` while something changed,
  and once more at interpreter exit. The file holds `role`, `pid`, `http` (route class ->
  `requests`, `request_bytes`, `response_bytes`: HTTP BODY bytes as the server read and wrote
  them, headers not counted; `seconds`: summed handling time), `counters` (name -> number) and
  `calls` (one sample per chat
  call the worker served, at most `MAX_CALL_SAMPLES`; later calls are counted in
  `counters["dropped_call_samples"]`).
- Route classes (`route_class`, pure): `control` (any path with `/control/`), `health`,
  `model` (paths ending in `/chat/completions`, `/responses` or `/messages`: the model traffic
  of the agent -> gate and gate -> worker links), else the path's last segment (`run`,
  `verify`, `tokenize`, a tool name, ...). Rollout ids in paths never become classes.
- Gym servers (uvicorn/Starlette apps): `server_module_argv(module)` is the one hook in the
  launcher; on, it runs `python -m benchmarks.wire_metrics <module>`, which wraps
  the ASGI app Gym hands to `uvicorn.run` in `CountingASGI` and then runs `<module>` as
  `__main__`. The role is the server's Gym config key (`NEMO_GYM_CONFIG_PATH`).
- The vLLM worker (aiohttp): `aiohttp_middlewares()` returns one outermost middleware that
  counts bodies per route class and, for POST `/v1/chat/completions`, opens a per-call cost
  scope (a context variable) and records one call sample: `total_s` (the worker's whole
  handling of the call), the capture parts added into the scope by `add_call_cost` (`begin_call_s`,
  `prefix_fetch_s`, `commit_s` which includes `stage_s`), and `status`.
  `time_capture_calls(service)` wraps the service's installed Gym capture core so that
  `begin_call` and `complete_call_from_response` report their time. The sink and source
  (`data_plane.partitions`) report `stage_s`, `staged_bytes` and `prefix_fetch_s` themselves.
  The scope follows the call into `asyncio.to_thread` (which copies the context; the scope is
  a mutable dict shared by the copies).
- `set_call_fact` puts facts about the call into its sample: the engine's start time
  (`generate_t0_s`, `time.perf_counter` of the worker process), `prompt_tokens` and
  `generated_tokens`, from which the benchmark rebuilds the engine's load over time.
- `add_call_cost` / `set_call_fact` outside a scope (a finalizer's fetch, a test) do nothing.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import os
import re
import runpy
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

ENV_DIR = "NRL_WIRE_METRICS_DIR"
# The Gym launcher gives each server its config key in this variable (nemo_gym_launch.CONFIG_PATH_ENV).
GYM_ROLE_ENV = "NEMO_GYM_CONFIG_PATH"
FLUSH_INTERVAL_S = 0.5
MAX_CALL_SAMPLES = 200_000
CHAT_ROUTE = "/v1/chat/completions"
_MODEL_SUFFIXES = ("/chat/completions", "/responses", "/messages")
_ROLE_RE = re.compile(r"[^A-Za-z0-9_.-]")

_call_costs: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("nrl_call_costs", default=None)


def enabled() -> bool:
    return bool(os.environ.get(ENV_DIR))


def route_class(path: str) -> str:
    """The class a request path is counted under (see the module contract; pure)."""
    if "/control/" in path:
        return "control"
    stripped = path.rstrip("/")
    if stripped.endswith(_MODEL_SUFFIXES):
        return "model"
    last = stripped.rsplit("/", 1)[-1]
    if last in ("health", ""):
        return "health" if last else "root"
    return last


class WireMetrics:
    """Thread-safe counters of one process, flushed to `<dir>/<role>-<pid>.json`."""

    def __init__(self, directory: Path, role: str) -> None:
        self.role = _ROLE_RE.sub("_", role) or "process"
        self.path = directory / f"{self.role}-{os.getpid()}.json"
        self._lock = threading.Lock()
        self._http: dict[str, dict[str, int]] = {}
        self._counters: dict[str, float] = {}
        self._calls: list[dict[str, Any]] = []
        self._dirty = True

    def add_http(self, route: str, request_bytes: int, response_bytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            entry = self._http.setdefault(
                route, {"requests": 0, "request_bytes": 0, "response_bytes": 0, "seconds": 0.0})
            entry["requests"] += 1
            entry["request_bytes"] += request_bytes
            entry["response_bytes"] += response_bytes
            entry["seconds"] += seconds
            self._dirty = True

    def add_counter(self, name: str, value: float) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0.0) + value
            self._dirty = True

    def add_call(self, sample: Mapping[str, Any]) -> None:
        with self._lock:
            if len(self._calls) < MAX_CALL_SAMPLES:
                self._calls.append(dict(sample))
            else:
                self._counters["dropped_call_samples"] = self._counters.get("dropped_call_samples", 0.0) + 1
            self._dirty = True

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "role": self.role,
                "pid": os.getpid(),
                "http": {route: dict(entry) for route, entry in self._http.items()},
                "counters": dict(self._counters),
                "calls": list(self._calls),
            }

    def flush(self, force: bool = False) -> None:
        with self._lock:
            if not (self._dirty or force):
                return
            self._dirty = False
        payload = json.dumps(self.snapshot())
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(payload)
        os.replace(tmp, self.path)


_process: WireMetrics | None = None
_process_lock = threading.Lock()


def process_metrics(role: str) -> WireMetrics | None:
    """This process's metrics (created on first use with `role`), or None when off."""
    global _process
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    with _process_lock:
        if _process is None:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            _process = WireMetrics(path, role)
            _start_flusher(_process)
        return _process


def _start_flusher(metrics: WireMetrics) -> None:
    def loop() -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            metrics.flush()

    threading.Thread(target=loop, name="nrl-wire-metrics", daemon=True).start()
    atexit.register(metrics.flush, True)


def add_call_cost(part: str, seconds: float) -> None:
    """Add `seconds` to `part` of the current call's cost scope; nothing outside a scope."""
    costs = _call_costs.get()
    if costs is not None:
        costs[part] = costs.get(part, 0.0) + seconds


def set_call_fact(name: str, value: float) -> None:
    """Set `name` in the current call's scope (a count or a timestamp, not summed); nothing outside a scope."""
    costs = _call_costs.get()
    if costs is not None:
        costs[name] = value


def active() -> bool:
    """True once this process has created its metrics (`process_metrics` with the variable set)."""
    return _process is not None


def add_counter(name: str, value: float) -> None:
    """Add to a process counter when metrics are on (e.g. staged bytes); nothing when off."""
    if _process is not None:
        _process.add_counter(name, value)


# --- ASGI (the Gym servers) ----------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Any]
Send = Callable[[MutableMapping[str, Any]], Any]


class CountingASGI:
    """Counts HTTP request and response body bytes per route class around an ASGI app."""

    def __init__(self, app: Callable[..., Any], metrics: WireMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        counts = [0, 0]
        started = time.perf_counter()

        async def counting_receive() -> MutableMapping[str, Any]:
            message = await receive()
            if message.get("type") == "http.request":
                counts[0] += len(message.get("body") or b"")
            return message

        async def counting_send(message: MutableMapping[str, Any]) -> None:
            if message.get("type") == "http.response.body":
                counts[1] += len(message.get("body") or b"")
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            self.metrics.add_http(
                route_class(str(scope.get("path") or "")), counts[0], counts[1], time.perf_counter() - started)


def server_module_argv(module: str) -> list[str]:
    """What follows `python -m` to launch a Gym server module: the module, or this runner around it."""
    return [__name__, module] if enabled() else [module]


def run_module_counted(module: str) -> None:
    """Run a Gym server module as `__main__` with `uvicorn.run`'s app wrapped in `CountingASGI`."""
    import uvicorn

    metrics = process_metrics(os.environ.get(GYM_ROLE_ENV) or module)
    original_run = uvicorn.run

    def counted_run(app: Any = None, *args: Any, **kwargs: Any) -> Any:
        if "app" in kwargs:
            app = kwargs.pop("app")
        if metrics is not None and not isinstance(app, str):
            app = CountingASGI(app, metrics)
        return original_run(app, *args, **kwargs)

    uvicorn.run = counted_run
    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# --- aiohttp (the vLLM worker) -------------------------------------------------------------------


def aiohttp_middlewares(role: str = "worker") -> list[Callable[..., Any]]:
    """[the counting middleware] when on, [] when off (see the module contract)."""
    metrics = process_metrics(role)
    if metrics is None:
        return []
    from aiohttp import web

    @web.middleware
    async def count_bytes(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        is_call = request.method == "POST" and request.path == CHAT_ROUTE
        costs: dict[str, float] = {}
        token = _call_costs.set(costs) if is_call else None
        started = time.perf_counter()
        status = 0
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            total_s = time.perf_counter() - started
            if token is not None:
                _call_costs.reset(token)
            request_bytes = request.content_length or 0
            body = getattr(response, "body", None)
            response_bytes = len(body) if isinstance(body, (bytes, bytearray)) else 0
            metrics.add_http(route_class(request.path), request_bytes, response_bytes, total_s)
            if is_call:
                metrics.add_call({"total_s": total_s, "status": status, **costs})

    return [count_bytes]


class TimedCapture:
    """Gym's capture core with `begin_call` / `complete_call_from_response` / `fail_call` timed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def begin_call(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._inner.begin_call(*args, **kwargs)
        finally:
            add_call_cost("begin_call_s", time.perf_counter() - started)

    def complete_call_from_response(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._inner.complete_call_from_response(*args, **kwargs)
        finally:
            add_call_cost("commit_s", time.perf_counter() - started)

    def fail_call(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._inner.fail_call(*args, **kwargs)
        finally:
            add_call_cost("commit_s", time.perf_counter() - started)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def time_capture_calls(service: Any) -> None:
    """When on, re-install the service's capture core wrapped in `TimedCapture`; nothing when off."""
    if process_metrics("worker") is None or service.custody is None:  # custody None: token capture off
        return
    service.custody.install_token_capture(TimedCapture(service.custody.capture))


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        raise SystemExit(f"usage: python -m {__name__} <server module>")
    run_module_counted(args[0])


if __name__ == "__main__":
    # Through the canonical module, so the counters live in one module object whatever runpy does to __main__.
    from benchmarks.wire_metrics import main as _main

    _main()
