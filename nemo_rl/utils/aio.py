"""asyncio helpers for the driver.

Contract:
- `gather_cancelling(aws)` is `asyncio.gather` (results in order) except on failure: when one
  awaitable raises (or the caller is cancelled), every sibling still running is cancelled AND
  awaited before the first exception propagates unchanged (not wrapped in an ExceptionGroup,
  so callers keep matching on the named error). Plain `gather` leaves the siblings running,
  and a teardown that starts right after would race them (stopping servers under in-flight
  rollouts, retention after the stack is gone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def gather_cancelling(aws: Iterable[Awaitable[T]]) -> list[T]:
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        # Siblings run their own cleanup (accounting, retention) on cancellation; wait for it.
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
