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
