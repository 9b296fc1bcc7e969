"""One way to wait for Ray actor calls: bounded, and failing with the actor's name and a verdict.

Contract:
- `call_with_deadline(refs, actor=, op=, timeout_s=)` blocks (never from a coroutine: use
  `await_with_deadline`, which awaits the refs and never blocks the event loop) for one ref or a
  list of refs, at most `timeout_s` (`deadline_left(deadline)` turns a shared deadline into it).
- Every failure is an `ActorCallError` naming `actor` and `op`, with `recoverable` saying what a
  caller may do next:
  - `ActorCallTimeoutError` (recoverable): no answer within the deadline; the actor may be busy;
  - `ActorDiedError` (recoverable): the actor process is gone (killed, OOM, crashed); a
    replacement actor can take its work;
  - `ActorRaisedError` (fatal): the method itself raised (a bug or a refused input); calling
    again does the same. `.cause` is Ray's task error, an instance of the actor's own exception
    class, so a caller can re-raise it to keep its domain error.
- Ray re-raises an actor's `TimeoutError` as a `RayTaskError` that is also a `TimeoutError`: it is
  classified as raised (fatal) before any deadline branch can misread it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError


class ActorCallError(RuntimeError):
    """A call into a Ray actor failed; `actor`, `op` and whether a retry or replacement can help."""

    recoverable: bool = False

    def __init__(self, actor: str, op: str, detail: str, cause: BaseException | None = None) -> None:
        super().__init__(f"{actor}.{op}: {detail} ({'recoverable' if self.recoverable else 'fatal'})")
        self.actor = actor
        self.op = op
        self.detail = detail
        self.cause = cause


class ActorCallTimeoutError(ActorCallError):
    """The actor gave no answer within the deadline."""

    recoverable = True


class ActorDiedError(ActorCallError):
    """The actor process is gone."""

    recoverable = True


class ActorRaisedError(ActorCallError):
    """The actor's method raised; `cause` is Ray's task error (an instance of the method's exception)."""

    recoverable = False


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error's message (Ray's run to dozens of lines), or its type name."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__


def deadline_left(deadline: float) -> float:
    """Seconds left until `deadline` (a `time.monotonic()` value), never negative."""
    return max(deadline - time.monotonic(), 0.0)


def classify(error: BaseException, *, actor: str, op: str, timeout_s: float) -> ActorCallError | None:
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
