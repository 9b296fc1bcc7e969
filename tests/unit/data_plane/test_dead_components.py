"""Deadlines hold when TQ components die: a dedicated cluster whose actors this module kills."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from nemo_rl.data_plane import (
    DataPlane,
    DataPlaneClient,
    DataPlaneConfig,
    DataPlaneError,
    DataPlaneTimeoutError,
    attach_client,
    attach_client_async,
    start_data_plane,
)
from nemo_rl.distributed.ray_cluster import init_local_ray

DEADLINE_S = 2.0
# Scheduling noise on a loaded, shared 2-core host; a hang would overshoot by TQ's 30 s socket
# timeout, so a few seconds of slack still tells the two apart.
SLACK_S = 5.0


@pytest.fixture(scope="module")
def plane(cfg: DataPlaneConfig) -> Iterator[DataPlane]:
    """This module's own Ray cluster and data plane (the session's shared ones must survive): not
    `shared_ray`, so the module runs before the shared block (tests/unit/conftest.py)."""
    cluster = init_local_ray(num_cpus=2)
    try:
        started = start_data_plane(cfg)
        try:
            yield started
        finally:
            started.shutdown()
    finally:
        cluster.shutdown()


def _own_pid(actor: Any) -> int:
    return os.getpid()


def kill_and_wait(handle: Any, timeout_s: float = 60.0) -> None:
    """ray.kill the actor and return once its process is gone (Ray marks it dead before the
    process exits, and TQ's ZeroMQ threads keep serving until then)."""
    pid = ray.get(handle.__ray_call__.remote(_own_pid), timeout=30.0)
    ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"actor process {pid} still alive {timeout_s} s after ray.kill")


def timed_failure(call: Any) -> tuple[BaseException, float]:
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        call()
    return info.value, time.monotonic() - started


def test_dead_storage_unit_then_dead_controller_fail_within_deadline(
    plane: DataPlane, client: DataPlaneClient, cfg: DataPlaneConfig
) -> None:
    client.put("live", "k", {"tag": "v"})
    assert client.get("live", ["k"], ["tag"]) == [{"tag": "v"}]

    (unit,) = plane.storage_units.values()
    kill_and_wait(unit)
    error, elapsed = timed_failure(lambda: client.get("live", ["k"], ["tag"], timeout_s=DEADLINE_S))
    assert isinstance(error, DataPlaneTimeoutError)
    assert (error.operation, error.partition, error.timeout_s) == ("get", "live", DEADLINE_S)
    assert elapsed < DEADLINE_S + SLACK_S

    kill_and_wait(plane.controller)
    for operation, call in [
        ("get", lambda: client.get("live", ["k"], ["tag"], timeout_s=DEADLINE_S)),
        ("put", lambda: client.put("live", "k2", {"tag": "w"}, timeout_s=DEADLINE_S)),
        ("list_keys", lambda: client.list_keys("live", timeout_s=DEADLINE_S)),
        ("clear", lambda: client.clear("live", ["k"], timeout_s=DEADLINE_S)),
    ]:
        error, elapsed = timed_failure(call)
        assert isinstance(error, DataPlaneTimeoutError), (operation, error)
        assert error.operation == operation
        assert f"data plane {operation} on partition 'live' did not finish within its 2 s deadline" in str(error)
        assert elapsed < DEADLINE_S + SLACK_S, (operation, elapsed)

    with pytest.raises(DataPlaneError, match="no TransferQueue controller") as raised:
        attach_client(cfg)
    assert raised.value.kind == "unavailable"
    with pytest.raises(DataPlaneError, match="no TransferQueue controller") as raised:
        asyncio.run(attach_client_async(cfg))
    assert raised.value.kind == "unavailable"

    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < 10.0
    plane.shutdown()
    plane.shutdown()
    assert plane.stopped
