"""The async loop's pieces: key ownership, the engine-counter metrics, the step's train-row clearing
(only its own rollouts' keys), the producer over the real ledger (cap, order, drops re-dispatched
first, errors reach the trainer, teardown reports what was in flight), the trainer's gather
(stale groups dropped whole, future versions refused) and an aborted refit; the resumed ledger is
test_grpo_checkpoint_ledger.py's."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from nemo_rl.algorithms import grpo_async
from nemo_rl.algorithms.async_config import AsyncRolloutsConfig
from nemo_rl.algorithms.errors import GRPOError
from nemo_rl.algorithms.grpo_health import ComponentFailedError
from nemo_rl.algorithms.grpo_async import (
    AsyncLoopError,
    RolloutProducer,
    TrainerClock,
    clear_step_train_rows,
    dispatch_halt,
    dispatch_record,
    engine_step_metrics,
    gather_step,
    keys_of_rollouts,
    refit_tolerating_aborts,
)
from nemo_rl.data.rows import GroupResult, Placeholder, PlaceholderReason
from nemo_rl.experience.prompt_queue import GroupTicket, PromptLedger
from nemo_rl.experience.errors import AccountingError
from nemo_rl.experience.finalizer_pool import FinalizerPoolError
from nemo_rl.models.generation.vllm.errors import RefitAbortedWorkerError
from tests.unit.experience.test_staleness import group_of


def test_keys_of_rollouts_matches_the_whole_rollout_id_only():
    keys = ["r-s1-g0-i0-a0#0", "r-s1-g0-i0-a0#1", "r-s1-g0-i1-a0#0", "r-s1-g0-i0-a01#0", "r-s2-g0-i0-a0#0"]
    assert keys_of_rollouts(keys, ["r-s1-g0-i0-a0"]) == ["r-s1-g0-i0-a0#0", "r-s1-g0-i0-a0#1"]
    assert keys_of_rollouts(keys, []) == []


def _timing(clock, idle, pause=0.0, drained=0, aborted=0):
    return {"clock_s": clock, "idle_s": idle, "refits": 0, "refits_aborted": aborted, "refit_pause_s": pause,
            "refit_drained_calls": drained, "refits_with_calls_in_flight": int(drained > 0)}


def test_engine_step_metrics_are_deltas_of_the_workers_own_counters():
    before = [_timing(100.0, 10.0), _timing(50.0, 5.0, pause=1.0, drained=2)]
    after = [_timing(110.0, 12.5, pause=0.5, drained=3), _timing(70.0, 15.0, pause=1.25, drained=2, aborted=1)]
    assert engine_step_metrics(before, after) == {
        "async/worker_0/engine_idle_fraction": 0.25, "async/worker_0/refit_pause_s": 0.5,
        "async/worker_0/refit_calls_in_flight": 3.0,
        "async/worker_1/engine_idle_fraction": 0.5, "async/worker_1/refit_pause_s": 0.25,
        "async/worker_1/refit_calls_in_flight": 0.0,
        "async/engine_idle_fraction": 0.375, "async/refit_pause_s": 0.5, "async/refit_calls_in_flight": 3.0,
        "refit/aborted_workers": 1.0,
    }


def test_engine_step_metrics_refuse_a_clock_that_did_not_move_or_a_changed_worker_count():
    with pytest.raises(GRPOError, match="engine clock did not advance") as excinfo:
        engine_step_metrics([_timing(1.0, 0.0)], [_timing(1.0, 0.0)])
    assert excinfo.value.kind == "worker_metrics"
    with pytest.raises(GRPOError, match="same, non-zero count") as excinfo:
        engine_step_metrics([_timing(1.0, 0.0)], [])
    assert excinfo.value.kind == "worker_metrics"


class FakeCleaner:
    def __init__(self, keys):
        self.keys = list(keys)
        self.cleared: list[list[str]] = []

    def clear(self, keys):
        if keys:
            self.cleared.append(list(keys))
        self.keys = [k for k in self.keys if k not in set(keys)]

    def remaining(self):
        return list(self.keys)


def test_the_step_clears_its_own_and_its_dropped_groups_keys_never_those_in_flight():
    trained = ["a-i0#0", "a-i1#0"]
    stray = ["a-i2#0"]  # a rollout masked after it was judged
    dropped = ["d-i0#0"]  # a stale group dropped this step
    in_flight = ["b-i0#0", "b-i1#0"]
    cleaner = FakeCleaner(trained + stray + dropped + in_flight)
    metrics = clear_step_train_rows(cleaner, trained, ["a-i0", "a-i1", "a-i2", "d-i0"], dropped)
    assert cleaner.cleared == [trained, stray + dropped]
    assert cleaner.keys == in_flight
    assert metrics == {"retention/train_keys_cleared": 4.0, "retention/train_keys_stray": 1.0,
                       "retention/train_keys_dropped_stale": 1.0, "retention/train_keys_remaining": 0.0,
                       "retention/train_keys_in_flight": 2.0}


def test_dispatch_records_name_the_sync_slot_position_and_generation():
    record = dispatch_record(GroupTicket(5, 1, 2), {"prompt": "x"}, 3)
    assert {k: v for k, v in record.items() if k != "digest"} == {
        "step": 3, "group": 1, "position": 5, "generation": 1, "dispatched_during_step": 3}
    assert len(record["digest"]) == 64


def _failed_group(ticket: GroupTicket) -> GroupResult:
    return GroupResult(ticket.group_index, (Placeholder(f"p{ticket.position}", ticket.group_index, 0,
                                                         PlaceholderReason.RUN_FAILED, "x"),))


class Scripted:
    """Groups that finish when released (by position); records dispatch order."""

    def __init__(self):
        self.started: list[tuple[int, int]] = []
        self.gates: dict[tuple[int, int], asyncio.Event] = {}
        self.fail: set[int] = set()

    async def __call__(self, ticket: GroupTicket) -> GroupResult:
        self.started.append((ticket.position, ticket.generation))
        await self.gates.setdefault((ticket.position, ticket.generation), asyncio.Event()).wait()
        if ticket.position in self.fail:
            raise RuntimeError(f"group {ticket.position} broke")
        return _failed_group(ticket)

    def release(self, position, generation=0):
        self.gates.setdefault((position, generation), asyncio.Event()).set()


async def test_the_producer_keeps_the_cap_filled_in_order_and_stops_at_the_end():
    ledger, script = PromptLedger(2, 4), Scripted()
    producer = RolloutProducer(ledger, script, end=6)
    assert producer.fill() == 4
    await asyncio.sleep(0)
    assert script.started == [(0, 0), (1, 0), (2, 0), (3, 0)]
    for p in (3, 2, 1, 0):  # finishing out of order: the head is still positions 0, 1
        script.release(p)
    head, groups = await producer.wait_head()
    assert [t.position for t in head] == [0, 1] and len(groups) == 2
    assert ledger.in_flight == 4  # finished groups hold the cap until the trainer consumes them
    producer.commit(1, head, groups)
    await asyncio.sleep(0)
    assert script.started[4:] == [(4, 0), (5, 0)]
    assert producer.fill() == 0  # position 6 is beyond the run's last step
    assert ledger.step == 1


async def test_a_dropped_group_is_re_dispatched_first_under_a_new_generation():
    ledger, script = PromptLedger(2, 3), Scripted()
    producer = RolloutProducer(ledger, script, end=4)
    producer.fill()
    for p in (0, 1, 2):
        script.release(p)
    head, _ = await producer.wait_head()
    producer.drop(head[1])
    await asyncio.sleep(0)
    assert script.started[3:] == [(1, 1)]  # ahead of position 3
    assert ledger.dropped_stale_total == 1
    script.release(1, 1)
    head, groups = await producer.wait_head()
    assert [(t.position, t.generation) for t in head] == [(0, 0), (1, 1)]
    producer.commit(1, head, groups)
    await asyncio.sleep(0)
    assert script.started[4:] == [(3, 0)]


async def test_a_failing_group_reaches_the_trainer_and_teardown_reports_what_ran():
    ledger, script = PromptLedger(2, 4), Scripted()
    script.fail = {1}
    producer = RolloutProducer(ledger, script, end=8)
    producer.fill()
    script.release(1)
    script.release(2)
    with pytest.raises(AsyncLoopError, match="a rollout group failed: RuntimeError: group 1 broke") as excinfo:
        await producer.wait_head()
    assert excinfo.value.kind == "async_loop"
    assert producer.fill() == 0  # no dispatch after a failure
    running, unconsumed, stuck = await producer.aclose(deadline_s=5.0)
    assert sorted(t.position for t in running) == [0, 3]
    assert [t.position for t in unconsumed] == [2]
    assert stuck == ()


async def test_a_group_failure_names_the_kind_of_a_kinded_error():
    async def run_group(ticket: GroupTicket) -> GroupResult:
        raise FinalizerPoolError("finalizer worker 0 raised while judging rollout r-0 (a bug, not a data fault)",
                                 kind="bug")

    producer = RolloutProducer(PromptLedger(1, 1), run_group, end=1)
    producer.fill()
    with pytest.raises(AsyncLoopError) as excinfo:
        await producer.wait_head()
    assert str(excinfo.value) == ("a rollout group failed: FinalizerPoolError[bug]: finalizer worker 0 raised while "
                                  "judging rollout r-0 (a bug, not a data fault)")
    assert type(excinfo.value.__cause__) is FinalizerPoolError and excinfo.value.__cause__.kind == "bug"
    await producer.aclose(deadline_s=5.0)


async def test_a_step_that_can_never_complete_is_named_not_awaited_forever():
    ledger = PromptLedger(2, 2)
    producer = RolloutProducer(ledger, Scripted(), end=1)  # the run ends inside the step: a wiring bug
    producer.fill()
    await producer.aclose(deadline_s=5.0)
    producer2 = RolloutProducer(PromptLedger(2, 2), Scripted(), end=0)
    with pytest.raises(AsyncLoopError, match=r"step 1 waits for positions \[0, 1\] but no group is running") as excinfo:
        await producer2.wait_head()
    assert excinfo.value.kind == "async_loop"


def test_the_integration_tests_call_spreading_hook_is_a_complete_hook_module():
    from nemo_rl.utils.instrumentation import load_hooks

    hooks = load_hooks("tests.integration.slow_calls_hook")
    assert len(hooks.aiohttp_middlewares("worker")) == 1 and hooks.aiohttp_middlewares("gym") == []
    assert hooks.active() is False and hooks.server_module_argv("m") == ["m"]


def test_the_call_spreading_hook_draws_the_same_delays_on_every_run(monkeypatch):
    import importlib.util

    monkeypatch.delenv("NRL_TEST_CALL_DELAY_S", raising=False)  # the default window, 0.5..2.0 s

    def delays(seed: str) -> list[float]:
        monkeypatch.setenv("NRL_TEST_HOOK_SEED", seed)
        spec = importlib.util.find_spec("tests.integration.slow_calls_hook")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # a fresh copy: what a new worker process reads
        return [module.RNG.uniform(*module.DELAY_S) for _ in range(3)]

    seeded = random.Random(0)
    assert delays("0") == [seeded.uniform(0.5, 2.0) for _ in range(3)]
    assert delays("0") == delays("0") != delays("1")



# -- the trainer's gather and an aborted refit, over stand-ins of the run -----


def _run(p=2, max_age=1, cap=None, start_step=1):
    grpo = SimpleNamespace(num_prompts_per_step=p, async_rollouts=AsyncRolloutsConfig(
        enabled=True, max_trajectory_age_steps=max_age, max_in_flight_groups=cap))
    said: list[str] = []
    return SimpleNamespace(cfg=SimpleNamespace(grpo=grpo), start_step=start_step, progress=said.append, said=said)


async def test_gather_drops_a_stale_group_whole_and_trains_its_re_run():
    versions = {(0, 0): 2, (1, 0): 0, (1, 1): 3}  # (position, generation) -> the version its calls ran under

    async def run_group(ticket):
        return group_of(ticket.group_index, [[(versions[(ticket.position, ticket.generation)],)]] * 2)

    run = _run()
    producer = RolloutProducer(PromptLedger(2, 2), run_group, end=2)
    metrics: dict[str, float] = {}
    ticks = iter(range(100))  # each reading one second later: every wait reads 1 s
    groups, dropped = await gather_step(run, producer, 1, TrainerClock(3), metrics, clock=lambda: float(next(ticks)))
    assert [g.group_index for g in dropped] == [1] and len(groups) == 2
    assert producer.ledger.step == 1 and producer.ledger.dropped_stale_total == 1
    assert run.said == ["[step 1] waiting for its groups (2 group(s) running)",
                        "[step 1] dropped stale group p1.g0 (sync step 1 group 1): tokens older than version 2; "
                        "re-queued"]
    assert metrics == {
        "async/trainer_wait_s": 2.0,  # the wait for the step's groups, then for the dropped group's re-run
        "async/dropped_stale_rollouts": 2.0, "async/trainer_version": 3.0,
        "async/in_flight_groups": 0.0, "async/dropped_stale_groups": 1.0,
        "async/trajectory_age_steps_min": 0.0, "async/trajectory_age_steps_mean": 0.5,
        "async/trajectory_age_steps_max": 1.0,
        "async/trajectory_age_steps/hist/0": 2.0, "async/trajectory_age_steps/hist/1": 2.0,
        "async/trajectory_age_steps/hist/older": 0.0,
    }


async def test_gather_refuses_rows_newer_than_the_trainer():
    async def run_group(ticket):
        return group_of(ticket.group_index, [[(4,)]])

    producer = RolloutProducer(PromptLedger(1, 1), run_group, end=1)
    with pytest.raises(AccountingError, match="carries weight version 4 but the trainer holds version 3") as excinfo:
        await gather_step(_run(p=1), producer, 1, TrainerClock(3), {})
    assert excinfo.value.kind == "future_version"


def test_an_aborted_refit_keeps_the_versions_the_workers_report(monkeypatch):
    def aborted(run, step):
        raise RefitAbortedWorkerError("vLLM worker 0: refit to version 5 aborted: 2 generation(s) still in flight")

    monkeypatch.setattr(grpo_async, "refit_step", aborted)
    run = _run()
    run.stack = SimpleNamespace(workers=SimpleNamespace(weight_versions=lambda: [4]))
    run.served_version = 4
    assert refit_tolerating_aborts(run, 5) == {"refit/aborted": 1.0}
    assert run.served_version == 4
    assert run.said == ["[step 5] refit aborted (vLLM worker 0: refit to version 5 aborted: 2 generation(s) still in "
                        "flight); the workers serve versions [4]"]


# -- the death path: dispatch halts on a death, a failure a death explains is named, teardown is bounded --


async def test_a_halted_producer_dispatches_nothing_and_a_step_it_cannot_finish_says_why():
    dead: dict[str, str] = {}
    ledger, script = PromptLedger(2, 3), Scripted()
    producer = RolloutProducer(ledger, script, end=8, halted=lambda: bool(dead))
    assert producer.fill() == 3
    dead["gate"] = "Gym server policy_model (pid 7) killed by SIGKILL"
    for p in (0, 1):
        script.release(p)
    head, groups = await producer.wait_head()
    producer.commit(1, head, groups)  # frees two slots: none is filled
    await asyncio.sleep(0)
    assert script.started == [(0, 0), (1, 0), (2, 0)] and ledger.in_flight == 1
    script.release(2)
    with pytest.raises(AsyncLoopError, match=r"step 2 waits for positions \[3\] but no group is running and "
                                             r"dispatching is halted \(a component died\)"):
        await producer.wait_head()


async def test_teardown_waits_for_cancelled_groups_up_to_its_deadline_and_reports_the_stuck_ones():
    release, entered = asyncio.Event(), []

    async def slow_cleanup(ticket):
        entered.append(ticket.position)
        try:
            await asyncio.Event().wait()
        finally:  # like the manager's retention after a cancel, bounded only by its own deadline
            if ticket.position == 1:
                await release.wait()
        raise AssertionError("unreachable")

    producer = RolloutProducer(PromptLedger(2, 2), slow_cleanup, end=2)
    producer.fill()
    await until(lambda: len(entered) == 2)  # both groups run (a task cancelled before it starts has no cleanup)
    running, unconsumed, stuck = await producer.aclose(deadline_s=0.05)
    assert [t.position for t in running] == [0, 1] and unconsumed == ()
    assert [t.key for t in stuck] == ["p1.g0"]
    assert producer.running_count == 1
    release.set()
    await until(lambda: producer.running_count == 0)


async def until(condition, timeout_s: float = 10.0) -> None:
    """Return once `condition()` holds, yielding to the loop between checks; fail after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not reached within {timeout_s} s"
        await asyncio.sleep(0.001)


class FakeWatch:
    def __init__(self, deaths):
        self.deaths, self.polls = deaths, 0

    async def poll(self):
        self.polls += 1

    def take_deaths(self):
        deaths, self.deaths = self.deaths, []
        return deaths

    def down(self):
        return {"tq_storage_unit_0": "TransferQueue storage_unit_0 (Ray actor) is gone"}

    def dead(self):
        return {d.name: d for d in self.deaths}


def _death_run(deaths):
    logged: list[tuple[int, dict]] = []
    run = _run()
    run.watch, run.pool = FakeWatch(deaths), None
    run.logger = SimpleNamespace(log=lambda step, metrics: logged.append((step, dict(metrics))))
    return run, logged


async def test_a_failure_a_death_explains_is_named_after_the_accounted_step_line():
    from nemo_rl.distributed.component_watch import ComponentDeath, Role

    death = ComponentDeath("tq_storage_unit_0", Role.ROLLOUT_PATH, "TransferQueue storage_unit_0 (Ray actor) is gone", 1.0)
    run, logged = _death_run([death])
    metrics = {"rollouts/dispatched": 8.0}
    error = RuntimeError("read failed")
    with pytest.raises(ComponentFailedError) as raised:
        await grpo_async._name_deaths(run, 4, metrics, "training", error)
    assert str(raised.value) == (
        "step 4: training failed (RuntimeError: read failed) and tq_storage_unit_0 died: TransferQueue storage_unit_0 "
        "(Ray actor) is gone; nothing of the step was trained. token_capture.on_component_failure=abort stops the "
        "run (resume from the last checkpoint)")
    assert raised.value.__cause__ is error and run.watch.polls == 1
    assert logged == [(4, {"rollouts/dispatched": 8.0, "component/deaths": 1.0, "component/down": 1.0,
                           "component/restarts": 0.0, "finalize/replaced_workers": 0.0})]
    # unaccounted (a group failed before the step's head was complete): named, no line
    run, logged = _death_run([death])
    with pytest.raises(ComponentFailedError, match="step 4: a rollout group failed"):
        await grpo_async._name_deaths(run, 4, {}, "a rollout group", error)
    assert logged == []


async def test_a_failure_no_death_explains_is_left_to_propagate_unchanged():
    run, logged = _death_run([])
    assert await grpo_async._name_deaths(run, 2, {"rollouts/dispatched": 8.0}, "training", RuntimeError("x")) is None
    assert logged == [] and run.watch.polls == 1


def test_dispatch_halts_once_the_watch_finds_any_death_and_says_so_once():
    from nemo_rl.distributed.component_watch import ComponentDeath, Role

    run, _ = _death_run([])
    halted = dispatch_halt(run)
    assert halted() is False and run.said == []
    run.watch.deaths = [ComponentDeath("finalizer_0", Role.OFF_PATH, "finalizer worker finalizer_0 (Ray actor) is gone", 1.0)]
    assert halted() is True and halted() is True
    assert run.said == ["[async] finalizer_0 died: no more groups are dispatched; the run stops at the step that "
                        "sees it (token_capture.on_component_failure=abort)"]


async def test_the_step_that_sees_a_death_names_those_found_one_round_later_with_it():
    from nemo_rl.distributed.component_watch import ComponentDeath, Role

    gate = ComponentDeath("gate", Role.ROLLOUT_PATH, "Gym server policy_model (pid 7) killed by SIGKILL", 1.0)
    unit = ComponentDeath("tq_storage_unit_0", Role.ROLLOUT_PATH, "TransferQueue storage_unit_0 (Ray actor) is gone", 2.0)
    run, logged = _death_run([gate])

    async def poll():  # the storage unit's death is found by the next round
        run.watch.deaths.append(unit)

    run.watch.poll = poll
    run.cfg.token_capture = SimpleNamespace(on_component_failure="abort")
    with pytest.raises(ComponentFailedError, match=r"^step 3: gate died: Gym server policy_model \(pid 7\) killed by "
                                                   r"SIGKILL; tq_storage_unit_0 died: TransferQueue storage_unit_0"):
        await grpo_async._check_deaths(run, 3, {"rollouts/dispatched": 8.0})
    assert [(step, m["component/deaths"]) for step, m in logged] == [(3, 2.0)]
