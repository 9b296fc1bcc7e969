"""The synchronous loop logs the engines' idle and refit counters per step, under the async loop's
keys (so the async A/B benchmark compares the two loops' `async/engine_idle_fraction` directly);
a dead worker's step logs none."""

from __future__ import annotations

from types import SimpleNamespace

from nemo_rl.algorithms.grpo_single_controller import engine_window_metrics


def _timing(clock, idle, pause=0.0):
    return {"clock_s": clock, "idle_s": idle, "refits": 0, "refits_aborted": 0, "refit_pause_s": pause,
            "refit_drained_calls": 0, "refits_with_calls_in_flight": 0}


class Workers:
    def __init__(self, readings):
        self.readings = list(readings)

    def engine_timings(self):
        return self.readings.pop(0)


def _run(readings, down=None):
    watch = None if down is None else SimpleNamespace(down=lambda: down)
    return SimpleNamespace(watch=watch, stack=SimpleNamespace(workers=Workers(readings)))


async def test_each_step_logs_the_engines_idle_fraction_since_the_previous_reading():
    run = _run([[_timing(10.0, 1.0)], [_timing(14.0, 3.0, pause=0.5)], [_timing(24.0, 3.5, pause=0.75)]])
    metrics, first = await engine_window_metrics(run, None)  # the loop's start: a baseline, no metric
    assert metrics == {} and first == [_timing(10.0, 1.0)]
    metrics, second = await engine_window_metrics(run, first)
    assert metrics == {"async/worker_0/engine_idle_fraction": 0.5, "async/worker_0/refit_pause_s": 0.5,
                       "async/worker_0/refit_calls_in_flight": 0.0, "async/engine_idle_fraction": 0.5,
                       "async/refit_pause_s": 0.5, "async/refit_calls_in_flight": 0.0, "refit/aborted_workers": 0.0}
    metrics, _ = await engine_window_metrics(run, second)
    assert (metrics["async/engine_idle_fraction"], metrics["async/refit_pause_s"]) == (0.05, 0.25)


async def test_a_dead_worker_has_no_counter_so_the_step_logs_none():
    run = _run([], down={"vllm_worker_0": "exited"})
    assert await engine_window_metrics(run, [_timing(1.0, 0.0)]) == ({}, None)
    alive = _run([[_timing(5.0, 1.0)]], down={})
    assert await engine_window_metrics(alive, None) == ({}, [_timing(5.0, 1.0)])  # after a None: a new baseline only
