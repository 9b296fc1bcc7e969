"""The async GRPO loop: rollouts stay in flight while the trainer trains and refits.

`run_grpo_async` (what `run_grpo` runs when grpo.async_rollouts.enabled) shares one
`PromptLedger` between a `RolloutProducer`, which keeps up to `max_in_flight_groups` groups
running, and the trainer: step s waits for the ledger's head (the synchronous step s's prompts),
drops stale groups whole (re-queued, counted), trains, clears only its groups' train-partition
keys and refits while the producer keeps generating (the engine's refit gate holds the calls that
arrive during the swap; an aborted drain keeps the old weights and is counted).
Invariants: per step `rollouts/dispatched == kept + placeholders` over the step's groups; no
trained token is older than `max_trajectory_age_steps` or newer than the trainer's version (read
from the rows); every dispatched group is trained, dropped and re-run, or reported at exit.
A death (on_component_failure=abort) halts dispatching; the step that sees it is logged, then
`ComponentFailedError` names it, as it does any failure a death explains (`_name_deaths`).
See docs/design-docs/async-grpo.md and docs/guides/async-grpo.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_rl.algorithms.async_config import in_flight_limit
from nemo_rl.algorithms.errors import GRPOError, MaskedStepsError
from nemo_rl.algorithms.failed_rollouts import AllRolloutsFailedError
from nemo_rl.algorithms.grpo_checkpoint import DISPATCHED_PROMPTS_FILE, batch_digest, ledger_to_resume
from nemo_rl.algorithms.grpo_config import MasterConfig
from nemo_rl.algorithms.grpo_health import ComponentFailedError, check_abort, component_metrics, step_deaths
from nemo_rl.algorithms.grpo_single_controller import (
    engine_step_metrics,
    GRPORun,
    StepBatch,
    log_and_checkpoint,
    refit_step,
    start_run,
    train_groups,
    worker_call_metrics,
)
from nemo_rl.data.errors import error_name
from nemo_rl.data.rows import GroupResult, RowRef
from nemo_rl.data.train import KEY_SEPARATOR
from nemo_rl.data_plane.partitions import TrainRowCleaner
from nemo_rl.distributed.component_watch import ComponentKind, any_down
from nemo_rl.experience.prompt_queue import GroupTicket, PromptLedger
from nemo_rl.experience.staleness import age_histogram_metrics, split_fresh, trajectory_age_metrics
from nemo_rl.models.generation.vllm.errors import RefitAbortedWorkerError
from nemo_rl.token_capture.metrics import finalize_metrics, first_call_prompt_records
from nemo_rl.utils.logger import FIRST_CALL_PROMPTS_FILE, METRICS_FILE, Timer, append_jsonl


class AsyncLoopError(GRPOError):
    """The async loop cannot go on (a group task failed, or nothing is in flight for an incomplete step)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="async_loop")


# -- pure pieces ---------------------------------------------------------------------------------


def keys_of_rollouts(keys: Iterable[str], rollout_ids: Iterable[str]) -> list[str]:
    """The train-partition keys (`<rollout id>#<chain>`) that belong to `rollout_ids`, in order."""
    ours = set(rollout_ids)
    return [key for key in keys if key.rpartition(KEY_SEPARATOR)[0] in ours]


def group_row_keys(groups: Iterable[GroupResult]) -> list[str]:
    """The train-partition keys the groups' kept rows name (RowRefs only; TrainRows have none)."""
    return [row.key for group in groups for row in group.rows if isinstance(row, RowRef)]


def dispatch_record(ticket: GroupTicket, row: Mapping[str, Any], launch_step: int) -> dict[str, Any]:
    """One line of `dispatched_prompts.jsonl` per dispatch: the prompt's sync slot, position, generation."""
    return {"step": ticket.sync_step, "group": ticket.group_index, "digest": batch_digest([dict(row)]),
            "position": ticket.position, "generation": ticket.generation, "dispatched_during_step": launch_step}


# -- the producer --------------------------------------------------------------------------------


class RolloutProducer:
    """Keeps the ledger's in-flight cap filled with group tasks (positions below `end` only).

    A group that comes back is finished in the ledger and more are dispatched at once; a group task
    that raises stops dispatching and the error reaches the trainer at its next wait. `halted()`
    (a component died: the run stops at the step that sees it) stops dispatching too, so no group
    is started that could never train. Not thread-safe: the driver's event loop owns it (and the ledger)."""

    def __init__(self, ledger: PromptLedger, run_group: Callable[[GroupTicket], Awaitable[GroupResult]], end: int,
                 halted: Callable[[], bool] = lambda: False) -> None:
        self.ledger = ledger
        self._run_group = run_group
        self._end = end
        self._halted = halted
        self._results: dict[GroupTicket, GroupResult] = {}
        self._tasks: dict[GroupTicket, asyncio.Task] = {}
        self._changed = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def running_count(self) -> int:
        """Groups running now (a plain count: safe to read from another thread, unlike the tickets)."""
        return len(self._tasks)

    def fill(self) -> int:
        """Dispatch while the cap allows and positions below `end` remain; returns how many."""
        started = 0
        while (self._error is None and not self._halted() and self.ledger.can_dispatch()
               and self.ledger.next_position < self._end):
            ticket = self.ledger.dispatch()
            self._tasks[ticket] = asyncio.create_task(self._one(ticket), name=f"rollout-group-{ticket.key}")
            started += 1
        return started

    async def _one(self, ticket: GroupTicket) -> None:
        try:
            group = await self._run_group(ticket)
            self._results[ticket] = group
            self.ledger.finish(ticket)
        except Exception as error:  # noqa: BLE001 - handed to the trainer, which raises it at its next wait
            self._error = self._error or error
        finally:  # a cancelled group (teardown) leaves here too; the manager accounted it as aborted
            self._tasks.pop(ticket, None)
        self._changed.set()
        self.fill()

    async def wait_head(self) -> tuple[tuple[GroupTicket, ...], list[GroupResult]]:
        """The next step's tickets and groups, once every one of them is finished."""
        while True:
            if self._error is not None:
                raise AsyncLoopError(f"a rollout group failed: {error_name(self._error)}: {self._error}") from self._error
            self.fill()
            head = self.ledger.head()
            if head is not None:
                return head, [self._results[t] for t in head]
            if not self._tasks:
                why = "dispatching is halted (a component died)" if self._halted() else "none can be dispatched"
                raise AsyncLoopError(
                    f"step {self.ledger.step + 1} waits for positions {list(self.ledger.waiting_for())} but no group "
                    f"is running and {why} (end={self._end}, in flight {self.ledger.in_flight})"
                )
            self._changed.clear()
            await self._changed.wait()

    def drop(self, ticket: GroupTicket) -> GroupResult:
        """Drop a stale finished group (its prompt is re-queued and re-dispatched first); returns its result."""
        self.ledger.drop_stale(ticket)
        group = self._results.pop(ticket)
        self.fill()
        return group

    def commit(self, step: int, head: Sequence[GroupTicket], groups: Sequence[GroupResult]) -> None:
        """The step consumed `head` (groups with no kept rollout as failed); dispatch what that frees."""
        self.ledger.commit_step(step, head, failed=[t for t, g in zip(head, groups) if not g.kept])
        for ticket in head:
            del self._results[ticket]
        self.fill()

    async def aclose(self, deadline_s: float) -> tuple[tuple[GroupTicket, ...], tuple[GroupTicket, ...],
                                                     tuple[GroupTicket, ...]]:
        """Stop dispatching, cancel every running group (the manager accounts each as aborted) and wait
        up to `deadline_s` for their cleanup (retention, bounded by its own deadline); returns (the
        tickets that were running, the finished ones never consumed, those still cleaning up at the
        deadline: left to the teardown, which stops what they wait on)."""
        self._error = self._error or AsyncLoopError("the producer was closed")  # no dispatch from here on
        running, tasks = tuple(self._tasks), dict(self._tasks)
        for task in tasks.values():
            task.cancel()
        if tasks:
            await asyncio.wait(tasks.values(), timeout=deadline_s)
        stuck = tuple(ticket for ticket, task in tasks.items() if not task.done())
        return running, tuple(self._results), stuck


# -- the trainer's step --------------------------------------------------------------------------


@dataclass
class TrainerClock:
    """The trainer's weight version (the policy's; engines may lag during or after a refit)."""

    version: int


def clear_step_train_rows(cleaner: TrainRowCleaner, plan_keys: Sequence[str], rollout_ids: Sequence[str],
                          dropped_keys: Sequence[str]) -> dict[str, float]:
    """Clear the step's trained keys and every other key of its (and its dropped groups') rollouts.

    Keys of other rollouts are groups still in flight: they stay (`retention/train_keys_in_flight`)."""
    cleaner.clear(list(plan_keys))
    left = cleaner.remaining()
    ours = keys_of_rollouts(left, rollout_ids)
    cleaner.clear(ours)
    after = cleaner.remaining() if ours else left
    dropped = set(dropped_keys)
    return {
        "retention/train_keys_cleared": float(len(plan_keys) + len(ours)),
        "retention/train_keys_stray": float(sum(1 for key in ours if key not in dropped)),
        "retention/train_keys_dropped_stale": float(sum(1 for key in ours if key in dropped)),
        "retention/train_keys_remaining": float(len(keys_of_rollouts(after, rollout_ids))),
        "retention/train_keys_in_flight": float(len(after) - len(keys_of_rollouts(after, rollout_ids))),
    }


def refit_tolerating_aborts(run: GRPORun, step: int) -> dict[str, float]:
    """`refit_step`; a refit a worker aborted (drain past its deadline) keeps the engines' versions as
    they report them: their groups age, and the freshness rule drops what gets too old."""
    try:
        return refit_step(run, step)
    except RefitAbortedWorkerError as error:
        assert run.stack.workers is not None
        versions = run.stack.workers.weight_versions()
        run.served_version = min(versions)
        run.progress(f"[step {step}] refit aborted ({error}); the workers serve versions {versions}")
        return {"refit/aborted": 1.0}


async def gather_step(run: GRPORun, producer: RolloutProducer, step: int, trainer: TrainerClock,
                      metrics: dict[str, float], clock: Callable[[], float] = time.monotonic,
                      ) -> tuple[list[GroupResult], list[GroupResult]]:
    """Wait for step `step`'s groups, dropping stale ones until all are fresh; commit; (groups, dropped).

    `clock` times the waits (`async/trainer_wait_s`); a test injects one to read the wait exactly."""
    max_age = run.cfg.grpo.async_rollouts.max_trajectory_age_steps
    waited, dropped = 0.0, []
    producer.fill()
    if producer.ledger.head() is None:  # the trainer idles from here: say on what (a chaos test's cue too)
        run.progress(f"[step {step}] waiting for its groups ({producer.running_count} group(s) running)")
    while True:
        t0 = clock()
        head, groups = await producer.wait_head()
        waited += clock() - t0
        _, stale = split_fresh(groups, trainer.version, max_age)  # raises on a future version
        if not stale:
            break
        stale_ids = {id(g) for g in stale}
        for ticket, group in zip(head, groups):
            if id(group) in stale_ids:
                dropped.append(producer.drop(ticket))
                run.progress(f"[step {step}] dropped stale group {ticket.key} (sync step {ticket.sync_step} group "
                             f"{ticket.group_index}): tokens older than version {trainer.version - max_age}; re-queued")
    producer.commit(step, head, groups)
    metrics["async/trainer_wait_s"] = waited
    metrics["async/dropped_stale_rollouts"] = float(sum(g.n for g in dropped))
    metrics["async/trainer_version"] = float(trainer.version)
    metrics.update(producer.ledger.take_step_metrics())
    metrics.update(trajectory_age_metrics(groups, trainer.version))
    metrics.update(age_histogram_metrics(groups, trainer.version, max_age))
    return groups, dropped


async def _name_deaths(run: GRPORun, step: int, metrics: dict[str, float], what: str, error: BaseException) -> None:
    """After `what` of step `step` failed with `error`: one liveness round now; a death it finds is named
    (ComponentFailedError from `error`, after the step's line when its accounting is complete), never
    the failure's raw traceback. With no death, returns and the caller re-raises `error` unchanged."""
    if run.watch is None:
        return
    await run.watch.poll()
    deaths = step_deaths(run.watch, run.pool, run.progress)
    if not deaths:
        return
    metrics.update(component_metrics(deaths, run.watch.down(), 0, 0))
    if "rollouts/dispatched" in metrics:  # the step was accounted: its line is kept
        run.logger.log(step, metrics)
    named = "; ".join(f"{name} died: {detail}" for name, detail in sorted(deaths.items()))
    trained = "the step was trained" if "train/num_samples" in metrics else "nothing of the step was trained"
    raise ComponentFailedError(
        f"step {step}: {what} failed ({error_name(error)}: {str(error)[:200]}) and {named}; {trained}. "
        "token_capture.on_component_failure=abort stops the run (resume from the last checkpoint)"
    ) from error


async def _check_deaths(run: GRPORun, step: int, metrics: dict[str, float]) -> None:
    """Deaths since the last step are named; with `abort` the step's line is logged and the run stops.

    Before stopping, one more liveness round: components that died together (a node, say) but were
    found a round apart are named together, in the step that saw the first."""
    if run.watch is None:
        return
    deaths = step_deaths(run.watch, run.pool, run.progress)
    if deaths:
        await run.watch.poll()
        deaths.update(step_deaths(run.watch, run.pool, run.progress))
    metrics.update(component_metrics(deaths, run.watch.down(), 0, 0))
    if deaths:
        run.logger.log(step, metrics)  # the step that stops the run keeps its accounting line
        check_abort(run.cfg.token_capture.on_component_failure, deaths, step)


async def async_step(run: GRPORun, producer: RolloutProducer, step: int, trainer: TrainerClock,
                     metrics: dict[str, float]) -> None:
    """One trainer step: gather (dropping stale groups), account, train, clear its keys, refit."""
    cfg = run.cfg
    if run.finalizer is not None:
        run.finalizer.seconds = 0.0
    try:
        groups, dropped = await gather_step(run, producer, step, trainer, metrics)
    except AsyncLoopError as error:  # a group failed: a death that explains it is named, not the group's error
        await _name_deaths(run, step, metrics, "a rollout group", error)
        raise
    if run.watch is not None:
        await run.watch.poll()  # a death at the very end of the wait is named in this step
    metrics["timing/finalize_s"] = run.finalizer.seconds if run.finalizer is not None else 0.0
    counters = run.manager.take_step_counters()
    metrics.update(finalize_metrics(groups, counters.queue_waits_ms))
    metrics.update(counters.metrics(retention=run.cleaner is not None))
    if metrics["rollouts/dispatched"] != metrics["finalize/kept_rollouts"] + metrics["finalize/placeholders"]:
        raise GRPOError(f"step {step}: always-N accounting broke: {metrics}", kind="accounting")
    await _check_deaths(run, step, metrics)
    if cfg.logger.dump_first_call_prompt_ids:
        append_jsonl(Path(cfg.logger.log_dir) / FIRST_CALL_PROMPTS_FILE, first_call_prompt_records(step, groups))
    ids = [e.rollout_id for g in (*groups, *dropped) for e in g.entries]
    cleaner, dropped_keys = run.train_cleaner, group_row_keys(dropped)

    def clear(batch: StepBatch) -> dict[str, float]:
        assert cleaner is not None  # train_groups clears only with a train partition
        return clear_step_train_rows(cleaner, batch.train_keys, ids, dropped_keys)

    def refit(run: GRPORun, step: int) -> dict[str, float]:
        running = producer.running_count  # read on the refit's thread
        return {**refit_tolerating_aborts(run, step), "async/groups_running_at_refit": float(running)}

    try:
        trained = await train_groups(run, step, groups, metrics, clear, refit)
    except (ComponentFailedError, MaskedStepsError, AllRolloutsFailedError):
        raise  # already named
    except Exception as error:  # noqa: BLE001 - re-raised unchanged unless a death explains it
        # A component that died after this step's check (the data plane under the train read, say).
        await _name_deaths(run, step, metrics, "training", error)
        raise
    if trained:
        trainer.version = step  # the policy holds the weights of step `step`, refit or not


async def _worker_facts(run: GRPORun) -> list[dict]:
    assert run.stack.workers is not None
    return await asyncio.to_thread(run.stack.workers.capture_stats)


def ledger_for(run: GRPORun) -> PromptLedger:
    """The run's ledger: fresh, or the resumed checkpoint's (`ledger_to_resume`: its prompts in flight
    are re-dispatched first, under new generations); says what it restored."""
    grpo, state = run.cfg.grpo, run.resumed_from
    p = grpo.num_prompts_per_step
    ledger = ledger_to_resume(state, p, in_flight_limit(grpo.async_rollouts, p))
    snapshot = state.prompt_ledger if state is not None else None
    if state is not None and snapshot is None:
        run.progress(f"[async] the checkpoint of step {state.step} holds no prompt ledger (format {state.format}, the "
                     f"synchronous loop's: nothing was in flight); drawing from position {ledger.next_position}")
    elif snapshot is not None:
        run.progress(f"[async] restored the prompt ledger of step {snapshot.step}: positions {list(ledger.queued)} are "
                     f"dispatched first (in flight at the checkpoint, as position.new generation: "
                     f"{[f'p{p.position}.g{p.generations}' for p in snapshot.in_flight]}), then new draws from "
                     f"{snapshot.next_draw}")
    return ledger


class StepRows:
    """The prompt rows of each synchronous step, built once per step rather than once per group.

    `row(ticket, committed)` first forgets every step `<= committed` (the trainer consumed it: the
    ledger never issues a ticket of a consumed step again, and one that comes anyway is an
    `AsyncLoopError`), so the cache holds only steps with positions in flight: at most
    `max_in_flight_groups // P + 1` of them. Rows are the prompt source's own (pure in seed, step)."""

    def __init__(self, build: Callable[[int], Sequence[Mapping[str, Any]]]) -> None:
        self._build = build
        self._rows: dict[int, Sequence[Mapping[str, Any]]] = {}

    @property
    def cached_steps(self) -> tuple[int, ...]:
        return tuple(sorted(self._rows))

    def row(self, ticket: GroupTicket, committed: int) -> Mapping[str, Any]:
        """The ticket's prompt row; `committed` is the ledger's last consumed step."""
        if ticket.sync_step <= committed:
            raise AsyncLoopError(f"ticket {ticket.key} is of step {ticket.sync_step}, already consumed (step {committed})")
        for step in [s for s in self._rows if s <= committed]:
            del self._rows[step]
        if ticket.sync_step not in self._rows:
            self._rows[ticket.sync_step] = self._build(ticket.sync_step)
        return self._rows[ticket.sync_step][ticket.group_index]


def group_runner(run: GRPORun, ledger: PromptLedger) -> Callable[[GroupTicket], Awaitable[GroupResult]]:
    """Runs one ticket's group: its prompt row (`StepRows`), a dispatch record, the manager under the ticket's ids."""
    cfg = run.cfg
    p, n = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    log = Path(cfg.logger.log_dir) / DISPATCHED_PROMPTS_FILE
    rows = StepRows(lambda step: run.prompts.batch(step, p))

    async def run_ticket(ticket: GroupTicket) -> GroupResult:
        row = rows.row(ticket, ledger.step)
        append_jsonl(log, [dispatch_record(ticket, row, ledger.step + 1)])
        return await run.manager.run_group_as(ticket.group_index, ticket.rollout_ids(run.manager.run_id, n), row)

    return run_ticket


def dispatch_halt(run: GRPORun) -> Callable[[], bool]:
    """The producer's halt: true once the watch found any component dead (under `abort`, the only policy
    async runs, the run stops at the step that sees it, so a group dispatched now could never train)."""
    said = False

    def halted() -> bool:
        nonlocal said
        dead = run.watch.dead() if run.watch is not None else {}
        if dead and not said:
            said = True
            run.progress(f"[async] {', '.join(sorted(dead))} died: no more groups are dispatched; the run stops "
                         "at the step that sees it (token_capture.on_component_failure=abort)")
        return bool(dead)

    return halted


def teardown_deadline_s(cfg: MasterConfig) -> float:
    """How long the exit waits for cancelled groups' cleanup: their retention, bounded by stage_timeout_s
    per job, plus a margin for the event loop (a group still cleaning up after it is reported)."""
    return 2.0 * cfg.token_capture.stage_timeout_s + 5.0


async def run_grpo_async(cfg: MasterConfig, progress=print) -> Path:
    """The async loop (see the module docstring); returns the metrics.jsonl path. Stops everything on exit."""
    run = await start_run(cfg, progress)
    if run is None:
        return Path(cfg.logger.log_dir) / METRICS_FILE
    ledger = ledger_for(run)
    producer = RolloutProducer(ledger, group_runner(run, ledger), cfg.grpo.max_num_steps * cfg.grpo.num_prompts_per_step,
                               halted=dispatch_halt(run))
    trainer = TrainerClock(run.served_version)
    progress(f"[async] max_in_flight_groups={ledger.max_in_flight}, max_trajectory_age_steps="
             f"{cfg.grpo.async_rollouts.max_trajectory_age_steps}, trainer at weight version {trainer.version}")
    watching = run.watch.watching() if run.watch is not None else contextlib.nullcontext()
    try:
        async with watching:
            facts = await _worker_facts(run)
            producer.fill()
            for step in range(run.start_step, cfg.grpo.max_num_steps + 1):
                metrics: dict[str, float] = dict(run.resume_metrics) if step == run.start_step else {}
                with Timer("step_s", metrics):
                    await async_step(run, producer, step, trainer, metrics)
                    worker_down = run.watch is not None and any_down(run.watch.down(), ComponentKind.VLLM_WORKER)
                    try:
                        now = None if worker_down else await _worker_facts(run)  # a dead worker has no counter
                    except Exception as error:  # noqa: BLE001 - re-raised unchanged unless a death explains it
                        await _name_deaths(run, step, metrics, "reading the workers' counters", error)
                        raise
                if now is not None:
                    metrics.update(worker_call_metrics([f["served_calls"] for f in facts],
                                                       [f["served_calls"] for f in now]))
                    metrics.update(engine_step_metrics([f["engine_timing"] for f in facts],
                                                       [f["engine_timing"] for f in now]))
                    facts = now
                await log_and_checkpoint(run, step, metrics, trainer.version, ledger)
        return run.logger.metrics_path
    finally:
        try:
            running, unconsumed, stuck = await producer.aclose(teardown_deadline_s(cfg))
            if running or unconsumed:
                progress(f"[async] stopped with {len(running)} group(s) running ({', '.join(t.key for t in running)}; "
                         f"cancelled, accounted as aborted) and {len(unconsumed)} finished but not trained "
                         f"({', '.join(t.key for t in unconsumed)}): none of their rollouts was trained")
            if stuck:
                progress(f"[async] {len(stuck)} cancelled group(s) still cleaning up after {teardown_deadline_s(cfg)}s "
                         f"({', '.join(t.key for t in stuck)}): left to the teardown")
        finally:
            await run.aclose()  # the teardown joins processes and Ray actors: off the event loop
