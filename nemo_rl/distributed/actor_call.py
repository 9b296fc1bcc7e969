"""One way to wait for Ray actor calls: bounded, and failing with the actor's name and a verdict.

`call_with_deadline` (blocking) and `await_with_deadline` (from a coroutine, never blocking the
event loop) wait at most `timeout_s`. Every failure is an `ActorCallError` naming actor and op,
with `recoverable` saying what a caller may do: timeout and a dead actor are recoverable
(`RecoverableError`), a method that raised is fatal (`FatalError`; `.cause` keeps the actor's own
exception). `ActorCallError` is the tuple of the three (`except ActorCallError` catches any of
them): one class cannot be both sides of the split. Invariant: an actor's own `TimeoutError` is
classified as raised before any deadline branch can misread it.
See docs/design-docs/distributed.md, "Waiting for actor calls".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from nemo_rl.data.errors import FatalError, RecoverableError


class _ActorCallFailure:
    """What every failed actor call carries: `actor`, `op`, and whether a retry or replacement can
    help (`recoverable`, which is the class's side of the split). Not an exception by itself."""

    def __init__(self, actor: str, op: str, detail: str, cause: BaseException | None = None) -> None:
        super().__init__(f"{actor}.{op}: {detail} ({'recoverable' if self.recoverable else 'fatal'})")
        self.actor = actor
        self.op = op
        self.detail = detail
        self.cause = cause

    @property
    def recoverable(self) -> bool:
        return isinstance(self, RecoverableError)


class ActorCallTimeoutError(_ActorCallFailure, RecoverableError, RuntimeError):
    """The actor gave no answer within the deadline."""


class ActorDiedError(_ActorCallFailure, RecoverableError, RuntimeError):
    """The actor process is gone."""


class ActorRaisedError(_ActorCallFailure, FatalError, RuntimeError):
    """The actor's method raised; `cause` is Ray's task error (an instance of the method's exception)."""


# A call into a Ray actor failed: the three named failures, for `except` and `isinstance`.
ActorCallError = (ActorCallTimeoutError, ActorDiedError, ActorRaisedError)


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error's message (Ray's run to dozens of lines), or its type name."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def deadline_left(deadline: float) -> float:
    """Seconds left until `deadline` (a `time.monotonic()` value), never negative."""
    return max(deadline - time.monotonic(), 0.0)


def classify(
    error: BaseException, *, actor: str, op: str, timeout_s: float
) -> ActorCallTimeoutError | ActorDiedError | ActorRaisedError | None:
    """The `ActorCallError` for a Ray or deadline failure, or None for anything else."""
    if isinstance(error, RayTaskError):  # first: it may also be a TimeoutError (see the contract)
        return ActorRaisedError(actor, op, f"raised {first_line(error)}", error)
    if isinstance(error, (GetTimeoutError, asyncio.TimeoutError, TimeoutError)):
        return ActorCallTimeoutError(actor, op, f"no answer within its {timeout_s:g}s deadline", error)
    if isinstance(error, RayActorError):
        return ActorDiedError(actor, op, f"the actor died: {first_line(error)}", error)
    return None


def call_with_deadline(refs: Any | Sequence[Any], *, actor: str, op: str, timeout_s: float) -> Any:
    """`ray.get(refs)` within `timeout_s`; a failure is an `ActorCallError` (see the contract)."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except (RayTaskError, GetTimeoutError, RayActorError) as error:
        failure = classify(error, actor=actor, op=op, timeout_s=timeout_s)
        assert failure is not None  # every caught type is classified
        raise failure from error


async def await_with_deadline(refs: Any | Sequence[Any], *, actor: str, op: str, timeout_s: float) -> Any:
    """The awaited `refs` (one ref, or a list in order) within `timeout_s`, without blocking the loop."""
    many = isinstance(refs, (list, tuple))
    try:
        if many:
            return list(await asyncio.wait_for(asyncio.gather(*refs), timeout_s))
        return await asyncio.wait_for(refs, timeout_s)
    except (RayTaskError, asyncio.TimeoutError, GetTimeoutError, RayActorError) as error:
        failure = classify(error, actor=actor, op=op, timeout_s=timeout_s)
        assert failure is not None  # every caught type is classified
        raise failure from error
