"""The pure summaries of benchmarks/capture_ab.py on hand-made inputs (exact numbers)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "capture_ab.py"
_spec = importlib.util.spec_from_file_location("capture_ab", _PATH)
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def test_spread_is_median_min_max_and_count() -> None:
    assert ab.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert ab.spread([4, 1, 3, 2]) == {"median": 2.5, "min": 1.0, "max": 4.0, "n": 4}
    with pytest.raises(ab.BenchError, match="no values"):
        ab.spread([])


def test_ratio_refuses_a_zero_denominator() -> None:
    assert ab.ratio(3.0, 4.0) == 0.75
    with pytest.raises(ab.BenchError, match="denominator"):
        ab.ratio(1.0, 0.0)


def test_percentile_is_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert ab.percentile(values, 50) == 3.0
    assert ab.percentile(values, 20) == 1.0
    assert ab.percentile(values, 21) == 2.0
    assert ab.percentile(values, 99) == 5.0
    assert ab.percentile(values, 100) == 5.0
    assert ab.percentile(list(range(1, 101)), 99) == 99
    with pytest.raises(ab.BenchError):
        ab.percentile([], 50)
    with pytest.raises(ValueError):
        ab.percentile(values, 0)


def test_growth_is_largest_over_smallest_turn_count() -> None:
    assert ab.growth({64: 300.0, 2: 100.0, 8: 120.0}) == 3.0
    assert ab.growth({2: 50.0, 64: 50.0}) == 1.0
    with pytest.raises(ab.BenchError, match="two turn counts"):
        ab.growth({2: 1.0})
    with pytest.raises(ab.BenchError, match="denominator"):
        ab.growth({2: 0.0, 8: 1.0})


def _line(step: int, **values: float) -> str:
    return json.dumps({"step": step, **values})


def test_metrics_records_are_in_step_order_and_refuse_a_repeated_step() -> None:
    lines = [_line(2, a=2.0), "", _line(1, a=1.0)]
    assert [r["step"] for r in ab.metrics_records(lines)] == [1, 2]
    with pytest.raises(ab.BenchError, match="step 1 appears twice"):
        ab.metrics_records([_line(1), _line(1)])


def test_step_phases_leave_out_the_warm_up_steps() -> None:
    records = ab.metrics_records([
        _line(1, **{"timing/step_s": 9.0, "timing/train_s": 5.0}),
        _line(2, **{"timing/step_s": 4.0, "timing/train_s": 2.0, "timing/refit_s": 0.25}),
        _line(3, **{"timing/step_s": 6.0, "timing/train_s": 3.0}),
    ])
    phases = ab.step_phases(records, skip_steps=1)
    assert phases["timing/step_s"] == [4.0, 6.0]
    assert phases["timing/train_s"] == [2.0, 3.0]
    assert phases["timing/refit_s"] == [0.25]
    assert phases["timing/generation_s"] == []
    assert set(phases) == set(ab.PHASES)


def _wire(role: str, **routes: tuple[int, int]) -> dict:
    return {
        "role": role,
        "http": {r: {"requests": 1, "request_bytes": q, "response_bytes": a} for r, (q, a) in routes.items()},
        "counters": {},
        "calls": [],
    }


def test_http_links_attribute_each_server_to_its_link() -> None:
    files = [
        _wire("worker", model=(100, 1000), tokenize=(10, 20), health=(0, 15), control=(0, 99)),
        _wire("worker", model=(50, 500)),  # a second worker adds to the same link
        _wire("policy_model", model=(300, 700), control=(0, 40), health=(0, 9)),
        _wire("arith_agent", run=(200, 5000), model=(70, 30), health=(0, 15)),
        _wire("arith_resources", calculator=(30, 10), verify=(60, 4), health=(0, 1)),
    ]
    assert ab.http_links(files) == {
        "agent_gate": 1000,
        "gate_worker": 100 + 1000 + 10 + 20 + 50 + 500,
        "driver_agent": 5200,
        "driver_gate_control": 40,
        "agent_resources": 104,
        "agent_internal": 100,
    }


def test_route_times_are_mean_ms_per_request_per_server_route() -> None:
    def wire(role, **routes):
        return {"role": role, "http": {r: {"requests": n, "request_bytes": 0, "response_bytes": 0, "seconds": sec}
                                       for r, (n, sec) in routes.items()}}

    files = [wire("worker", model=(4, 2.0), health=(1, 9.0)), wire("worker", model=(4, 6.0)),
             wire("policy_model", model=(2, 1.0), control=(8, 0.4)),
             wire("arith_agent", run=(5, 10.0)), wire("arith_resources", verify=(4, 0.1), calculator=(4, 1.0))]
    assert ab.route_times_ms(files) == {
        "worker:model": 1000.0, "gate:model": 500.0, "gate:control": 50.0, "agent:run": 2000.0,
        "resources:verify": 25.0,
    }


def test_call_costs_measure_capture_against_the_rest_of_the_call() -> None:
    samples = [
        # added 0.010 s of 0.110 s -> rest 0.100 -> fraction 0.1
        {"total_s": 0.110, "status": 200, "begin_call_s": 0.002, "prefix_fetch_s": 0.003, "commit_s": 0.005,
         "stage_s": 0.004},
        # added 0.002 of 0.202 -> rest 0.2 -> fraction 0.01
        {"total_s": 0.202, "status": 200, "begin_call_s": 0.001, "commit_s": 0.001, "stage_s": 0.0005},
        # a legacy call: nothing added
        {"total_s": 0.050, "status": 200},
        {"total_s": 9.0, "status": 503, "commit_s": 8.0},  # failed calls are not counted
    ]
    out = ab.call_costs(samples)
    assert out["calls"] == 3
    assert out["added_ms_p50"] == pytest.approx(2.0)
    assert out["added_ms_p99"] == pytest.approx(10.0)
    assert out["fraction_p50"] == pytest.approx(0.01)
    assert out["fraction_p99"] == pytest.approx(0.1)
    assert out["rest_ms_p50"] == pytest.approx(100.0)
    assert out["stage_ms_p50"] == pytest.approx(0.5)  # over the two calls that staged
    assert (out["stage_calls"], out["prefix_fetch_calls"], out["commit_calls"]) == (2, 1, 2)
    assert out["prefix_fetch_ms_p50"] == pytest.approx(3.0)  # the one token-in call
    assert out["begin_call_ms_p99"] == pytest.approx(2.0)
    # No generate_s sampled: the whole rest is rendering and parsing.
    assert out["render_parse_ms_p50"] == pytest.approx(100.0)
    with pytest.raises(ab.BenchError, match="no successful"):
        ab.call_costs([{"total_s": 1.0, "status": 500}])
    with pytest.raises(ab.BenchError, match="inconsistent"):
        ab.call_costs([{"total_s": 0.001, "status": 200, "commit_s": 0.002}])


def _syn(judge_us: dict[int, float], ledger: dict[int, float]) -> dict:
    return {
        "finalizer_throughput": {"1024": {"rows_per_s_per_actor": 90.0}, "4096": {"rows_per_s_per_actor": 40.0}},
        "turn_scaling": {str(t): {"judge_us_per_token": judge_us[t], "ledger_bytes_per_call": ledger[t]}
                         for t in judge_us},
    }


def test_stage_writer_figures_sum_the_arms_then_divide() -> None:
    arms = [
        {"stage_write_rows": 30.0, "stage_write_batches": 10.0, "stage_write_s": 0.05, "stage_flushes": 4.0,
         "stage_flush_wait_s": 0.002},
        {"stage_write_rows": 18.0, "stage_write_batches": 2.0, "stage_write_s": 0.03, "stage_flushes": 4.0,
         "stage_flush_wait_s": 0.006},
    ]
    figures = ab.stage_writer_figures(arms)
    assert figures == pytest.approx({"rows": 48.0, "writes": 12.0, "rows_per_write": 4.0, "ms_per_write": 80 / 12,
                                     "served_reports": 8.0, "ms_waited_per_served_report": 1.0})
    assert ab.stage_writer_figures([{}]) == {"rows": 0.0, "writes": 0.0, "rows_per_write": None, "ms_per_write": None,
                                             "served_reports": 0.0, "ms_waited_per_served_report": None}


def test_top_level_from_the_synthetic_part_only() -> None:
    top = ab.top_level(None, _syn({2: 10.0, 8: 9.0, 64: 12.5}, {2: 1000.0, 8: 1100.0, 64: 1500.0}))
    assert list(top) == list(ab.TOP_LEVEL_KEYS)
    assert top["finalizer_rows_per_s"] == 40.0
    assert top["ledger_bytes_per_call_growth"] == 1.5
    assert top["finalize_time_per_token_growth"] == 1.25
    assert top["step_time_ratio"] is None and top["http_bytes_per_trained_token_ratio"] is None


def _arm(step_s: float, headline: float, tmpe: float, mismatched: int, rows: int) -> dict:
    phases = {p: 1.0 for p in ab.PHASES}
    phases["timing/step_s"] = step_s
    per_link = dict.fromkeys(ab.LINKS, 0.0)
    per_link["agent_gate"] = headline
    return {
        "phases_median_s": phases,
        "headline_http_bytes_per_trained_token": headline,
        "all_http_bytes_per_trained_token": headline * 2,
        "http_bytes_per_trained_token": per_link,
        "staged_bytes_per_trained_token": 0.0,
        "trained_tokens": 100,
        "rows": rows,
        "exactness": {"token_mult_prob_error": tmpe, "gen_kl_error": 0.0},
        "retokenization_mismatch_rows": mismatched,
        "worker_call_samples": [{"total_s": 0.2, "status": 200, "commit_s": 0.01}],
        "route_ms_per_request": {"worker:model": step_s},
        "queue_wait_ms": [5.0],
        "rss_peak_mib": {"driver": 100.0},
        "rss_per_rollout_in_flight_mib": {"driver": 1.0},
        "rss_growth_in_measured_steps_mib": {"driver": 0.0},
        "startup_s": 60.0,
    }


def test_summarize_ab_takes_medians_over_repeats_then_ratios() -> None:
    arms = {
        "capture": [_arm(4.0, 30.0, 1.00001, 1, 8), _arm(6.0, 50.0, 1.00003, 0, 8), _arm(5.0, 40.0, 1.00002, 1, 8)],
        "legacy": [_arm(10.0, 100.0, 1.01, 2, 8), _arm(8.0, 80.0, 1.03, 0, 8), _arm(9.0, 90.0, 1.02, 0, 8)],
    }
    summary = ab.summarize_ab(arms)
    step = summary["phases_s"]["timing/step_s"]
    assert step["capture"] == {"median": 5.0, "min": 4.0, "max": 6.0, "n": 3}
    assert step["legacy"]["median"] == 9.0
    assert step["ratio"] == 5.0 / 9.0
    assert summary["http"]["headline_ratio"] == 40.0 / 90.0
    assert summary["exactness"]["capture"]["retokenization_mismatch_fraction"] == 2 / 24
    assert summary["exactness"]["legacy"]["retokenization_mismatch_fraction"] == 2 / 24
    assert summary["route_ms_per_request"]["capture"] == {
        "worker:model": {"median": 5.0, "min": 4.0, "max": 6.0, "n": 3}}
    top = ab.top_level(summary, None)
    assert top["step_time_ratio"] == 5.0 / 9.0
    assert top["http_bytes_per_trained_token_ratio"] == 40.0 / 90.0
    assert top["token_mult_prob_error_capture"] == 1.00002
    assert top["token_mult_prob_error_legacy"] == 1.02
    assert top["added_call_latency_fraction_p50"] == pytest.approx(0.01 / 0.19)
    assert top["finalizer_rows_per_s"] is None


def test_call_costs_split_the_rest_into_engine_and_render_parse() -> None:
    samples = [{"total_s": 0.110, "status": 200, "commit_s": 0.010, "generate_s": 0.090},
               {"total_s": 0.050, "status": 200, "generate_s": 0.020},
               {"total_s": 0.300, "status": 200, "generate_s": 0.200}]
    out = ab.call_costs(samples)
    assert out["generate_ms_p50"] == pytest.approx(90.0)
    assert out["generate_calls"] == 3
    assert out["render_parse_ms_p50"] == pytest.approx(30.0)  # 10, 30, 100 ms
    assert out["added_ms_p50"] == pytest.approx(0.0)  # generate_s is the engine's, not capture's


def test_cpu_per_step_counts_from_the_mark_and_new_roles_from_zero() -> None:
    assert ab.cpu_per_step({"worker_engine": 10.0, "tq": 1.0}, {"worker_engine": 40.0, "tq": 7.0, "finalizer": 3.0}, 3) \
        == {"finalizer": 1.0, "tq": 2.0, "worker_engine": 10.0}
    assert ab.cpu_per_step({"tq": 1.0}, {}, 3) == {}  # the end mark was never seen: no figure
    assert ab.cpu_per_step({}, {"tq": 1.0}, 0) == {}


def test_the_summary_and_report_say_who_held_the_cores() -> None:
    def arm(engine_s: float, tq_s: float, tokens: int) -> dict:
        base = _arm(5.0, 40.0, 1.0, 0, 8)
        base["worker_call_samples"] = [{"total_s": 0.2, "status": 200, "commit_s": 0.01, "generate_s": 0.15}]
        return {**base, "measured_steps": 2, "measured_generated_tokens": tokens,
                "cpu_s_per_measured_step": {"worker_engine": engine_s, "tq": tq_s}}

    arms = {"capture": [arm(3.0, 1.5, 600), arm(3.2, 1.7, 640)], "legacy": [arm(3.0, 0.0, 600), arm(3.1, 0.0, 620)]}
    summary = ab.summarize_ab(arms)
    assert summary["cpu_s_per_step"]["capture"]["tq"] == {"median": 1.6, "min": 1.5, "max": 1.7, "n": 2}
    assert summary["engine_cpu_ms_per_generated_token"]["capture"]["median"] == pytest.approx(10.0)
    lines = ab._engine_time_lines(summary)
    assert "| engine (generate) | 150 | 150 |" in lines
    tq_line = next(line for line in lines if line.startswith("| tq |"))
    assert tq_line.endswith("| 1.6 |")


def test_engine_load_tells_batching_from_a_slower_engine() -> None:
    # Worker 1: two calls overlap for 0.1 s of their 0.2 s each; worker 2: one call alone. A failed call
    # and a sample without an interval (the legacy path before this figure) do not count.
    samples = [
        {"status": 200, "worker_pid": 1, "generate_t0_s": 10.0, "generate_s": 0.2, "generated_tokens": 20, "prompt_tokens": 50},
        {"status": 200, "worker_pid": 1, "generate_t0_s": 10.1, "generate_s": 0.2, "generated_tokens": 30, "prompt_tokens": 70},
        {"status": 200, "worker_pid": 2, "generate_t0_s": 10.0, "generate_s": 0.5, "generated_tokens": 50, "prompt_tokens": 90},
        {"status": 503, "worker_pid": 2, "generate_t0_s": 11.0, "generate_s": 0.5, "generated_tokens": 9},
        {"status": 200, "worker_pid": 2, "generate_s": 0.5},
    ]
    load = ab.engine_load(samples)
    assert load["calls"] == 3
    assert load["busy_s"] == pytest.approx(0.3 + 0.5)  # a union per worker: 10.0-10.3 and 10.0-10.5
    assert load["generated_tokens"] == 100
    assert load["tokens_per_busy_s"] == pytest.approx(100 / 0.8)
    assert load["in_flight_mean"] == pytest.approx((1.5 + 1.5 + 1.0) / 3)  # each overlapped half its time
    assert load["generate_ms_p50_by_in_flight"] == {"1": {"calls": 1, "ms_p50": pytest.approx(500.0)},
                                                   "2": {"calls": 2, "ms_p50": pytest.approx(200.0)}}
    assert load["prompt_tokens_p50"] == 70 and load["generated_tokens_p50"] == 30
    assert ab.engine_load([{"status": 200, "generate_s": 0.1}]) == {}


def test_the_report_shows_the_engine_load_side_by_side() -> None:
    def arm(t0_step: float) -> dict:
        base = _arm(5.0, 40.0, 1.0, 0, 8)
        calls = [{"total_s": 0.2, "status": 200, "generate_s": 0.1, "generate_t0_s": t0_step * i,
                  "generated_tokens": 10, "prompt_tokens": 40, "worker_pid": 7} for i in range(4)]
        base["worker_call_samples"] = calls
        return {**base, "steps_logged": 2, "engine_load": ab.engine_load(calls)}

    # Capture's calls overlap pairwise-back-to-back (0.05 s apart), legacy's never do.
    summary = ab.summarize_ab({"capture": [arm(0.05)], "legacy": [arm(1.0)]})
    load = summary["engine_load"]
    assert load["capture"]["busy_s_per_step"]["median"] == pytest.approx(0.25 / 2)
    assert load["legacy"]["busy_s_per_step"]["median"] == pytest.approx(0.4 / 2)
    assert load["capture"]["tokens_per_busy_s"]["median"] == pytest.approx(40 / 0.25)
    lines = ab._engine_time_lines(summary)
    assert "| generated tokens per busy second | 160 (160-160) | 100 (100-100) |" in lines
    assert any(line.startswith("| engine ms per call, p50, at 1 in flight | - |") for line in lines)
