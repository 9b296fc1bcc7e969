"""The Ray-call helper on a real local Ray (the session's `shared_ray`): a timeout, a dead actor and
an error raised inside the actor each fail as a named `ActorCallError` that says whether it is recoverable."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from nemo_rl.distributed.actor_call import (
    ActorCallError,
    ActorCallTimeoutError,
    ActorDiedError,
    ActorRaisedError,
    await_with_deadline,
    call_with_deadline,
    deadline_left,
)
from nemo_rl.distributed.ray_cluster import RayClusterHandle


@ray.remote(num_cpus=0, max_concurrency=4)
class Napper:
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def refuse(self) -> None:
        raise ValueError("refused input 7")

    def time_out_inside(self) -> None:
        raise TimeoutError("the actor's own deadline")


def test_answers_come_back_in_order_for_one_ref_and_for_a_list(shared_ray: RayClusterHandle) -> None:
    actor = Napper.remote()
    assert call_with_deadline(actor.nap.remote(0.0), actor="napper", op="nap", timeout_s=60) == 0.0
    refs = [actor.nap.remote(s) for s in (0.2, 0.0)]
    assert call_with_deadline(refs, actor="napper", op="nap", timeout_s=60) == [0.2, 0.0]
    many = asyncio.run(await_with_deadline([actor.nap.remote(s) for s in (0.1, 0.0)], actor="napper", op="nap",
                                           timeout_s=60))
    assert many == [0.1, 0.0]
    ray.kill(actor)


def test_a_timeout_is_named_and_recoverable_sync_and_async(shared_ray: RayClusterHandle) -> None:
    actor = Napper.remote()
    call_with_deadline(actor.nap.remote(0.0), actor="napper", op="nap", timeout_s=60)  # started
    with pytest.raises(ActorCallTimeoutError) as sync:
        call_with_deadline(actor.nap.remote(3.0), actor="napper_0", op="nap", timeout_s=0.2)
    assert sync.value.recoverable and (sync.value.actor, sync.value.op) == ("napper_0", "nap")
    assert str(sync.value) == "napper_0.nap: no answer within its 0.2s deadline (recoverable)"

    with pytest.raises(ActorCallTimeoutError) as awaited:
        asyncio.run(await_with_deadline(actor.nap.remote(3.0), actor="napper_0", op="nap", timeout_s=0.2))
    assert awaited.value.recoverable and "napper_0.nap: no answer within" in str(awaited.value)
    ray.kill(actor)


def test_an_error_raised_inside_the_actor_is_fatal_and_keeps_its_class(shared_ray: RayClusterHandle) -> None:
    actor = Napper.remote()
    with pytest.raises(ActorRaisedError) as raised:
        call_with_deadline(actor.refuse.remote(), actor="napper_1", op="refuse", timeout_s=60)
    assert not raised.value.recoverable
    assert str(raised.value).startswith("napper_1.refuse: raised ") and str(raised.value).endswith("(fatal)")
    assert isinstance(raised.value.cause, ValueError) and "refused input 7" in str(raised.value.cause)

    # A TimeoutError raised by the method is the method's failure, not a missed deadline.
    with pytest.raises(ActorRaisedError) as inner:
        asyncio.run(await_with_deadline(actor.time_out_inside.remote(), actor="napper_1", op="time_out_inside",
                                        timeout_s=60))
    assert not inner.value.recoverable and isinstance(inner.value.cause, TimeoutError)
    ray.kill(actor)


def test_a_dead_actor_is_named_and_recoverable(shared_ray: RayClusterHandle) -> None:
    actor = Napper.remote()
    call_with_deadline(actor.nap.remote(0.0), actor="napper", op="nap", timeout_s=60)
    ray.kill(actor, no_restart=True)
    # ray.kill lands asynchronously: a call sent right after it may still be answered.
    deadline = time.monotonic() + 60.0
    while True:
        try:
            call_with_deadline(actor.nap.remote(0.0), actor="napper_2", op="nap", timeout_s=deadline_left(deadline))
        except ActorDiedError as e:
            died = e
            break
        assert time.monotonic() < deadline, "the killed actor still answers 60 s after ray.kill"
        time.sleep(0.2)
    assert isinstance(died, ActorCallError) and died.recoverable
    assert str(died).startswith("napper_2.nap: the actor died: ") and str(died).endswith("(recoverable)")
    assert isinstance(died.cause, ray.exceptions.RayActorError)

    with pytest.raises(ActorDiedError) as awaited:
        asyncio.run(await_with_deadline([actor.nap.remote(0.0)], actor="napper_2", op="nap", timeout_s=60))
    assert awaited.value.recoverable


def test_deadline_left_is_never_negative() -> None:
    assert deadline_left(time.monotonic() - 5.0) == 0.0
    assert 9.0 < deadline_left(time.monotonic() + 10.0) <= 10.0
