"""`GymHttpClient`: one aiohttp session and connection pool for all of a Gym environment's requests.

Against a real aiohttp server on 127.0.0.1 (OS-picked port): N requests, sequential and
concurrent, reuse one session and open no more connections than run at once; the session closes
on `aclose()` / the environment's async exit and on the sync `stop()` path (from the loop's
thread and from a worker thread); a request after close fails as a `NemoGymError` of kind `client_closed`;
every request keeps its own deadline; a second loop is refused (kind `client_loop`).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from aiohttp import web

from nemo_rl.environments.gym_client import GymHttpClient, NemoGymEnvironment
from nemo_rl.environments.nemo_gym_config import (
    NemoGymConfig,
    NemoGymError,
)
from nemo_rl.token_capture.config import TokenCaptureConfig


class _CountingServer:
    """An aiohttp server on loopback that counts the TCP connections requests arrive on (each
    connection has its own client port)."""

    def __init__(self, delay_s: float = 0.0, hold_until: int = 0) -> None:
        """`hold_until` > 0: no request is answered before that many are in the server at once."""
        self.peers: set[tuple[str, int]] = set()
        self.delay_s = delay_s
        self.hold_until = hold_until
        self.arrived = 0
        self.all_in = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    @property
    def connections(self) -> int:
        return len(self.peers)

    async def start(self) -> None:
        async def handler(request: web.Request) -> web.Response:
            assert request.transport is not None
            self.peers.add(request.transport.get_extra_info("peername")[:2])
            self.arrived += 1
            if self.arrived >= self.hold_until:
                self.all_in.set()
            await self.all_in.wait()
            await asyncio.sleep(self.delay_s)
            return web.Response(text=request.path)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def _errors(what: str):
    return {
        "on_timeout": lambda: TimeoutError(f"{what}: deadline"),
        "on_client_error": lambda e: ConnectionError(f"{what}: {e!r}"),
    }


@pytest.fixture
async def server():
    srv = _CountingServer()
    await srv.start()
    yield srv
    await srv.stop()


async def test_many_requests_share_one_session_and_its_connections(server: _CountingServer) -> None:
    client = GymHttpClient()
    try:
        for i in range(20):
            status, text = await client.request("GET", f"{server.url}/seq/{i}", 5.0, **_errors("seq"))
            assert (status, text) == (200, f"/seq/{i}")
        session = client.session()
        assert server.connections == 1  # keep-alive: twenty sequential requests, one connection
        concurrent = await asyncio.gather(
            *(client.request("POST", f"{server.url}/par/{i}", 5.0, json_body={"i": i}, **_errors("par")) for i in range(8))
        )
        assert [text for _, text in concurrent] == [f"/par/{i}" for i in range(8)]
        assert client.session() is session
        assert server.connections <= 1 + 8
    finally:
        await client.aclose()
    assert session.closed and client.closed


async def test_the_pool_has_no_connection_cap() -> None:
    # aiohttp's default connector caps at 100 connections: rollouts past the 100th would queue.
    client = GymHttpClient()
    try:
        connector = client.session().connector
        assert connector is not None and connector.limit == 0 and connector.limit_per_host == 0
    finally:
        await client.aclose()


async def test_more_concurrent_requests_than_aiohttps_default_limit_all_run_at_once() -> None:
    # The server answers none of them until all 120 are in it at once: behind a cap of 100 connections
    # the last 20 could never arrive, and every request would fail at its 10 s deadline.
    srv = _CountingServer(hold_until=120)
    await srv.start()
    client = GymHttpClient()
    try:
        replies = await asyncio.gather(*(client.request("GET", f"{srv.url}/{i}", 10.0, **_errors("wide")) for i in range(120)))
    finally:
        await client.aclose()
        await srv.stop()
    assert len(replies) == 120 and srv.connections == 120 and srv.arrived == 120


async def test_a_request_after_close_fails_by_name(server: _CountingServer) -> None:
    client = GymHttpClient()
    await client.request("GET", f"{server.url}/x", 5.0, **_errors("x"))
    await client.aclose()
    await client.aclose()  # idempotent
    with pytest.raises(NemoGymError, match="HTTP client is closed") as raised:
        await client.request("GET", f"{server.url}/x", 5.0, **_errors("x"))
    assert raised.value.kind == "client_closed"


async def test_each_request_keeps_its_own_deadline() -> None:
    srv = _CountingServer(delay_s=2.0)
    await srv.start()
    client = GymHttpClient()
    try:
        with pytest.raises(TimeoutError, match="slow: deadline"):
            await client.request("GET", f"{srv.url}/slow", 0.2, **_errors("slow"))
    finally:
        await client.aclose()
        await srv.stop()


async def test_sync_close_from_the_loop_thread_closes_the_session_on_that_loop(server: _CountingServer) -> None:
    client = GymHttpClient()
    await client.request("GET", f"{server.url}/x", 5.0, **_errors("x"))
    session = client.session()
    client.close_soon()  # what a sync stop() on the loop's own thread does
    assert client.closed
    for _ in range(10):
        if session.closed:
            break
        await asyncio.sleep(0)
    assert session.closed


async def test_sync_close_from_a_worker_thread_hands_the_close_to_the_loop(server: _CountingServer) -> None:
    client = GymHttpClient()
    await client.request("GET", f"{server.url}/x", 5.0, **_errors("x"))
    session = client.session()
    await asyncio.to_thread(client.close_soon)  # Stack.stop() run off the loop
    for _ in range(10):
        if session.closed:
            break
        await asyncio.sleep(0)
    assert session.closed


def test_sync_close_after_the_loop_ended_drives_or_skips_it(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    try:
        srv = _CountingServer()
        loop.run_until_complete(srv.start())
        client = GymHttpClient()
        loop.run_until_complete(client.request("GET", f"{srv.url}/x", 5.0, **_errors("x")))
        session = client._session
        assert session is not None
        client.close_soon()  # the loop is stopped, not closed: driven here to close the session
        assert session.closed
        loop.run_until_complete(srv.stop())
    finally:
        loop.close()
    closed_loop_client = GymHttpClient()
    closed_loop_client.close_soon()  # never used: nothing to close
    assert closed_loop_client.closed


async def test_a_second_loop_is_refused_by_name(server: _CountingServer) -> None:
    client = GymHttpClient()
    await client.request("GET", f"{server.url}/x", 5.0, **_errors("x"))

    def other_loop() -> None:
        async def use() -> None:
            client.session()

        asyncio.run(use())

    try:
        with pytest.raises(NemoGymError, match="event loop that made its first request") as raised:
            await asyncio.to_thread(other_loop)
        assert raised.value.kind == "client_loop"
    finally:
        await client.aclose()


async def test_the_environment_closes_its_session_on_async_exit(tmp_path: Path, server: _CountingServer) -> None:
    env = NemoGymEnvironment(
        NemoGymConfig(), TokenCaptureConfig(enabled=False), worker_base_url="http://127.0.0.1:9/v1", log_dir=tmp_path
    )
    session = env._http.session()  # what the first run() / health poll makes
    await env.__aexit__(None, None, None)  # what `async with env:` runs on exit (no servers here)
    assert session.closed and env._http.closed
    with pytest.raises(NemoGymError) as raised:
        env._http.session()
    assert raised.value.kind == "client_closed"


async def test_aclose_runs_the_blocking_teardown_off_the_loop(tmp_path: Path, monkeypatch) -> None:
    env = NemoGymEnvironment(
        NemoGymConfig(), TokenCaptureConfig(enabled=False), worker_base_url="http://127.0.0.1:9/v1", log_dir=tmp_path
    )
    threads: list[threading.Thread] = []

    def fake_terminate(procs, timeout_s):
        threads.append(threading.current_thread())
        return {}

    monkeypatch.setattr("nemo_rl.environments.nemo_gym_launch.terminate_processes", fake_terminate)
    assert await env.aclose() == {}
    assert threads and threads[0] is not threading.current_thread()  # a worker thread, not the loop's
