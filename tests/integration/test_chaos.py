"""Chaos through the real stack: SIGKILL a component mid-step, check the run's verdict and accounting.

Three driver runs (three stack starts) cover every watched component, both policies of
`token_capture.on_component_failure` and both paths (capture on, and Gym's legacy echo):

- `continue` (one run, three kills): the gate (Gym's model server) as step 2 is dispatched; the
  finalizer actor once step 3's first group is accounted (the other groups are finalizing or
  about to, queued on it); a TransferQueue storage unit as step 4 is dispatched. Expected: step 2's
  rollouts become `component_failed` placeholders naming the gate within seconds (not the
  10-minute run deadline), the gate is restarted before step 3 and step 3 trains again; the dead
  finalizer is replaced and nothing it held is lost; with the storage unit dead nothing can be
  verified, steps 4 and 5 are masked, and the run stops with `MaskedStepsError`
  (`max_consecutive_masked_steps=2`) naming the storage unit.
- `abort`: the vLLM worker's engine-core process (the child process vLLM's AsyncLLM runs under
  the worker actor, which stays alive) as step 2 is dispatched. The run stops with
  `ComponentFailedError` naming `vllm_worker_0/engine_core`, after step 2's accounting line
  (every rollout `component_failed`), with nothing of step 2 trained, never as the next refit's
  `EngineDeadError` traceback.
- `legacy` (`token_capture.enabled=false`, abort): the vLLM worker actor as step 2 is
  dispatched. The same watch (Gym servers, workers, engine cores; no TransferQueue, no
  finalizers) names it within seconds, not after `env.run_timeout_s`: `ComponentFailedError`
  naming `vllm_worker_0` after step 2's accounting line.

Every step of both runs: dispatched == kept + placeholders, and the rows trained are exactly the
rows finalized that step (nothing trained twice, nothing from a masked step). The kills are by
PID, read from the run's own `run_info.json` (`components`); processes the run leaves behind are
listed, killed by PID and reported.
"""

from __future__ import annotations

import pytest

from tests.integration.chaos_driver import (
    STEP_AFTER_DEATH_MAX_S,
    ChaosRun,
    Kill,
    check_every_step,
    drive,
    driver_lines,
)

RECIPE = "examples/configs/grpo_capture_tiny_cpu.yaml"


def _drive(tmp, overrides: list[str], kills: list[Kill]) -> ChaosRun:
    return drive(tmp, RECIPE, overrides, kills)


@pytest.fixture(scope="module")
def continue_run(tmp_path_factory) -> ChaosRun:
    overrides = [
        "token_capture.on_component_failure=continue", "token_capture.max_consecutive_masked_steps=2",
        "grpo.max_num_steps=8", "grpo.num_prompts_per_step=4",
    ]
    kills = [
        Kill(r"^\[step 2\] dispatching", "gate"),
        Kill(r"^\[step 3\] group \d+/4", "finalizer_0"),
        Kill(r"^\[step 4\] dispatching", "tq_storage_unit_0"),
    ]
    return _drive(tmp_path_factory.mktemp("chaos_continue"), overrides, kills)


@pytest.fixture(scope="module")
def abort_run(tmp_path_factory) -> ChaosRun:
    overrides = ["token_capture.on_component_failure=abort", "grpo.max_num_steps=3"]
    kill = Kill(r"^\[step 2\] dispatching", "vllm_worker_0/engine_core")
    return _drive(tmp_path_factory.mktemp("chaos_abort"), overrides, [kill])


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory) -> ChaosRun:
    overrides = ["token_capture.enabled=false", "token_capture.on_component_failure=abort", "grpo.max_num_steps=3"]
    return _drive(tmp_path_factory.mktemp("chaos_legacy"), overrides, [Kill(r"^\[step 2\] dispatching", "vllm_worker_0")])


@pytest.mark.integration
def test_continue_gate_death_is_named_at_once_and_the_restarted_gate_is_picked_up(continue_run: ChaosRun) -> None:
    check_every_step(continue_run)
    by_step = {m["step"]: m for m in continue_run.metrics}
    step2, step3 = by_step[2], by_step[3]
    assert step2["component/deaths"] == 1.0
    assert step2["finalize/placeholders/component_failed"] == step2["rollouts/dispatched"] == 16.0
    assert step2["timing/generation_s"] < STEP_AFTER_DEATH_MAX_S
    assert "[health] gate died: Gym server policy_model" in continue_run.output
    assert "killed by SIGKILL" in continue_run.output
    assert step3["component/restarts"] == 1.0
    assert "[health] restarted gate (Gym server policy_model)" in continue_run.output
    assert step3["finalize/kept_rollouts"] > 0 and "train/num_samples" in step3


@pytest.mark.integration
def test_continue_finalizer_death_loses_nothing_and_is_replaced(continue_run: ChaosRun) -> None:
    by_step = {m["step"]: m for m in continue_run.metrics}
    # Found dead by the watch or by a failed call during step 3, or at the latest before step 4.
    replaced = by_step[3]["finalize/replaced_workers"] + by_step[4]["finalize/replaced_workers"]
    assert replaced == 1.0
    assert "finalizer_0 died" in continue_run.output
    # Items queued on the dead actor are placeholders (`finalizer_unavailable`) or went to its
    # replacement; either way every rollout of step 3 is accounted and the step still trains.
    step3 = by_step[3]
    assert step3["finalize/kept_rollouts"] + step3["finalize/placeholders"] == step3["rollouts/dispatched"] == 16.0
    assert step3["finalize/kept_rollouts"] > 0 and step3["train/num_samples"] == step3["finalize/rows"]


@pytest.mark.integration
def test_continue_dead_storage_unit_masks_steps_then_the_run_stops_loudly(continue_run: ChaosRun) -> None:
    by_step = {m["step"]: m for m in continue_run.metrics}
    assert sorted(by_step) == [1, 2, 3, 4, 5]  # steps 4 and 5 masked: the streak limit (2) stops the run
    for step in (4, 5):
        m = by_step[step]
        reasons = {k.rsplit("/", 1)[-1]: v for k, v in m.items() if k.startswith("finalize/placeholders/")}
        # Every rollout is a placeholder: in flight when the watch saw the death -> component_failed;
        # a rollout whose replies already left (staging behind the reply; measured: 3 of 16 in one
        # run, all 16 in another) finds its rows never landed -> staged_record_missing. Nothing of
        # the step trains either way, and the step's warning names the dead unit (asserted below).
        assert m["finalize/placeholders"] == sum(reasons.values()) == m["rollouts/dispatched"] == 16.0, reasons
        assert set(reasons) <= {"component_failed", "staged_record_missing"}, reasons
        assert m["finalize/kept_rollouts"] == 0.0 and "train/num_samples" not in m
        assert m["component/down"] == 1.0 and m["steps/masked_consecutive"] == float(step - 3)
        assert "retention/staged_keys_remaining" not in m  # a dead data plane cannot list its keys
    assert by_step[4]["component/deaths"] == 1.0
    assert continue_run.returncode != 0
    assert "MaskedStepsError" in continue_run.output
    assert "Down: tq_storage_unit_0 died: TransferQueue storage_unit_0 (Ray actor) is gone" in continue_run.output
    tq_kill = continue_run.kills[2]
    assert continue_run.exited_at - tq_kill.killed_at < 2 * STEP_AFTER_DEATH_MAX_S + 60.0  # + teardown
    for step in (1, 3):
        assert by_step[step]["retention/staged_keys_remaining"] == 0.0
        assert by_step[step]["retention/ledger_files_remaining"] == 0.0


@pytest.mark.integration
def test_abort_engine_core_death_stops_the_run_naming_it_after_the_step_is_accounted(abort_run: ChaosRun) -> None:
    check_every_step(abort_run)
    kill = abort_run.kills[0]
    assert abort_run.returncode != 0
    core = f"vllm_worker_0/engine_core died: vLLM worker 0 engine core EngineCore (pid {kill.pid}) killed by SIGKILL"
    assert f"[health] {core}" in abort_run.output
    assert f"ComponentFailedError: step 2: {core}." in abort_run.output
    # The driver's own lines: no refit traceback.
    lines = driver_lines(abort_run.output)
    assert not [line for line in lines if "EngineDeadError" in line or "failed: EngineFailedError" in line]
    assert "vllm_worker_0 died" not in abort_run.output  # the worker actor lived on; only its engine core died
    assert [m["step"] for m in abort_run.metrics] == [1, 2]
    step2 = abort_run.metrics[1]
    assert step2["component/deaths"] == 1.0 and step2["component/down"] == 1.0
    assert step2["finalize/placeholders/component_failed"] == step2["rollouts/dispatched"] == 8.0
    assert step2["timing/generation_s"] < STEP_AFTER_DEATH_MAX_S
    assert "train/num_samples" not in step2
    assert abort_run.exited_at - kill.killed_at < STEP_AFTER_DEATH_MAX_S + 60.0  # + teardown


@pytest.mark.integration
def test_legacy_path_worker_death_is_named_within_the_watch_deadline(legacy_run: ChaosRun) -> None:
    check_every_step(legacy_run)
    components = legacy_run.run_info()["components"]
    # What the legacy path has (Gym servers, the worker, its engine core), and nothing it lacks.
    assert {"gate", "vllm_worker_0", "vllm_worker_0/engine_core"} <= set(components)
    assert not [name for name in components if name.startswith(("tq_", "finalizer_"))], components
    assert legacy_run.returncode != 0
    assert "[health] vllm_worker_0 died: vLLM worker 0 (Ray actor) is gone" in legacy_run.output
    assert "ComponentFailedError: step 2: vllm_worker_0 died: vLLM worker 0 (Ray actor) is gone" in legacy_run.output
    assert [m["step"] for m in legacy_run.metrics] == [1, 2]
    step1, step2 = legacy_run.metrics
    assert step1["component/deaths"] == 0.0 and step1["train/num_samples"] == step1["finalize/rows"] > 0
    assert step2["component/deaths"] == 1.0
    assert step2["finalize/placeholders/component_failed"] == step2["rollouts/dispatched"] == 8.0
    assert step2["timing/generation_s"] < STEP_AFTER_DEATH_MAX_S  # not env.run_timeout_s (600 s)
    assert "train/num_samples" not in step2
    kill = legacy_run.kills[0]
    assert legacy_run.exited_at - kill.killed_at < STEP_AFTER_DEATH_MAX_S + 60.0  # + teardown


@pytest.mark.integration
def test_no_process_outlives_a_chaos_run(continue_run: ChaosRun, abort_run: ChaosRun, legacy_run: ChaosRun) -> None:
    assert continue_run.leftovers == {}
    assert abort_run.leftovers == {}
    assert legacy_run.leftovers == {}
