"""Chaos under async overlap: SIGKILL components while groups are in flight, check the verdict.

Two driver runs (two stack starts) of `examples/configs/grpo_async_tiny_cpu.yaml` (async on,
`token_capture.on_component_failure=abort`, the only policy async runs) with P=2 groups of N=4,
`max_in_flight_groups=3` (so step s+1's first group is in flight while step s is gathered) at
`max_trajectory_age_steps=2` (no stale drops), and every generation call held 6..10 s by
`slow_calls_hook` (so the kill lands while calls are in flight). The kill's cue is the trainer's
first `[step s] waiting for its groups (k group(s) running)` line with s >= 2 and k >= 1 (the
trainer idles: step s's groups are still running; which step first waits depends on the
machine's speed, so the death step s is read from the cue that fired). With the cap at 3, step s+1's first
group (position 2s) is in flight too.

- `trio`: the gate, TransferQueue storage unit 0 and finalizer 0, killed in one round.
- `worker`: the vLLM worker actor, mid-call.

Expected, both: the step that sees the deaths (s) is logged with its accounting
(dispatched == kept + placeholders, its in-flight rollouts `component_failed`), nothing of it
trains, and the run stops with `ComponentFailedError` naming every dead component in that step,
within the sync chaos test's deadlines; no group is dispatched after the death; the groups still
in flight (step s+1's first) are reported at exit, exactly the dispatches the run recorded beyond step 3;
no process outlives the run.
"""

from __future__ import annotations

import re

import pytest

from tests.integration.chaos_driver import STEP_AFTER_DEATH_MAX_S, ChaosRun, Kill, drive, driver_lines, jsonl

RECIPE = "examples/configs/grpo_async_tiny_cpu.yaml"
P, N, CAP = 2, 4, 3
OVERRIDES = [
    "token_capture.on_component_failure=abort", "grpo.max_num_steps=8", f"grpo.num_prompts_per_step={P}",
    f"grpo.num_generations_per_prompt={N}", f"grpo.async_rollouts.max_in_flight_groups={CAP}",
    "grpo.async_rollouts.max_trajectory_age_steps=2",
]
SLOW = {"NRL_INSTRUMENTATION": "tests.integration.slow_calls_hook", "NRL_TEST_CALL_DELAY_S": "6.0,10.0"}
CUE = r"^\[step ([2-7])\] waiting for its groups \([1-9]"


def death_step(run: ChaosRun) -> int:
    """The step whose wait was the cue the kills fired on (the first line that matched)."""
    cue = re.search(CUE, run.output, re.MULTILINE)
    assert cue is not None, run.output[-4000:]
    return int(cue[1])


@pytest.fixture(scope="module")
def trio_run(tmp_path_factory) -> ChaosRun:
    kills = [Kill(CUE, "gate"), Kill(CUE, "tq_storage_unit_0"), Kill(CUE, "finalizer_0")]
    return drive(tmp_path_factory.mktemp("chaos_async_trio"), RECIPE, OVERRIDES, kills, SLOW)


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory) -> ChaosRun:
    return drive(tmp_path_factory.mktemp("chaos_async_worker"), RECIPE, OVERRIDES, [Kill(CUE, "vllm_worker_0")], SLOW)


def _check_the_run_stopped_at_the_death_step(run: ChaosRun, deaths: int) -> dict:
    """Steps 1..s logged, each accounted; only the steps before the death trained; returns step s's line."""
    assert [m["step"] for m in run.metrics] == list(range(1, death_step(run) + 1))
    for m in run.metrics:
        assert m["rollouts/dispatched"] == m["finalize/kept_rollouts"] + m["finalize/placeholders"] == P * N, m
    for m in run.metrics[:-1]:
        assert m["component/deaths"] == 0.0 and m["train/num_samples"] == m["finalize/rows"] > 0, m
    last = run.metrics[-1]
    assert last["component/deaths"] == float(deaths), last
    assert not [k for k in last if k.startswith(("train/", "refit/"))], last  # nothing of it trained or refit
    assert last["finalize/placeholders/component_failed"] >= 1.0, last  # rollouts in flight at the kill
    assert last["async/trainer_wait_s"] < STEP_AFTER_DEATH_MAX_S  # the line is logged before the step's timer ends
    assert run.returncode != 0
    assert run.exited_at - max(k.killed_at for k in run.kills) < STEP_AFTER_DEATH_MAX_S + 60.0  # + teardown
    return last


def _check_in_flight_groups_reported(run: ChaosRun) -> None:
    """No dispatch after the death; the exit names exactly the dispatched groups beyond the death step."""
    dispatches, s = jsonl(run.log_dir / "dispatched_prompts.jsonl"), death_step(run)
    beyond = {f"p{d['position']}.g{d['generation']}" for d in dispatches if d["step"] > s}
    assert beyond == {f"p{P * s}.g0"}, dispatches  # the cap (3) keeps step s+1's first group in flight, no more
    assert all(d["dispatched_during_step"] <= s for d in dispatches)
    stopped = [line for line in driver_lines(run.output) if line.startswith("[async] stopped with ")]
    assert len(stopped) == 1, run.output[-4000:]
    assert set(re.findall(r"p\d+\.g\d+", stopped[0])) == beyond, stopped
    assert stopped[0].endswith("none of their rollouts was trained")
    assert "still cleaning up" not in run.output


@pytest.mark.integration
def test_async_gate_storage_unit_and_finalizer_killed_together_are_named_in_the_step_that_sees_them(
    trio_run: ChaosRun,
) -> None:
    run = trio_run
    last = _check_the_run_stopped_at_the_death_step(run, deaths=3)
    assert last["component/down"] == 2.0  # gate and storage unit are on the rollout path; the finalizer is not
    pids = {k.component: k.pid for k in run.kills}
    gate = f"gate died: Gym server policy_model (pid {pids['gate']}) killed by SIGKILL"
    unit = "tq_storage_unit_0 died: TransferQueue storage_unit_0 (Ray actor) is gone"
    for named in (gate, unit, "finalizer_0 died: "):
        assert f"[health] {named}" in run.output
    error = [line for line in driver_lines(run.output) if "ComponentFailedError: " in line]
    assert len(error) == 1, run.output[-6000:]
    # one message, the three named in name order, in the step that saw them
    assert re.search(rf"ComponentFailedError: step {death_step(run)}: finalizer_0 died: .*; {re.escape(gate)}; "
                     rf"{re.escape(unit)}.*The step was accounted and logged", error[0]), error[0]
    # the first round that found one of them halted dispatching (the others may come a round later)
    assert re.search(r"^\[async\] (finalizer_0|gate|tq_storage_unit_0)(, (finalizer_0|gate|tq_storage_unit_0))* "
                     r"died: no more groups are dispatched", run.output, re.MULTILINE)
    _check_in_flight_groups_reported(run)


@pytest.mark.integration
def test_async_worker_killed_mid_call_is_named_and_nothing_of_its_step_trains(worker_run: ChaosRun) -> None:
    run = worker_run
    last = _check_the_run_stopped_at_the_death_step(run, deaths=1)
    assert last["component/down"] == 1.0
    worker = "vllm_worker_0 died: vLLM worker 0 (Ray actor) is gone"
    assert f"[health] {worker}" in run.output
    assert f"ComponentFailedError: step {death_step(run)}: {worker}" in run.output
    assert not [line for line in driver_lines(run.output) if "AsyncLoopError" in line or "RayActorError" in line]
    assert re.search(r"^\[async\] vllm_worker_0 died: no more groups are dispatched", run.output, re.MULTILINE)
    _check_in_flight_groups_reported(run)


@pytest.mark.integration
def test_no_process_outlives_an_async_chaos_run(trio_run: ChaosRun, worker_run: ChaosRun) -> None:
    assert trio_run.leftovers == {}
    assert worker_run.leftovers == {}
