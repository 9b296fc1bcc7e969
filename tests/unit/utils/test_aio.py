"""gather_cancelling: siblings are cancelled and finish their cleanup before the error propagates."""

from __future__ import annotations

import asyncio

import pytest

from nemo_rl.utils.aio import gather_cancelling


async def test_results_in_order_when_all_succeed() -> None:
    async def value(v: int, delay: float) -> int:
        await asyncio.sleep(delay)
        return v

    assert await gather_cancelling([value(1, 0.02), value(2, 0.0), value(3, 0.01)]) == [1, 2, 3]


async def test_a_failure_cancels_siblings_after_their_cleanup_and_keeps_its_type() -> None:
    events: list[str] = []
    started: list[str] = []
    both_running = asyncio.Event()

    async def slow(name: str) -> None:
        started.append(name)
        if len(started) == 2:
            both_running.set()
        try:
            await asyncio.Event().wait()  # until cancelled
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # cleanup that itself awaits (like retention)
            events.append(f"{name} cleaned up")
            raise

    async def failing() -> None:
        await both_running.wait()  # the siblings are running when it fails
        raise KeyError("group 2 broke")

    with pytest.raises(KeyError, match="group 2 broke"):
        await gather_cancelling([slow("a"), failing(), slow("b")])
    assert sorted(events) == ["a cleaned up", "b cleaned up"]  # both finished before the raise
