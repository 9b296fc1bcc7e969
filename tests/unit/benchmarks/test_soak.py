"""The pure part of benchmarks/soak.py on hand-made inputs (exact expectations)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak_bench", _PATH)
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak_bench"] = soak  # dataclasses resolve their module by name
_spec.loader.exec_module(soak)

# Titles and command lines as a capture run shows them (ps -o args).
TITLES = {
    "ray::FinalizerWorker": "finalizer",
    "ray::FinalizerWorker.finalize": "finalizer",
    "ray::VllmGenerationWorker.start_engine": "vllm_worker",
    "ray::VllmGenerationWorker": "vllm_worker",
    "VLLM::EngineCore": "vllm_engine",
    "ray::TransferQueueController": "tq_controller",
    "ray::SimpleStorageUnit.get_zmq_server_info": "tq_storage",
    "ray::PolicyWorker.train": "policy",
    "/venv/bin/python -m nemo_rl.environments.parent_watch 123 nemo_rl.environments.gate.app": "gym_gate",
    "/venv/bin/python -m nemo_rl.environments.parent_watch 123 responses_api_models.vllm_model.app": "gym_gate",
    "/venv/bin/python -m nemo_rl.environments.parent_watch 123 responses_api_agents.simple_agent.app": "gym_agent",
    "/venv/bin/python -m nemo_rl.environments.parent_watch 123 nemo_rl.environments.agents.compacting_agent": "gym_agent",
    "/venv/bin/python -m nemo_rl.environments.parent_watch 123 examples.arith.resources": "gym_resources",
    "/venv/bin/python -m nemo_rl.environments.parent_watch 1 resources_servers.example_multi_step.app": "gym_resources",
    "ray::IDLE": soak.OTHER,
    "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/x": soak.OTHER,
    "ray::DashboardAgent": soak.OTHER,
}


@pytest.mark.parametrize(("title", "component"), sorted(TITLES.items()))
def test_classify_names_each_component_by_its_title(title: str, component: str) -> None:
    assert soak.classify(10, 1, title) == component


def test_the_driver_is_known_by_its_pid_whatever_its_command_line() -> None:
    assert soak.classify(1, 1, "python examples/run_grpo_single_controller.py") == "driver"
    assert soak.classify(1, 1, "ray::FinalizerWorker") == "driver"
    assert soak.classify(2, 1, "python examples/run_grpo_single_controller.py") == soak.OTHER


def test_every_component_has_a_verdict_except_rays_own_processes() -> None:
    assert soak.COMPONENTS[0] == "driver" and soak.COMPONENTS[-1] == soak.OTHER
    assert set(soak.REQUIRED_COMPONENTS) <= set(soak.VERDICT_COMPONENTS)
    assert soak.OTHER not in soak.VERDICT_COMPONENTS and "vllm_engine" in soak.VERDICT_COMPONENTS


ENDS = [(1, 20.0), (2, 30.0), (3, 45.0)]


@pytest.mark.parametrize(
    ("t", "phase"),
    [(0.0, "startup"), (9.99, "startup"), (10.0, 1), (20.0, 1), (20.01, 2), (30.0, 2), (44.0, 3), (45.0, 3),
     (45.5, "teardown")],
)
def test_phase_of_attributes_a_sample_to_the_step_whose_line_came_next(t: float, phase) -> None:
    assert soak.phase_of(t, 10.0, ENDS) == phase


def _s(t: float, **mib: float) -> object:
    return soak.Sample(t=t, mib=mib, procs={k: 1 for k in mib})


SAMPLES = [
    _s(5.0, driver=900.0),  # start-up
    _s(12.0, driver=700.0, finalizer=200.0),
    _s(19.0, driver=750.0, finalizer=210.0),
    _s(25.0, driver=720.0, finalizer=260.0),
    _s(40.0, driver=730.0, finalizer=250.0, vllm_worker=500.0),
    _s(50.0, driver=100.0),  # teardown
]


def test_peaks_are_per_component_overall_per_step_and_around_the_steps() -> None:
    pk = soak.peaks(SAMPLES, 10.0, ENDS)
    assert pk["overall"] == {"driver": 900.0, "finalizer": 260.0, "vllm_worker": 500.0}
    assert pk["by_step"] == {
        1: {"driver": 750.0, "finalizer": 210.0},
        2: {"driver": 720.0, "finalizer": 260.0},
        3: {"driver": 730.0, "finalizer": 250.0, "vllm_worker": 500.0},
    }
    assert list(pk["by_step"]) == [1, 2, 3]
    assert pk["startup"] == {"driver": 900.0}
    assert pk["teardown"] == {"driver": 100.0}
    assert pk["anon_by_step"] == {1: {}, 2: {}, 3: {}}  # these samples carry no anonymous split


def test_anonymous_peaks_and_growth_say_where_memory_grew() -> None:
    samples = [
        soak.Sample(t=15.0, mib={**ALL}, procs={}, anon={"policy": 40.0}),
        soak.Sample(t=25.0, mib={**ALL}, procs={}, anon={"policy": 50.0}),
        soak.Sample(t=26.0, mib={**ALL}, procs={}, anon={"policy": 45.0}),
        soak.Sample(t=35.0, mib={**ALL, "policy": 180.0}, procs={}, anon={"policy": 120.0}),
    ]
    out = _summarize([_rec(k, **GOOD) for k in (1, 2, 3)], samples)
    assert out["peak_anon_rss_mib_by_step"] == {"1": {"policy": 40.0}, "2": {"policy": 50.0}, "3": {"policy": 120.0}}
    g = out["growth"]["policy"]
    assert (g["growth_mib"], g["anon_growth_mib"], g["verdict"]) == (80.0, 70.0, "growing")
    assert out["growth"]["driver"]["anon_growth_mib"] is None  # no anonymous split sampled


def test_peaks_order_steps_numerically() -> None:
    ends = [(k, float(k)) for k in range(1, 12)]
    pk = soak.peaks([_s(float(k), driver=float(k)) for k in range(1, 12)], 0.5, ends)
    assert list(pk["by_step"]) == list(range(1, 12))


def test_growth_verdict_flags_growth_above_the_larger_of_the_share_and_the_floor() -> None:
    # 15% of 1000 = 150 > 64: the share decides.
    assert soak.growth_verdict(1000.0, 1150.0, 15.0, 64.0) == {
        "base_mib": 1000.0, "last_mib": 1150.0, "growth_mib": 150.0, "growth_pct": 15.0, "threshold_mib": 150.0,
        "verdict": "bounded"}
    assert soak.growth_verdict(1000.0, 1150.5, 15.0, 64.0)["verdict"] == "growing"
    # 15% of 200 = 30 < 64: the floor decides (allocator noise of a small process is not a leak).
    assert soak.growth_verdict(200.0, 264.0, 15.0, 64.0)["verdict"] == "bounded"
    g = soak.growth_verdict(200.0, 264.5, 15.0, 64.0)
    assert (g["verdict"], g["threshold_mib"], g["growth_mib"]) == ("growing", 64.0, 64.5)
    # Shrinking is bounded.
    assert soak.growth_verdict(500.0, 400.0, 15.0, 64.0)["growth_mib"] == -100.0
    assert soak.growth_verdict(500.0, 400.0, 15.0, 64.0)["verdict"] == "bounded"


def test_growth_verdict_without_both_peaks_is_not_sampled() -> None:
    for base, last in ((None, 100.0), (100.0, None), (0.0, 100.0)):
        g = soak.growth_verdict(base, last, 15.0, 64.0)
        assert g["verdict"] == "not sampled" and g["growth_mib"] is None


def _rec(step: int, dispatched=64.0, kept=60.0, placeholders=4.0, **extra) -> dict:
    return {"step": step, "rollouts/dispatched": dispatched, "finalize/kept_rollouts": kept,
            "finalize/placeholders": placeholders, **extra}


def test_step_accounting_holds_only_when_both_equalities_hold() -> None:
    assert soak.step_accounting(_rec(1), 64) == {
        "rollouts/dispatched": 64.0, "finalize/kept_rollouts": 60.0, "finalize/placeholders": 4.0, "expected": 64,
        "holds": True}
    assert soak.step_accounting(_rec(1, kept=61.0), 64)["holds"] is False  # a rollout counted twice
    assert soak.step_accounting(_rec(1, dispatched=63.0, kept=59.0), 64)["holds"] is False  # one never dispatched
    with pytest.raises(soak.SoakError, match=r"step 1 lacks \['finalize/placeholders'\]"):
        soak.step_accounting({"step": 1, "rollouts/dispatched": 1.0, "finalize/kept_rollouts": 1.0}, 1)


def test_retention_figures_say_none_for_a_key_not_logged() -> None:
    assert soak.retention_figures(_rec(1, **{"retention/staged_keys_remaining": 0})) == {
        "retention/staged_keys_remaining": 0.0, "retention/ledger_files_remaining": None,
        "retention/train_keys_remaining": None}


def test_calls_per_rollout_sums_every_worker() -> None:
    rec = _rec(1, **{"generation/worker_0/calls": 80.0, "generation/worker_1/calls": 48.0})
    assert soak.calls_per_rollout(rec) == 2.0
    assert soak.calls_per_rollout(_rec(1)) is None
    assert soak.calls_per_rollout(_rec(1, dispatched=0.0, **{"generation/worker_0/calls": 3.0})) is None


def test_metrics_records_are_in_step_order_and_refuse_a_repeated_step() -> None:
    lines = [json.dumps(_rec(2)), "", json.dumps(_rec(1))]
    assert [r["step"] for r in soak.metrics_records(lines)] == [1, 2]
    with pytest.raises(soak.SoakError, match="step 1 appears twice"):
        soak.metrics_records([json.dumps(_rec(1)), json.dumps(_rec(1))])
    with pytest.raises(soak.SoakError, match="line 1 has no integer 'step'"):
        soak.metrics_records([json.dumps({"a": 1})])


GOOD = {"finalize/token_in_rate": 1.0, "finalize/capture_poisoned_rollouts": 0.0, "generation/worker_0/calls": 128.0,
        "retention/staged_keys_remaining": 0.0, "retention/ledger_files_remaining": 0.0,
        "retention/train_keys_remaining": 0.0}
ALL = {c: 100.0 for c in soak.REQUIRED_COMPONENTS}


def _summarize(records, samples=None, **kw):
    samples = samples if samples is not None else [_s(15.0 + 10 * k, **ALL) for k in range(3)]
    ends = [(r["step"], 20.0 + 10 * i) for i, r in enumerate(records)]
    args = dict(steps=3, expected=64, base_step=2, growth_pct=15.0, growth_floor_mib=64.0, min_calls_per_rollout=2.0)
    args.update(kw)
    return soak.summarize(samples, 10.0, ends, records, **args)


def test_summarize_passes_a_clean_soak() -> None:
    out = _summarize([_rec(k, **GOOD) for k in (1, 2, 3)])
    assert {name: c["ok"] for name, c in out["checks"].items()} == {
        "steps": True, "accounting": True, "exactness": True, "multi_turn": True, "retention": True,
        "sampled": True, "bounded": True}
    assert out["passed"] is True
    assert out["growth"]["driver"]["verdict"] == "bounded" and out["growth"]["driver"]["growth_mib"] == 0.0
    assert (out["growth_base_step"], out["growth_last_step"]) == (2, 3)
    assert out["rss_growth_first_to_last_step_mib"]["finalizer"] == 0.0
    assert out["steps"][0]["model_calls_per_rollout"] == 2.0
    assert out["peak_rss_mib_by_step"]["2"]["policy"] == 100.0


def test_summarize_fails_each_check_for_its_own_reason() -> None:
    records = [
        _rec(1, **GOOD),
        _rec(2, kept=0.0, placeholders=64.0, **GOOD),  # nothing kept: exactness
        _rec(3, **{**GOOD, "retention/staged_keys_remaining": 3.0, "generation/worker_0/calls": 64.0}),
    ]
    grown = {**ALL, "driver": 300.0}
    samples = [_s(15.0, **ALL), _s(25.0, **ALL), _s(35.0, **grown)]
    out = _summarize(records, samples, steps=4)
    checks = {name: c["ok"] for name, c in out["checks"].items()}
    assert checks == {"steps": False, "accounting": True, "exactness": False, "multi_turn": False,
                      "retention": False, "sampled": True, "bounded": False}
    assert out["checks"]["exactness"]["detail"].endswith("fails at steps [2]")
    assert out["checks"]["retention"]["detail"] == (
        "left after retirement: {3: {'retention/staged_keys_remaining': 3.0}}")
    assert out["checks"]["bounded"]["detail"].startswith("growing (MiB from step 2 to 3): {'driver': 200.0}")
    assert out["passed"] is False


def test_summarize_reports_unlogged_retention_as_not_logged_and_passes() -> None:
    out = _summarize([_rec(k, **{"finalize/token_in_rate": 1.0, "finalize/capture_poisoned_rollouts": 0.0,
                                 "generation/worker_0/calls": 128.0}) for k in (1, 2, 3)])
    assert out["checks"]["retention"] == {
        "ok": None, "detail": "not logged: ['retention/ledger_files_remaining', 'retention/staged_keys_remaining', "
              "'retention/train_keys_remaining']"}
    assert out["passed"] is True


def test_summarize_names_unsampled_components_and_needs_a_step_after_the_base() -> None:
    samples = [_s(15.0, driver=1.0), _s(25.0, driver=1.0)]
    out = _summarize([_rec(k, **GOOD) for k in (1, 2)], samples, steps=2)
    assert out["checks"]["sampled"]["ok"] is False
    assert out["checks"]["sampled"]["detail"].startswith("never sampled: ['vllm_worker', 'tq_controller'")
    assert out["checks"]["bounded"] == {"ok": None, "detail": "needs a step after --base-step=2 (last logged: 2)"}


def test_a_step_is_multi_turn_at_a_mean_of_at_least_1_5_calls_per_rollout() -> None:
    assert soak.MIN_CALLS_PER_ROLLOUT == 1.5
    ok = _summarize([_rec(k, **{**GOOD, "generation/worker_0/calls": 96.0}) for k in (1, 2, 3)],
                    min_calls_per_rollout=soak.MIN_CALLS_PER_ROLLOUT)
    assert ok["checks"]["multi_turn"]["ok"] is True  # half of 64 rollouts made their second call
    short = _summarize([_rec(k, **{**GOOD, "generation/worker_0/calls": 95.0}) for k in (1, 2, 3)],
                       min_calls_per_rollout=soak.MIN_CALLS_PER_ROLLOUT)
    assert short["checks"]["multi_turn"] == {
        "ok": False, "detail": "model calls per rollout {1: 1.484375, 2: 1.484375, 3: 1.484375} (need >= 1.5)"}


def test_the_driver_runs_the_recipe_with_capture_on_and_the_soaks_sizes(tmp_path: Path) -> None:
    args = soak.parse_args(["--out", str(tmp_path), "--steps", "3", "--prompts", "4", "--generations", "16",
                            "--max-tokens", "24", "env.agent_max_steps=3"])
    command = soak.driver_command(args, tmp_path / "logs")
    assert command[1:] == [
        str(soak.DRIVER_SCRIPT), "--config", str(soak.DEFAULT_CONFIG), "token_capture.enabled=true",
        "grpo.max_num_steps=3", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=16",
        f"logger.log_dir={tmp_path / 'logs'}", "grpo.max_output_tokens=24", "generation.max_new_tokens=24",
        "env.agent_max_steps=3",
    ]
    defaults = soak.parse_args(["--out", str(tmp_path)])
    assert (defaults.steps, defaults.prompts * defaults.generations, defaults.base_step) == (5, 64, 2)
    with pytest.raises(SystemExit):
        soak.parse_args(["--out", str(tmp_path), "--prompts", "0"])


def test_the_pump_logs_every_line_and_marks_each_steps_dispatch(tmp_path: Path) -> None:
    import io

    clock = iter([1.5, 9.0])
    obs = soak.Observation(t0=0.0)
    obs.now = lambda: next(clock)  # type: ignore[method-assign]
    text = ("[stack] ray up in 3.0s\n[step 1] dispatching 8 groups x 8 rollouts\n[step 1] training on 64 rows\n"
            "[step 2] dispatching 8 groups x 8 rollouts\n")
    soak._pump(io.StringIO(text), tmp_path / "driver.log", obs)
    assert (tmp_path / "driver.log").read_text() == text
    assert obs.dispatched == {1: 1.5, 2: 9.0}


def test_a_reused_out_folder_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    with pytest.raises(soak.SoakError, match="exists: the driver appends to metrics.jsonl"):
        soak.run_soak(soak.parse_args(["--out", str(tmp_path)]))
