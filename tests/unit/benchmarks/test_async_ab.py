"""The pure parts of benchmarks/async_ab.py on hand-made metrics.jsonl records (exact numbers)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "async_ab.py"
_spec = importlib.util.spec_from_file_location("async_ab", _PATH)
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def _step(step, step_s, tokens, idle, *, rollouts=16.0, reward=0.5, mult=1.0, kl=0.0, ages=None, **extra):
    record = {"step": step, "timing/step_s": step_s, "train/num_tokens": tokens, "finalize/kept_rollouts": rollouts,
              "async/engine_idle_fraction": idle, "reward/mean": reward, "token_mult_prob_error": mult,
              "gen_kl_error": kl, "timing/train_s": 1.0, **extra}
    for age, count in (ages or {}).items():
        record[f"async/trajectory_age_steps/hist/{age}"] = count
    return record


SYNC = [_step(1, 20.0, 100.0, 0.9), _step(2, 4.0, 200.0, 0.5, mult=1.01, kl=0.001, **{"timing/generation_s": 3.0}),
        _step(3, 6.0, 400.0, 0.25, mult=1.03, kl=0.003, reward=0.7, **{"timing/generation_s": 5.0})]
ASYNC = [_step(1, 20.0, 100.0, 0.9, ages={0: 16, 1: 0, "older": 0}),
         _step(2, 2.0, 200.0, 0.5, mult=1.02, kl=0.002, ages={0: 4, 1: 12, "older": 0},
               **{"async/trainer_wait_s": 0.5, "async/dropped_stale_groups": 1.0}),
         _step(3, 3.0, 400.0, 0.0, mult=1.04, kl=0.004, rollouts=12.0, ages={0: 0, 1: 12, "older": 0},
               **{"async/trainer_wait_s": 0.0, "timing/train_s": 2.0})]


def test_arm_figures_sum_the_measured_steps_own_timings_and_tokens():
    fig = ab.arm_figures(SYNC, skip_steps=1)
    assert (fig["steps"], fig["wall_s"], fig["trained_tokens"], fig["trained_rollouts"]) == (2, 10.0, 600.0, 32.0)
    assert (fig["tokens_per_s"], fig["rollouts_per_s"]) == (60.0, 3.2)
    assert fig["engine_idle_fraction"] == pytest.approx((0.5 * 4 + 0.25 * 6) / 10)  # weighted by step_s: 0.35
    assert fig["token_mult_prob_error"] == {"mean": pytest.approx(1.02), "max": 1.03}
    assert fig["phases_mean_s"]["timing/generation_s"] == 4.0
    assert fig["phases_mean_s"]["async/trainer_wait_s"] is None  # the sync loop has no trainer wait
    assert fig["trajectory_age_steps"] == {} and fig["dropped_stale_groups"] == 0.0
    assert fig["reward_mean"] == pytest.approx(0.6)


def test_arm_figures_of_the_async_arm_read_its_ages_drops_and_wait():
    fig = ab.arm_figures(ASYNC, skip_steps=1)
    assert (fig["wall_s"], fig["tokens_per_s"], fig["rollouts_per_s"]) == (5.0, 120.0, 5.6)
    assert fig["engine_idle_fraction"] == pytest.approx(0.2)
    assert fig["trajectory_age_steps"] == {"0": 4, "1": 24, "older": 0}
    assert fig["dropped_stale_groups"] == 1.0
    assert fig["phases_mean_s"]["async/trainer_wait_s"] == 0.25 and fig["phases_mean_s"]["timing/train_s"] == 1.5


def test_age_histogram_orders_ages_numerically_with_older_last():
    records = [{"async/trajectory_age_steps/hist/older": 0, "async/trajectory_age_steps/hist/10": 1,
                "async/trajectory_age_steps/hist/2": 3, "other": 9}]
    assert list(ab.age_histogram(records).items()) == [("2", 3), ("10", 1), ("older", 0)]


def test_a_masked_step_trains_no_tokens_but_its_time_counts():
    masked = {k: v for k, v in _step(2, 5.0, 0.0, 1.0).items() if k not in ("train/num_tokens", "token_mult_prob_error", "gen_kl_error")}
    fig = ab.arm_figures([_step(1, 1.0, 10.0, 0.0), masked, _step(3, 5.0, 50.0, 0.0)], skip_steps=1)
    assert (fig["wall_s"], fig["trained_tokens"], fig["tokens_per_s"]) == (10.0, 50.0, 5.0)


def test_arm_figures_refuse_an_empty_window_a_missing_timing_or_nothing_trained():
    with pytest.raises(ab.BenchError, match="3 logged steps, 3 skipped"):
        ab.arm_figures(SYNC, skip_steps=3)
    broken = [dict(SYNC[0]), {k: v for k, v in SYNC[1].items() if k != "timing/step_s"}]
    with pytest.raises(ab.BenchError, match="step 2 has no 'timing/step_s'"):
        ab.arm_figures(broken, skip_steps=1)
    untrained = [{k: v for k, v in SYNC[1].items() if k != "token_mult_prob_error"}]
    with pytest.raises(ab.BenchError, match="no measured step logged 'token_mult_prob_error'"):
        ab.arm_figures(untrained, skip_steps=0)


def test_reward_curve_is_reward_against_cumulative_step_time_from_step_one():
    assert ab.reward_curve(SYNC) == [(20.0, 0.5), (24.0, 0.5), (30.0, 0.7)]


def test_summarize_pools_rounds_and_takes_async_over_sync_ratios():
    sync = [ab.arm_figures(SYNC, 1), ab.arm_figures(SYNC[:2], 1)]  # 600 tok/10 s, 200 tok/4 s
    asyn = [ab.arm_figures(ASYNC, 1), ab.arm_figures(ASYNC[:2], 1)]  # 600 tok/5 s, 200 tok/2 s
    res = ab.summarize({"sync": sync, "async": asyn})
    assert res["pooled"]["sync"]["tokens_per_s"] == 800 / 14 and res["pooled"]["async"]["tokens_per_s"] == 800 / 7
    assert res["throughput_ratio"] == pytest.approx(2.0)
    assert res["throughput_ratio_per_round"] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert res["rollouts_per_s_ratio"] == pytest.approx((44 / 7) / (48 / 14))
    assert res["engine_idle_fraction_sync"] == pytest.approx((0.35 * 10 + 0.5 * 4) / 14)
    assert res["engine_idle_fraction_async"] == pytest.approx((0.2 * 5 + 0.5 * 2) / 7)
    assert res["trajectory_age_steps"]["async"] == {"0": 8, "1": 36, "older": 0}
    assert res["trajectory_age_steps"]["sync"] == {"0": 48}
    assert res["token_mult_prob_error"]["async"] == {"mean": pytest.approx((1.03 + 1.02) / 2), "max": 1.04}
    assert res["gen_kl_error"]["sync"]["max"] == 0.003
    assert res["train_s_ratio"] == pytest.approx(1.25)  # async 1.25 s per step (mean of 1.5, 1.0) vs sync 1.0
    assert res["pooled"]["async"]["dropped_stale_groups"] == 2.0


def test_summarize_refuses_unpaired_rounds_and_a_zero_sync_rate():
    fig = ab.arm_figures(SYNC, 1)
    with pytest.raises(ab.BenchError, match="same, non-zero number of rounds"):
        ab.summarize({"sync": [fig], "async": []})
    idle = ab.arm_figures([_step(1, 1.0, 0.0, 1.0), _step(2, 1.0, 0.0, 1.0)], 1)
    with pytest.raises(ab.BenchError, match="tokens/s: the sync figure is 0"):
        ab.summarize({"sync": [idle], "async": [fig]})


def test_the_report_states_the_command_load_and_headline_figures():
    res = ab.summarize({"sync": [ab.arm_figures(SYNC, 1)], "async": [ab.arm_figures(ASYNC, 1)]})
    res["config"] = {"command": "uv run python benchmarks/async_ab.py --out x", "rounds": 1, "steps": 3,
                     "skip_steps": 1, "load_start": [3.0, 2.0, 1.0], "load_end": [4.0, 3.0, 2.0]}
    report = ab.write_report(res)
    assert "`uv run python benchmarks/async_ab.py --out x`" in report
    assert "at the start [3.0, 2.0, 1.0], at the end [4.0, 3.0, 2.0]" in report
    assert "**throughput_ratio** (trained generated tokens/s, async / sync): **2.000** (target >= 1.5; per round 2.000)" in report
    assert "- engine idle fraction: sync 0.350, async 0.200" in report
    assert "| tokens/s | 60.00 | 120.00 |" in report
    assert "| `async/trainer_wait_s` | - | 0.250 |" in report
    assert "async 0: 4, 1: 24, older: 0; sync 0: 32" in report


def test_metrics_records_refuse_a_repeated_step():
    lines = [json.dumps({"step": 1}), "", json.dumps({"step": 1})]
    with pytest.raises(ab.BenchError, match="step 1 appears twice"):
        ab.metrics_records(lines)
