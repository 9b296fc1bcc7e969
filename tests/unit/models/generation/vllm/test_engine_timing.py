"""The engine's own idle and refit-pause counters (`VllmEngine.timing`), on a scripted clock: idle
is time with no request admitted (the closed refit gate included), a refit's pause is the time
its gate was closed, and calls in flight when the gate closed are counted (they drain first)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nemo_rl.models.generation.vllm.engine import EngineState, EngineTiming
from nemo_rl.models.generation.vllm.refit import reload_weights
from tests.unit.models.generation.vllm.test_engine_deadlines import SAMPLING, FakeAsyncLLM, _engine, _until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _clocked(llm: FakeAsyncLLM, **kwargs):
    engine, clock = _engine(llm, **kwargs), Clock()
    engine._clock = clock
    engine._idle_since = clock.now  # as if started at the scripted time
    return engine, clock


async def test_idle_time_is_time_with_no_request_admitted():
    llm = FakeAsyncLLM(hold={"a", "b"})
    engine, clock = _clocked(llm)
    clock.now = 103.0  # 3 s idle
    a = asyncio.create_task(engine.generate([1], SAMPLING, "a"))
    await _until(lambda: engine.inflight == 1)
    clock.now = 104.0
    b = asyncio.create_task(engine.generate([1], SAMPLING, "b"))
    await _until(lambda: engine.inflight == 2)
    clock.now = 106.0
    llm.release("a")
    await a
    clock.now = 107.0  # still busy with b
    llm.release("b")
    await b
    clock.now = 109.5  # idle again for 2.5 s (the current stretch counts)
    assert engine.timing() == EngineTiming(109.5, 5.5, 0, 0, 0.0, 0, 0)


async def test_a_refit_with_a_call_in_flight_counts_the_drained_call_and_its_pause(tmp_path: Path):
    llm = FakeAsyncLLM(hold={"old"})
    engine, clock = _clocked(llm)
    old = asyncio.create_task(engine.generate([1], SAMPLING, "old"))
    await _until(lambda: engine.inflight == 1)
    clock.now = 101.0
    refit = asyncio.create_task(reload_weights(engine, tmp_path, 1))
    await _until(lambda: engine.state is EngineState.REFITTING)
    clock.now = 102.5
    llm.release("old")
    await old
    await refit
    timing = engine.timing()
    assert (timing.refits, timing.refits_aborted, timing.refit_drained_calls, timing.refits_with_calls_in_flight) == (1, 0, 1, 1)
    assert timing.refit_pause_s == 1.5  # gate closed at 101.0, reopened at 102.5
    assert timing.idle_s == 0.0  # busy from 100.0 until the drain; the reload ran at the same instant


async def test_an_aborted_refit_counts_its_pause_and_the_abort(tmp_path: Path):
    llm = FakeAsyncLLM(hold={"slow"})
    engine, clock = _clocked(llm, drain_s=0.05)
    slow = asyncio.create_task(engine.generate([1], SAMPLING, "slow"))
    await _until(lambda: engine.inflight == 1)
    refit = asyncio.create_task(reload_weights(engine, tmp_path, 1))
    await _until(lambda: engine.state is EngineState.REFITTING)
    clock.now = 100.75
    await asyncio.gather(refit, return_exceptions=True)
    timing = engine.timing()
    assert (timing.refits, timing.refits_aborted, timing.refit_drained_calls, timing.refit_pause_s) == (0, 1, 1, 0.75)
    llm.release("slow")
    await slow
