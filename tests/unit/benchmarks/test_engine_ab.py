"""The pure parts of benchmarks/engine_ab.py on hand-made worker samples (exact numbers)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "engine_ab.py"
_spec = importlib.util.spec_from_file_location("engine_ab", _PATH)
eab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eab)


def _call(t0: float, generate_s: float, *, capture: bool, total_s: float | None = None, tokens: int = 10) -> dict:
    sample = {"status": 200, "worker_pid": 1, "generate_t0_s": t0, "generate_s": generate_s,
              "total_s": generate_s + 0.001 if total_s is None else total_s, "generated_tokens": tokens}
    return {**sample, "capture": 1.0} if capture else sample


def test_rounds_alternate_abba() -> None:
    assert [eab.order_for_round(i)[0] for i in range(8)] == [
        "capture", "plain", "plain", "capture", "capture", "plain", "plain", "capture"]


def test_batches_split_by_round_and_refuse_a_mixed_batch() -> None:
    samples = [_call(0.0, 0.1, capture=True), _call(0.01, 0.1, capture=True),
               _call(1.0, 0.2, capture=False), _call(1.01, 0.2, capture=False)]
    batches = eab.batches_of(samples, 2)
    assert [[eab.mode_of(s) for s in b] for b in batches] == [["capture", "capture"], ["plain", "plain"]]
    with pytest.raises(ValueError, match="mixes modes"):
        eab.batches_of([samples[0], samples[2]], 2)
    with pytest.raises(ValueError, match="do not split"):
        eab.batches_of(samples[:3], 2)


def test_paired_ratio_compares_each_round_with_itself() -> None:
    # Round 1 on a quiet machine (capture 0.1 vs plain 0.2), round 2 under load (0.6 vs 0.3): the
    # per-round ratios are 0.5 and 2.0 whatever the load did between them.
    batches = [[_call(0, 0.1, capture=True)], [_call(1, 0.2, capture=False)],
               [_call(2, 0.3, capture=False)], [_call(3, 0.6, capture=True)]]
    assert eab.paired_ratios(batches) == {"rounds": 2, "median": 0.5, "q1": 0.5, "q3": 2.0}
    with pytest.raises(ValueError, match="one per mode"):
        eab.paired_ratios([[_call(0, 0.1, capture=True)], [_call(1, 0.2, capture=True)]])


def test_mode_figures_split_the_worker_call_at_the_engine() -> None:
    calls = [_call(0.0, 0.100, capture=True, total_s=0.110, tokens=10),
             _call(0.0, 0.200, capture=True, total_s=0.230, tokens=20),
             _call(0.0, 0.300, capture=True, total_s=0.302, tokens=0)]
    figures = eab.mode_figures(calls, [0.5, 0.4])
    assert figures["calls"] == 3
    assert figures["generate_ms_p50"] == pytest.approx(200.0)
    assert figures["generate_ms_per_token_p50"] == pytest.approx(10.0)  # the call without tokens has no rate
    assert figures["outside_engine_ms_p50"] == pytest.approx(10.0)  # 10, 30, 2 ms
    assert figures["outside_engine_ms_p90"] == pytest.approx(30.0)
    assert figures["client_ms_p50"] == pytest.approx(400.0)
    assert figures["generated_tokens"] == 30
    with pytest.raises(ValueError, match="no successful call"):
        eab.mode_figures([{**calls[0], "status": 503}], [])


def test_same_lengths_pairs_prompts_and_rounds() -> None:
    assert eab.same_lengths({"capture": {0: [5, 6], 1: [7]}, "plain": {0: [5, 7], 1: [7]}}) == pytest.approx(2 / 3)
    assert eab.same_lengths({"capture": {}, "plain": {}}) is None
