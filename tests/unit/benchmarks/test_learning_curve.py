"""The pure summary of benchmarks/learning_curve.py, from synthetic metrics lines (exact numbers)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "learning_curve.py"
_spec = importlib.util.spec_from_file_location("learning_curve", _PATH)
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)


def _lines(rewards, start=1, extra=None):
    out = []
    for i, r in enumerate(rewards):
        rec = {"step": start + i, "reward/mean": r, "train/loss": -0.01}
        rec.update(extra or {})
        out.append(json.dumps(rec, sort_keys=True))
    return out


RISING = [0.5, 0.4, 0.6, 0.5, 0.5, 0.6, 0.7, 0.8, 0.9, 0.8, 0.9, 0.7]  # first5 0.5, last5 0.82
FLAT = [0.5, 0.7, 0.3, 0.6, 0.4, 0.5, 0.6, 0.4, 0.7, 0.3]  # first5 0.5, last5 0.5


def test_step_rewards_in_step_order_skipping_blank_and_rewardless_lines():
    lines = _lines([0.25], start=2) + [""] + _lines([0.75], start=1) + [json.dumps({"step": 3, "timing/step_s": 1.0})]
    assert lc.step_rewards(lines) == [0.75, 0.25]


def test_repeated_step_is_an_error():
    with pytest.raises(lc.CurveError, match="step 1 appears twice"):
        lc.step_rewards(_lines([0.1, 0.2]) + _lines([0.3]))


def test_window_means_exact():
    first, last = lc.window_means(lc.step_rewards(_lines(RISING)))
    assert first == pytest.approx(0.5, abs=1e-12)
    assert last == pytest.approx(0.82, abs=1e-12)


def test_too_few_steps_is_an_error():
    with pytest.raises(lc.CurveError, match="need at least 10"):
        lc.window_means([0.5] * 9)


def test_rise_threshold_is_twice_the_standard_error_of_the_difference():
    # first window var = 0.005, last window var = 0.007 -> se = sqrt(0.012 / 5)
    se = math.sqrt((0.005 + 0.007) / 5)
    assert lc.rise_threshold(RISING) == pytest.approx(2 * se, abs=1e-12)
    assert lc.is_rising(RISING)


def test_flat_noisy_curve_is_not_rising_and_min_rise_applies_to_a_noiseless_curve():
    assert not lc.is_rising(FLAT)
    tiny = [0.5] * 5 + [0.54] * 5  # zero spread: the absolute floor MIN_RISE=0.05 decides
    assert lc.rise_threshold(tiny) == lc.MIN_RISE
    assert not lc.is_rising(tiny)
    assert lc.is_rising([0.5] * 5 + [0.56] * 5)


def test_rolling_mean_is_trailing():
    assert lc.rolling_mean([1.0, 2.0, 3.0, 4.0], window=2) == [1.0, 1.5, 2.5, 3.5]
    assert lc.rolling_mean([0.0, 3.0, 6.0], window=5) == [0.0, 1.5, 3.0]


def test_summarize_one_number_per_seed():
    s = lc.summarize({1: lc.step_rewards(_lines(RISING)), 2: FLAT})
    assert s["seeds"] == [1, 2]
    assert s["reward_first5"] == [0.5, 0.5]
    assert s["reward_last5"] == [0.82, 0.5]
    assert s["rise"] == [0.32, 0.0]
    assert s["rising"] == [True, False]
    assert s["rewards"]["2"] == FLAT
    json.dumps(s)  # serialisable as written to summary.json


def test_step_wall_s_is_the_cumulative_step_time_of_the_reward_steps_in_step_order():
    lines = [
        json.dumps({"step": 2, "reward/mean": 0.5, "timing/step_s": 12.5}),
        json.dumps({"step": 3, "timing/step_s": 99.0}),  # no reward: neither a point nor counted
        "",
        json.dumps({"step": 1, "reward/mean": 0.25, "timing/step_s": 10.0}),
        json.dumps({"step": 4, "reward/mean": 0.75, "timing/step_s": 7.25}),
    ]
    assert lc.step_rewards(lines) == [0.25, 0.5, 0.75]
    assert lc.step_wall_s(lines) == [10.0, 22.5, 29.75]


def test_a_reward_step_without_its_step_time_is_an_error():
    lines = _lines([0.5], extra={"timing/step_s": 3.0}) + _lines([0.6], start=2)
    with pytest.raises(lc.CurveError, match="step 2 has reward/mean but no timing/step_s"):
        lc.step_wall_s(lines)


def test_summarize_with_wall_times_adds_them_per_seed():
    wall = {1: [float(i) for i in range(1, 13)], 2: [2.0 * i for i in range(1, 11)]}
    s = lc.summarize({1: RISING, 2: FLAT}, wall=wall)
    assert s["wall_s"] == {"1": [float(i) for i in range(1, 13)], "2": [2.0 * i for i in range(1, 11)]}
    assert s["wall_total_s"] == [12.0, 20.0]
    assert "wall_s" not in lc.summarize({1: RISING})
    with pytest.raises(lc.CurveError, match="seed 2: 9 wall times for 10 rewards"):
        lc.summarize({1: RISING, 2: FLAT}, wall={1: wall[1], 2: wall[2][:9]})


def test_run_plan_runs_every_mode_of_a_seed_before_the_next_seed():
    assert lc.run_plan([1, 2], ["async", "sync"]) == [("async", 1), ("sync", 1), ("async", 2), ("sync", 2)]
    assert lc.run_plan([7], ["sync"]) == [("sync", 7)]
    for bad in (["sync", "sync"], ["fast"], []):
        with pytest.raises(lc.CurveError, match="need distinct modes"):
            lc.run_plan([1], bad)


def test_mode_overrides_turn_async_on_with_what_it_needs_and_sync_off():
    assert lc.MODE_OVERRIDES["sync"] == ("grpo.async_rollouts.enabled=false",)
    assert set(lc.MODE_OVERRIDES["async"]) == {
        "grpo.async_rollouts.enabled=true", "token_capture.enabled=true", "token_capture.on_component_failure=abort"}


def test_wall_ratio_is_sync_seconds_over_async_seconds_per_seed():
    sync = {1: [10.0, 30.0], 2: [5.0, 15.0]}
    assert lc.wall_ratio(sync, {2: [4.0, 12.0], 1: [8.0, 20.0]}) == [1.5, 1.25]
    with pytest.raises(lc.CurveError, match="seed 1: sync ran 2 steps, async 1"):
        lc.wall_ratio(sync, {1: [8.0], 2: [4.0, 12.0]})


def test_each_mode_loads_the_learning_recipe_and_differs_from_the_other_only_in_the_async_switch():
    from examples.arith.recipe import load_recipe

    cfg = {m: load_recipe(lc.DEFAULT_CONFIG, list(lc.MODE_OVERRIDES[m])).config for m in ("sync", "async")}
    assert cfg["async"].grpo.async_rollouts.enabled is True and cfg["sync"].grpo.async_rollouts.enabled is False
    assert cfg["async"].token_capture.enabled and cfg["async"].token_capture.on_component_failure == "abort"
    assert cfg["async"].model_dump(exclude={"grpo": {"async_rollouts"}}) == cfg["sync"].model_dump(
        exclude={"grpo": {"async_rollouts"}})


def _wall(step_s, n):
    return [step_s * i for i in range(1, n + 1)]


def test_build_summary_for_a_comparison_nests_the_modes_and_divides_their_loop_times():
    runs = {"async": {1: (RISING, _wall(2.0, 12)), 2: (FLAT, _wall(1.0, 10))},
            "sync": {1: (RISING, _wall(3.0, 12)), 2: (FLAT, _wall(1.5, 10))}}
    s = lc.build_summary(runs, {"async": {1: 100.0, 2: 90.0}, "sync": {1: 120.0, 2: 95.0}}, compare=True)
    assert (s["mode"], s["seeds"], s["steps"]) == ("compare", [1, 2], 12)
    assert s["wall_ratio"] == [1.5, 1.5]
    assert s["sync"]["wall_total_s"] == [36.0, 15.0] and s["async"]["wall_total_s"] == [24.0, 10.0]
    assert s["sync"]["run_time_s"] == [120.0, 95.0] and s["async"]["rising"] == [True, False]
    assert "control" not in s and "reward_first5" not in s
    json.dumps(s)


def test_build_summary_for_one_mode_stays_flat_as_before_and_keeps_the_control():
    runs = {"async": {1: (RISING, _wall(2.0, 12))}}
    s = lc.build_summary(runs, {"async": {1: 50.0}}, compare=False, control={1: FLAT})
    assert (s["mode"], s["seeds"], s["steps"], s["reward_last5"]) == ("async", [1], 12, [0.82])
    assert s["wall_s"]["1"][-1] == 24.0 and s["control"]["reward_last5"] == [0.5]
    with pytest.raises(lc.CurveError, match="a comparison needs a sync and an async run set"):
        lc.build_summary(runs, {"async": {1: 50.0}}, compare=True)
