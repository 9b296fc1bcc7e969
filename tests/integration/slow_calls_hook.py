"""An `NRL_INSTRUMENTATION` hook module for `test_async_grpo.py`: spread generation calls in time.

Every `POST /v1/chat/completions` on a vLLM worker waits a random 0.5..2.0 s before the worker
admits it (nothing about the call changes: same tokens, same capture). The tiny model answers
in a few tokens, so without it a step's rollouts finish long before the trainer refits; with it,
their calls are admitted while the trainer trains, so a refit meets calls in flight. Every other
hook is a no-op. `NRL_TEST_CALL_DELAY_S=lo,hi` (inherited by the worker) widens the window (the async
chaos test holds calls 6..10 s, so a kill lands while calls are in flight). `NRL_TEST_ENGINE_HOLD_S=lo,hi`
holds each admitted generation inside the engine (`time_capture_calls` wraps the engine's stream).
Both draw from one generator per process seeded by `NRL_TEST_HOOK_SEED` (default 0), so a run's
delays are the same on every rerun.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

from aiohttp import web

DELAY_VAR = "NRL_TEST_CALL_DELAY_S"
DELAY_S = tuple(float(x) for x in os.environ.get(DELAY_VAR, "0.5,2.0").split(","))
# Seconds an admitted generation is held inside the engine (counted in flight, so a refit that closes
# the gate meanwhile must drain it): a refit meets calls in flight by construction, not by a race
# between the tiny model's sub-second answers and the trainer's speed. "0,0" (default): no hold.
HOLD_VAR = "NRL_TEST_ENGINE_HOLD_S"
HOLD_S = tuple(float(x) for x in os.environ.get(HOLD_VAR, "0,0").split(","))
SEED_VAR = "NRL_TEST_HOOK_SEED"
RNG = random.Random(int(os.environ.get(SEED_VAR, "0")))


@web.middleware
async def _spread(request: web.Request, handler):
    if request.method == "POST" and request.path == "/v1/chat/completions":
        await asyncio.sleep(RNG.uniform(*DELAY_S))
    return await handler(request)


def add_call_cost(part: str, seconds: float) -> None:
    return None


def set_call_fact(name: str, value: float) -> None:
    return None


def add_counter(name: str, value: float) -> None:
    return None


def active() -> bool:
    return False


def aiohttp_middlewares(role: str = "worker") -> list[Any]:
    return [_spread] if role == "worker" else []


def time_capture_calls(service: Any) -> None:
    """Wrap the worker's engine generation (between its admit and release) with the `HOLD_S` hold."""
    if max(HOLD_S) <= 0:
        return None
    engine = service._engine
    generate = engine._last_output

    async def held(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(RNG.uniform(*HOLD_S))
        return await generate(*args, **kwargs)

    engine._last_output = held
    return None


def server_module_argv(module: str) -> list[str]:
    return [module]
