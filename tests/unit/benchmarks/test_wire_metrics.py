"""wire_metrics: route classes, the flushed file, the ASGI and aiohttp counters, call-cost scopes."""

from __future__ import annotations

import asyncio
import contextvars
import json
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from benchmarks import wire_metrics as wm


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Metrics on, into tmp_path, with a fresh process singleton (restored afterwards)."""
    monkeypatch.setenv(wm.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(wm, "_process", None)
    monkeypatch.setattr(wm, "_start_flusher", lambda metrics: None)  # flushed explicitly in tests
    return tmp_path


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/chat/completions", "model"),
        ("/ng-rollout/r-s1-g0-i0-a0/training-token-capture/v1/responses", "model"),
        ("/v1/messages/", "model"),
        ("/training-token-capture/control/rollouts/r-1/manifest", "control"),
        ("/control/state", "control"),
        ("/health", "health"),
        ("/run", "run"),
        ("/calculator", "calculator"),
        ("/", "root"),
    ],
)
def test_route_class(path: str, expected: str) -> None:
    assert wm.route_class(path) == expected


def test_everything_is_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(wm.ENV_DIR, raising=False)
    monkeypatch.setattr(wm, "_process", None)
    assert wm.process_metrics("worker") is None
    assert wm.aiohttp_middlewares() == []
    assert wm.server_module_argv("responses_api_models.vllm_model.app") == ["responses_api_models.vllm_model.app"]
    assert wm.active() is False
    wm.add_call_cost("stage_s", 1.0)  # no scope: nothing happens, nothing raises
    wm.add_counter("staged_bytes", 10)


def test_launcher_runs_the_counting_runner_when_on(fresh: Path) -> None:
    assert wm.server_module_argv("nemo_rl.environments.gate.app") == [
        "benchmarks.wire_metrics", "nemo_rl.environments.gate.app"]


def test_flushed_file_holds_http_counters_and_calls(fresh: Path) -> None:
    metrics = wm.process_metrics("policy model/1")
    assert metrics is wm.process_metrics("ignored: the first role wins")
    metrics.add_http("model", 10, 100, 0.25)
    metrics.add_http("model", 5, 50, 0.5)
    metrics.add_counter("staged_bytes", 24.0)
    metrics.add_call({"total_s": 0.5, "status": 200})
    metrics.flush()
    (path,) = fresh.glob("*.json")
    assert path.name.startswith("policy_model_1-")
    data = json.loads(path.read_text())
    assert data["role"] == "policy_model_1"
    assert data["http"] == {"model": {"requests": 2, "request_bytes": 15, "response_bytes": 150, "seconds": 0.75}}
    assert data["counters"] == {"staged_bytes": 24.0}
    assert data["calls"] == [{"total_s": 0.5, "status": 200}]


def test_call_samples_are_bounded(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wm, "MAX_CALL_SAMPLES", 2)
    metrics = wm.process_metrics("worker")
    for i in range(5):
        metrics.add_call({"i": i})
    snap = metrics.snapshot()
    assert snap["calls"] == [{"i": 0}, {"i": 1}]
    assert snap["counters"] == {"dropped_call_samples": 3}


async def test_counting_asgi_counts_request_and_response_bodies(fresh: Path) -> None:
    metrics = wm.process_metrics("gate")

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body * 3, "more_body": True})
        await send({"type": "http.response.body", "body": b"!"})

    incoming = [{"type": "http.request", "body": b"abcd", "more_body": True},
                {"type": "http.request", "body": b"ef", "more_body": False}]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    counted = wm.CountingASGI(app, metrics)
    await counted({"type": "http", "path": "/ng-rollout/x/training-token-capture/v1/responses"}, receive, send)
    (entry,) = metrics.snapshot()["http"].values()
    assert metrics.snapshot()["http"] == {"model": {"requests": 1, "request_bytes": 6, "response_bytes": 19,
                                                    "seconds": entry["seconds"]}}
    assert entry["seconds"] > 0
    assert b"".join(m.get("body", b"") for m in sent) == b"abcdef" * 3 + b"!"


async def test_counting_asgi_passes_other_scopes_through_uncounted(fresh: Path) -> None:
    metrics = wm.process_metrics("gate")
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["type"], receive, send))

    async def receive():
        return {}

    async def send(message):
        return None

    await wm.CountingASGI(app, metrics)({"type": "lifespan"}, receive, send)
    assert seen == [("lifespan", receive, send)]
    assert metrics.snapshot()["http"] == {}


class _FakeCapture:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.extra = "delegated"

    def begin_call(self, admission):
        self.calls.append(f"begin:{admission}")
        return "call"

    def complete_call_from_response(self, call, native):
        wm.add_call_cost("stage_s", 0.25)  # what the sink reports from inside the commit
        self.calls.append(f"complete:{call}")
        return "coords"

    def fail_call(self, call, *, reason):
        self.calls.append(f"fail:{reason}")
        return "failed"


def test_timed_capture_reports_into_the_current_scope_and_delegates() -> None:
    inner = _FakeCapture()
    timed = wm.TimedCapture(inner)
    costs: dict[str, float] = {}

    def one_call() -> None:
        wm._call_costs.set(costs)
        assert timed.begin_call("a") == "call"
        assert timed.begin_call("a") == "call"
        assert timed.complete_call_from_response("call", {}) == "coords"
        assert timed.fail_call("call", reason="r") == "failed"

    contextvars.copy_context().run(one_call)
    assert inner.calls == ["begin:a", "begin:a", "complete:call", "fail:r"]
    assert set(costs) == {"begin_call_s", "commit_s", "stage_s"}
    assert costs["stage_s"] == 0.25
    assert all(v >= 0 for v in costs.values())
    assert timed.extra == "delegated"


class _Custody:
    def __init__(self) -> None:
        self.capture = _FakeCapture()

    def install_token_capture(self, capture) -> None:
        self.capture = capture


class _Service:
    def __init__(self) -> None:
        self.custody: _Custody | None = _Custody()


def test_time_capture_calls_wraps_only_when_on(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = _Service()
    original = service.custody.capture
    wm.time_capture_calls(service)
    costs: dict[str, float] = {}

    def one_call() -> None:
        wm._call_costs.set(costs)
        assert service.custody.capture.begin_call("a") == "call"

    contextvars.copy_context().run(one_call)
    # The installed core is the service's own, timed: the call reached it and its cost was recorded.
    assert service.custody.capture is not original and original.calls == ["begin:a"]
    assert list(costs) == ["begin_call_s"] and costs["begin_call_s"] >= 0.0
    no_capture = _Service()
    no_capture.custody = None
    wm.time_capture_calls(no_capture)
    assert no_capture.custody is None  # capture off in the worker: nothing to wrap
    monkeypatch.delenv(wm.ENV_DIR)
    monkeypatch.setattr(wm, "_process", None)
    plain = _Service()
    untouched = plain.custody.capture
    wm.time_capture_calls(plain)
    assert plain.custody.capture is untouched  # metrics off: the very same object, not a wrapper


async def test_aiohttp_middleware_counts_bodies_and_samples_chat_calls(fresh: Path) -> None:
    (middleware,) = wm.aiohttp_middlewares()

    async def chat(request: web.Request) -> web.Response:
        await request.read()

        def staged() -> None:  # runs in a worker thread, like the worker's staging write
            wm.add_call_cost("stage_s", 0.5)

        await asyncio.to_thread(staged)
        wm.add_call_cost("begin_call_s", 0.125)
        return web.json_response({"ok": True})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(middlewares=[middleware])
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    async with TestClient(TestServer(app)) as client:
        body = json.dumps({"messages": []}).encode()
        resp = await client.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        assert resp.status == 200
        assert (await client.get("/health")).status == 200
    snap = wm.process_metrics("worker").snapshot()
    (call,) = snap["calls"]
    assert snap["role"] == "worker"
    model = snap["http"]["model"]
    assert {k: model[k] for k in ("requests", "request_bytes", "response_bytes")} == {
        "requests": 1, "request_bytes": len(body), "response_bytes": len(b'{"ok": true}')}
    assert model["seconds"] == call["total_s"]
    assert snap["http"]["health"]["requests"] == 1
    assert call["status"] == 200
    assert (call["stage_s"], call["begin_call_s"]) == (0.5, 0.125)
    assert call["total_s"] > 0
