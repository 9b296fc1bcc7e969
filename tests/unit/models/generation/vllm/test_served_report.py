"""The driver's served-call report (`client.ServedReporter`) without Ray: the merge is pure and the report awaits
whatever `handle.take_served.remote(...)` returns, so awaitable stand-ins prove its deadline and
error mapping (a live Ray actor is exercised by the integration tests)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from nemo_rl.data.calls import ServedCall
from nemo_rl.data.errors import RecordInvariantError
from nemo_rl.models.generation.vllm.client import ServedReporter, WorkerGroup, merge_served
from nemo_rl.models.generation.vllm.errors import WorkerError

ROOT_W0 = ServedCall("r1", "c1", None, "text", 5, True, None, 0)
CHILD_W1 = ServedCall("r1", "c2", "c1", "token_in", 3, False, "staging_failed (see worker log)", 1)
OTHER_W1 = ServedCall("r2", "c1", None, "text", 4, True, None, 1)


class _Remote:
    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class FakeWorker:
    """Answers `take_served.remote(ids)` with an awaitable, like an ObjectRef."""

    def __init__(self, served: list[ServedCall], *, delay_s: float = 0.0, error: Exception | None = None) -> None:
        self.served = served
        self.asked: list[list[str]] = []

        async def take(ids):
            self.asked.append(ids)
            await asyncio.sleep(delay_s)
            if error is not None:
                raise error
            return [c.to_wire() for c in self.served if c.rollout_id in ids]

        self.take_served = _Remote(take)


def _group(*workers, timeout_s=5.0) -> ServedReporter:
    return WorkerGroup(handles=list(workers), base_urls=[], call_timeout_s=timeout_s).served


def test_merge_served_keeps_worker_then_call_order():
    parts = [[ROOT_W0.to_wire()], [CHILD_W1.to_wire(), OTHER_W1.to_wire()], []]
    assert merge_served(parts) == [ROOT_W0, CHILD_W1, OTHER_W1]
    assert merge_served([]) == []


def test_merge_served_rejects_a_malformed_record():
    with pytest.raises(RecordInvariantError, match="unexpected fields") as excinfo:
        merge_served([[{**ROOT_W0.to_wire(), "surprise": 1}]])
    assert excinfo.value.kind == "served_call"


async def test_take_served_async_fans_out_and_merges():
    w0, w1 = FakeWorker([ROOT_W0]), FakeWorker([CHILD_W1, OTHER_W1])
    assert await _group(w0, w1).take_served_async(["r1"]) == [ROOT_W0, CHILD_W1]
    assert w0.asked == w1.asked == [["r1"]]


async def test_take_served_async_timeout_is_a_named_worker_error():
    group = _group(FakeWorker([ROOT_W0]), FakeWorker([], delay_s=5.0), timeout_s=0.05)
    with pytest.raises(WorkerError, match="take_served exceeded its 0s deadline"):
        await group.take_served_async(["r1"])


async def test_take_served_async_dead_actor_is_a_named_worker_error():
    group = _group(FakeWorker([ROOT_W0]), FakeWorker([], error=ray.exceptions.RayActorError()))
    with pytest.raises(WorkerError, match="vLLM worker died during take_served"):
        await group.take_served_async(["r1"])
