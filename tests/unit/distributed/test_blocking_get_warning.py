"""Ray's blocking-get warning, built with a real async actor on the session's `shared_ray`.

The integration suite asserts that no actor of a real run logs it (`tests/integration/log_checks.py`);
this module shows the check would see it: an async actor that calls `ray.get` writes exactly the
line `blocking_get_warnings` looks for, and one that awaits writes none.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import ray

from nemo_rl.distributed.ray_cluster import RayClusterHandle
from tests.integration.log_checks import actor_lines, blocking_get_warnings

CALL_TIMEOUT_S = 60.0
LOG_WAIT_S = 30.0


@ray.remote(num_cpus=0)
class _BlockingActor:
    async def pid_after_blocking_get(self) -> int:
        ray.get([], timeout=10)  # the planted fault: a blocking get on the actor's event loop
        print("blocking actor answered", flush=True)
        return os.getpid()


@ray.remote(num_cpus=0)
class _AwaitingActor:
    async def pid_after_await(self) -> int:
        await ray.put(1)  # the right way: the loop yields while the object resolves
        print("awaiting actor answered", flush=True)
        return os.getpid()


def _actor_log(cluster: RayClusterHandle, pid: int, marker: str) -> str:
    """The actor process's stdout and stderr logs, once `marker` (its own print) has reached them."""
    logs = Path(str(cluster.temp_dir)) / "session_latest" / "logs"
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        text = "".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"worker-*-{pid}.*")))
        if marker in text:
            return text
        assert time.monotonic() < deadline, f"actor pid {pid}'s log under {logs} lacks {marker!r} after {LOG_WAIT_S} s"
        time.sleep(0.2)


def test_a_blocking_get_in_an_async_actor_is_flagged(shared_ray: RayClusterHandle) -> None:
    actor = _BlockingActor.remote()
    try:
        pid = ray.get(actor.pid_after_blocking_get.remote(), timeout=CALL_TIMEOUT_S)
        found = blocking_get_warnings(_actor_log(shared_ray, pid, "blocking actor answered"))
        assert len(found) == 1, found
    finally:
        ray.kill(actor)


def test_an_awaiting_async_actor_is_not_flagged(shared_ray: RayClusterHandle) -> None:
    actor = _AwaitingActor.remote()
    try:
        pid = ray.get(actor.pid_after_await.remote(), timeout=CALL_TIMEOUT_S)
        assert blocking_get_warnings(_actor_log(shared_ray, pid, "awaiting actor answered")) == []
    finally:
        ray.kill(actor)


def test_actor_lines_reads_rays_forwarding_prefix() -> None:
    text = "\x1b[36m(VllmGenerationWorker pid=11021)\x1b[0m engine up\nplain driver line\n(PolicyWorker pid=7) loaded"
    assert actor_lines(text, "VllmGenerationWorker") == ["\x1b[36m(VllmGenerationWorker pid=11021)\x1b[0m engine up"]
    assert actor_lines(text, "FinalizerWorker") == []
