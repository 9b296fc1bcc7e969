"""Single-controller GRPO on Ray, training on exactly the tokens the policy sampled.

Owns the loop: `rollout_step` (dispatch + accounting), `train_step` and `refit_step`, each
returning its metrics; `run_grpo` strings them together over the `GRPORun` that
`nemo_rl.algorithms.setup.setup` started, and stops everything on exit.
Invariants: every step `rollouts/dispatched == finalize/kept_rollouts + finalize/placeholders`;
only generated tokens of kept rollouts are in the loss; the rows of step k+1 carry the weight
version every worker reported after step k's refit. A step with nothing to train is skipped and
counted; too many in a row raise `MaskedStepsError`; one whose every rollout failed in the agent
harness raises `AllRolloutsFailedError` at once (`failed_rollouts`). Component deaths follow
`token_capture.on_component_failure` (`grpo_health`); checkpoints are `grpo_checkpoint`'s.
See docs/design-docs/token-capture-receipts.md, "One step of the loop".
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_rl.algorithms.errors import GRPOError, MaskedStepsError
from nemo_rl.algorithms.grpo import ClippedPGLossFn, compute_group_advantages
from nemo_rl.algorithms.grpo_checkpoint import (
    DISPATCHED_PROMPTS_FILE,
    POLICY_SUBDIR,
    TrainerState,
    batch_digest,
    prepare_checkpointing,
    prompt_records,
    write_trainer_state,
)
from nemo_rl.algorithms.failed_rollouts import check_harness_failures, harness_failure_counts
from nemo_rl.algorithms.grpo_config import MasterConfig
from nemo_rl.algorithms.grpo_health import (
    check_abort,
    component_metrics,
    recover,
    refit_deaths,
    refit_failure_error,
    step_deaths,
    unrecoverable,
    untrainable,
)
from nemo_rl.data.rows import GroupResult, KeptRollout, RowRef, TrainRow
from nemo_rl.data.train import TrainBatch, TrainPlan, batch_routes
from nemo_rl.data_plane.partitions import TrainRowCleaner
from nemo_rl.algorithms.refit import refit_to
from nemo_rl.algorithms.setup import GRPORun, setup
from nemo_rl.distributed.component_watch import DATA_PLANE_KINDS, ComponentKind, any_down
from nemo_rl.experience.prompt_queue import LedgerSnapshot, PromptLedger
from nemo_rl.experience.rollout_manager import component_failure_detail
from nemo_rl.models.generation.vllm.errors import WorkerError, WorkerFailedError
from nemo_rl.token_capture.metrics import finalize_metrics, first_call_prompt_records
from nemo_rl.utils.aio import gather_cancelling
from nemo_rl.utils.checkpoint import capture_rng_states, commit_checkpoint, prune_checkpoints, should_save
from nemo_rl.utils.logger import FIRST_CALL_PROMPTS_FILE, METRICS_FILE, Timer, append_jsonl


@dataclass(frozen=True)
class StepBatch:
    """What one step trains: legacy rows as the driver's `TrainBatch`, capture rows as a `TrainPlan`
    naming their keys in the train partition (the policy worker reads them there); None: nothing."""

    rows: TrainBatch | TrainPlan | None
    rewards_mean: float

    @property
    def trainable(self) -> bool:
        return self.rows is not None

    @property
    def train_keys(self) -> tuple[str, ...]:
        """The train-partition keys this step trains on (none for legacy rows)."""
        return self.rows.keys if isinstance(self.rows, TrainPlan) else ()


def build_train_batch(groups: Sequence[GroupResult], normalize: bool, train_partition: str) -> StepBatch:
    """Advantages per group over kept rollouts; each of a rollout's rows gets its rollout's advantage.

    Placeholders are accounted but never trained. Normalising per rollout (not per row) keeps a
    rollout that branched into several rows from weighing more in its group's statistics.
    `TrainRow`s (legacy) become a `TrainBatch`; `RowRef`s (capture: their payload in
    `train_partition`) a `TrainPlan` in the same row order. A step holds one kind or the other.
    """
    rows: list[TrainRow] = []
    refs: list[RowRef] = []
    row_advs: list[float] = []
    ref_advs: list[float] = []
    all_rewards: list[float] = []
    for group in groups:
        entries = list(group.entries)
        valid = [isinstance(e, KeptRollout) for e in entries]
        rewards = [float(e.reward) if isinstance(e, KeptRollout) else 0.0 for e in entries]
        all_rewards += rewards
        advantages = compute_group_advantages(rewards, len(entries), normalize, valid)
        for entry, adv in zip(entries, advantages):
            if not isinstance(entry, KeptRollout):
                continue
            for row in entry.rows:
                if isinstance(row, RowRef):
                    refs.append(row)
                    ref_advs.append(adv)
                else:
                    rows.append(row)
                    row_advs.append(adv)
    if refs and rows:
        raise GRPOError(f"a step holds {len(rows)} TrainRows and {len(refs)} RowRefs; capture rows travel only "
                        "through the train partition and legacy rows only whole", kind="batch")
    rewards_mean = sum(all_rewards) / max(1, len(all_rewards))
    if refs:
        return StepBatch(TrainPlan.of(train_partition, refs, ref_advs), rewards_mean)
    if rows:
        return StepBatch(TrainBatch(
            token_ids=[row.token_ids for row in rows], token_mask=[row.token_mask for row in rows],
            generation_logprobs=[row.generation_logprobs for row in rows], advantages=row_advs,
            routed_experts=batch_routes([row.routed_experts for row in rows], [len(row.token_ids) for row in rows]),
        ), rewards_mean)
    return StepBatch(None, rewards_mean)


async def _reported(run, step: int, total: int, progress) -> GroupResult:
    group = await run
    progress(
        f"[step {step}] group {group.group_index + 1}/{total}: {len(group.rows)} rows, "
        f"{len(group.placeholders)} placeholders"
        + "".join(f" [{p.reason.value}: {p.detail[:120]}]" for p in group.placeholders)
    )
    return group


def worker_call_metrics(before: Sequence[int], after: Sequence[int]) -> dict[str, float]:
    """`generation/worker_<i>/calls`: completions worker i produced during the step (its own counter)."""
    if len(before) != len(after):
        raise GRPOError(f"worker count changed during the step: {len(before)} -> {len(after)}", kind="worker_metrics")
    return {f"generation/worker_{i}/calls": float(b - a) for i, (a, b) in enumerate(zip(before, after))}


def next_masked_streak(streak: int, trainable: bool, limit: int, step: int) -> int:
    """The count of consecutive steps with nothing to train; raises MaskedStepsError at `limit`."""
    streak = 0 if trainable else streak + 1
    if streak >= limit:
        raise MaskedStepsError(
            f"step {step}: {streak} consecutive steps had no trainable rollout "
            f"(token_capture.max_consecutive_masked_steps={limit}); see finalize/placeholders/<reason> in "
            "metrics.jsonl and the Gym/worker logs under the log dir"
        )
    return streak


def check_row_versions(groups: Sequence[GroupResult], served_version: int, step: int) -> None:
    """Every call of every row must carry the version the loop last refit into the workers."""
    stale = sorted({
        version for group in groups for row in group.rows for version in row.weight_versions
        if version is not None and version != served_version
    })
    if stale:
        raise GRPOError(
            f"step {step}: rows carry weight versions {stale} but every worker was refit to version "
            f"{served_version}; a worker served stale (or future) weights",
            kind="stale_weights",
        )


def save_checkpoint(run: GRPORun, step: int, weight_version: int | None = None,
                    prompt_ledger: LedgerSnapshot | None = None) -> Path:
    """Write `step_<step>` atomically (policy, optimizer, TrainerState), then prune beyond keep_last.

    `weight_version`: the version of the policy's weights (None: the served one, as the synchronous
    loop's every worker serves what the policy holds). `prompt_ledger`: the async loop's snapshot
    (a format-2 TrainerState); None writes format 1, as the synchronous loop always does."""
    ckpt, grpo = run.cfg.checkpointing, run.cfg.grpo
    version = run.served_version if weight_version is None else weight_version
    assert ckpt.checkpoint_dir is not None  # CheckpointingConfig requires it when enabled
    root = Path(ckpt.checkpoint_dir)
    t0 = time.monotonic()

    def write(folder: Path) -> None:
        info = run.policy.save_state(folder / POLICY_SUBDIR)
        write_trainer_state(folder, TrainerState(
            step=step, weight_version=version, masked_streak=run.masked_streak, seed=grpo.seed,
            num_prompts_per_step=grpo.num_prompts_per_step,
            prompt_batch_digest=batch_digest(run.prompts.batch(step, grpo.num_prompts_per_step)),
            policy_fingerprint=info.policy_fingerprint, optimizer_fingerprint=info.optimizer_fingerprint,
            policy_steps_taken=info.steps_taken, engine_probe=tuple(run.previous_engine_probe),
            rng=capture_rng_states(), format=1 if prompt_ledger is None else 2, prompt_ledger=prompt_ledger,
        ))

    path = commit_checkpoint(root, step, write)
    pruned = prune_checkpoints(root, ckpt.keep_last)
    in_flight = "" if prompt_ledger is None else (
        f", prompts in flight {[p.position for p in prompt_ledger.in_flight]}, drawn up to {prompt_ledger.next_draw}")
    run.progress(
        f"[checkpoint] step {step} saved to {path} in {time.monotonic() - t0:.1f}s (weight version {version}{in_flight})"
        + (f"; removed steps {pruned} (checkpointing.keep_last={ckpt.keep_last})" if pruned else "")
    )
    return path


async def rollout_step(run: GRPORun, step: int) -> tuple[list[GroupResult], dict[str, float]]:
    """Dispatch this step's groups and account every rollout; returns the groups and their metrics."""
    cfg, n = run.cfg, run.cfg.grpo.num_generations_per_prompt
    metrics: dict[str, float] = {}
    if run.finalizer is not None:
        run.finalizer.seconds = 0.0
    restarts = 0
    if run.watch is not None and cfg.token_capture.on_component_failure == "continue":
        restarts = await recover(run.stack, run.watch, run.pool, run.progress)
    replaced_before = run.pool.replacements if run.pool is not None else 0
    rows = run.prompts.batch(step, cfg.grpo.num_prompts_per_step)
    append_jsonl(Path(cfg.logger.log_dir) / DISPATCHED_PROMPTS_FILE, prompt_records(step, rows))
    run.progress(f"[step {step}] dispatching {len(rows)} groups x {n} rollouts")
    watching = run.watch.watching() if run.watch is not None else contextlib.nullcontext()
    with Timer("generation_s", metrics):
        async with watching:
            # A failing group (a bug, a failed worker) cancels its siblings, whose accounting and
            # retention finish before the error reaches teardown.
            groups = await gather_cancelling(
                _reported(run.manager.run_group(step, g, row, n), step, len(rows), run.progress)
                for g, row in enumerate(rows)
            )
    metrics["timing/finalize_s"] = run.finalizer.seconds if run.finalizer is not None else 0.0
    if run.watch is not None:  # a death at the very end of the rollouts, before its round, is named too
        await run.watch.poll()
    down = _down(run)
    if not any_down(down, ComponentKind.VLLM_WORKER):  # a dead worker has no counter to read
        calls_now = await asyncio.to_thread(run.stack.workers.served_calls)
        metrics.update(worker_call_metrics(run.worker_calls, calls_now))
        run.worker_calls = calls_now
    if run.watch is not None:
        run.step_component_deaths = step_deaths(run.watch, run.pool, run.progress)
        replaced = run.pool.replacements - replaced_before if run.pool is not None else 0
        metrics.update(component_metrics(run.step_component_deaths, down, restarts, replaced))
        if cfg.token_capture.on_component_failure == "continue":
            groups = untrainable(groups, unrecoverable(run.stack, down))
    counters = run.manager.take_step_counters()
    metrics.update(finalize_metrics(groups, counters.queue_waits_ms))
    metrics.update(counters.metrics(retention=run.cleaner is not None))
    if run.cleaner is not None:
        if not any_down(down, *DATA_PLANE_KINDS):  # a dead data plane cannot list its keys
            metrics["retention/staged_keys_remaining"] = float(await asyncio.to_thread(run.cleaner.remaining))
        metrics["retention/ledger_files_remaining"] = float(run.stack.env.ledger_file_count())
    if metrics["rollouts/dispatched"] != metrics["finalize/kept_rollouts"] + metrics["finalize/placeholders"]:
        raise GRPOError(f"step {step}: always-N accounting broke: {metrics}", kind="accounting")
    check_row_versions(groups, run.served_version, step)
    if cfg.logger.dump_first_call_prompt_ids:
        append_jsonl(Path(cfg.logger.log_dir) / FIRST_CALL_PROMPTS_FILE, first_call_prompt_records(step, groups))
    return groups, metrics


def train_step(run: GRPORun, step: int, step_batch: StepBatch) -> dict[str, float]:
    """One GRPO step on the policy worker; returns train/* and the generation-mismatch metrics."""
    metrics: dict[str, float] = {}
    with Timer("train_s", metrics):
        loss_fn = ClippedPGLossFn.from_config(run.cfg.loss_fn)
        rows = step_batch.rows
        if isinstance(rows, TrainPlan):
            run.progress(f"[step {step}] training on {rows.num_samples} rows read from the train partition")
            train = run.policy.train_planned(rows, loss_fn)
        else:
            assert rows is not None  # the loop trains trainable steps only
            run.progress(f"[step {step}] training on {rows.num_samples} rows")
            train = run.policy.train_step(rows, loss_fn)
    metrics.update({f"train/{k}": v for k, v in train.items() if k not in ("token_mult_prob_error", "gen_kl_error")})
    metrics["token_mult_prob_error"] = train["token_mult_prob_error"]
    metrics["gen_kl_error"] = train["gen_kl_error"]
    return metrics


def clear_train_rows(cleaner: TrainRowCleaner, trained_keys: Sequence[str]) -> dict[str, float]:
    """Clear the step's trained keys, then any key the step left (rows of rollouts masked after they
    were judged); between steps no rollout is in flight, so every key left is this step's."""
    trained = list(trained_keys)
    cleaner.clear(trained)
    stray = cleaner.remaining()
    cleaner.clear(stray)
    return {
        "retention/train_keys_cleared": float(len(trained) + len(stray)),
        "retention/train_keys_stray": float(len(stray)),
        "retention/train_keys_remaining": float(len(cleaner.remaining()) if stray else 0),
    }


def refit_step(run: GRPORun, step: int) -> dict[str, float]:
    """Refit every worker to version `step`, then prove it with the probe; returns refit/* metrics."""
    metrics: dict[str, float] = {}
    with Timer("refit_s", metrics):
        refit = refit_to(run.policy, run.stack.workers, run.weights_root / f"step_{step}", step, run.probe,
                         context=f"step {step}: refit to version {step}")
        shutil.rmtree(run.weights_root / f"step_{step - 1}", ignore_errors=True)
    run.served_version = refit.version
    metrics["refit/engine_trainer_max_abs_diff"] = refit.engine_trainer_max_abs_diff
    metrics["refit/engine_logprob_change"] = max(abs(a - b) for a, b in zip(refit.engine_probe, run.previous_engine_probe))
    run.previous_engine_probe = list(refit.engine_probe)
    return metrics


async def refit_or_name_deaths(run: GRPORun, step: int, metrics: dict[str, float],
                               refit: Callable[[GRPORun, int], dict[str, float]] = refit_step) -> dict[str, float]:
    """`refit` (`refit_step`), or, when it fails because a component died after the rollouts, that death named.

    `abort`: the step's metrics line is logged, then `ComponentFailedError` names the dead
    components (never the refit's raw traceback). `continue`: the refit is skipped
    (`refit/skipped` 1, the engines keep the previous version) and the following steps are masked
    while the component stays dead. A refit failure with every component alive propagates.
    """
    try:
        return await asyncio.to_thread(refit, run, step)
    # A failed worker (fatal) and a failed refit call (recoverable) alike: the watch says whether a
    # death explains it; if none does, it propagates unchanged.
    except (WorkerError, WorkerFailedError) as error:
        down = await refit_deaths(run.watch)
        if not down:
            raise
        deaths = step_deaths(run.watch, run.pool, run.progress) if run.watch is not None else {}
        metrics["component/deaths"] = metrics.get("component/deaths", 0.0) + float(len(deaths))
        metrics["component/down"] = float(len(down))
        if run.cfg.token_capture.on_component_failure == "abort":
            run.logger.log(step, metrics)  # the step that stops the run keeps its line
            raise refit_failure_error(down, step) from error
        run.progress(
            f"[step {step}] refit skipped: {component_failure_detail(down)}; the engines keep weight version "
            f"{run.served_version} and the next steps are masked while it stays dead "
            "(token_capture.on_component_failure=continue)"
        )
        return {"refit/skipped": 1.0}


def _down(run: GRPORun) -> dict[str, str]:
    return run.watch.down() if run.watch is not None else {}


def _report_masked(run: GRPORun, step: int, metrics: dict[str, float]) -> None:
    limit = run.cfg.token_capture.max_consecutive_masked_steps
    down = _down(run)
    run.progress(
        f"[step {step}] WARNING: every rollout became a placeholder; step skipped (no train, no refit), "
        f"{run.masked_streak + 1}/{limit} in a row. Reasons: "
        + ", ".join(f"{k.rsplit('/', 1)[-1]}={int(v)}" for k, v in metrics.items() if k.startswith("finalize/placeholders/"))
        + (f". Down: {component_failure_detail(down)}" if down else "")
    )
    if run.masked_streak + 1 >= limit:
        run.logger.log(step, metrics)  # the step that stops the run keeps its metrics line


def resumable_logs(log_dir: Path) -> list[Path]:
    """The JSONL logs a resumed run cuts back to the checkpoint's step (one record set per step)."""
    return [log_dir / METRICS_FILE, log_dir / FIRST_CALL_PROMPTS_FILE, log_dir / DISPATCHED_PROMPTS_FILE]


async def start_run(cfg: MasterConfig, progress) -> GRPORun | None:
    """The checkpoint prepared and the stack set up (resumed when asked); None when nothing is left to run."""
    log_dir = Path(cfg.logger.log_dir)
    resume = prepare_checkpointing(cfg.checkpointing, resumable_logs(log_dir), progress)
    if resume is not None and resume.step >= cfg.grpo.max_num_steps:
        progress(
            f"[checkpoint] the newest checkpoint {resume.folder} is of step {resume.step} >= grpo.max_num_steps="
            f"{cfg.grpo.max_num_steps}: nothing left to run (raise grpo.max_num_steps to train further)"
        )
        return None
    if resume is not None and not cfg.checkpointing.enabled:
        progress("[checkpoint] checkpointing.enabled=false: this resumed run writes no further checkpoints")
    return await setup(cfg, progress, resume)


async def train_groups(run: GRPORun, step: int, groups: Sequence[GroupResult], metrics: dict[str, float],
                       clear: Callable[[StepBatch], dict[str, float]],
                       refit: Callable[[GRPORun, int], dict[str, float]] = refit_step) -> bool:
    """Build, train (unless masked), clear the train partition (`clear`), refit; True if it trained."""
    cfg = run.cfg
    step_batch = build_train_batch(groups, cfg.grpo.normalize_rewards, cfg.token_capture.train_partition)
    trainable = step_batch.trainable
    metrics["reward/mean"] = metrics.get("reward/mean", step_batch.rewards_mean)
    metrics["steps/masked_consecutive"] = 0.0 if trainable else float(run.masked_streak + 1)
    if not trainable:
        # A death this step explains its failures: the component policy decides, not this check.
        if not run.step_component_deaths and not _down(run) and harness_failure_counts(groups) is not None:
            run.logger.log(step, metrics)  # the step that stops the run keeps its accounting line
            check_harness_failures(groups, step)
        _report_masked(run, step, metrics)
    run.masked_streak = next_masked_streak(run.masked_streak, trainable, cfg.token_capture.max_consecutive_masked_steps, step)
    if trainable:
        # Blocking Ray calls run off the event loop (it may hold other I/O).
        metrics.update(await asyncio.to_thread(train_step, run, step, step_batch))
    if run.train_cleaner is not None and not any_down(_down(run), *DATA_PLANE_KINDS):
        metrics.update(await asyncio.to_thread(clear, step_batch))
    if trainable:
        metrics.update(await refit_or_name_deaths(run, step, metrics, refit))
    return trainable


def engine_step_metrics(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """`async/*` engine metrics of the window between two reads of every worker's `EngineTiming`.

    Per worker i: `async/worker_<i>/engine_idle_fraction` (engine seconds with no request / engine
    seconds elapsed, both from the worker's own clock), `async/worker_<i>/refit_pause_s` (seconds its
    refit gate was closed), `async/worker_<i>/refit_calls_in_flight` (calls that were running when a
    refit closed the gate). Across workers: the mean idle fraction, the max pause, the summed calls
    and `refit/aborted_workers` (refits aborted by a drain past its deadline)."""
    if len(before) != len(after) or not after:
        raise GRPOError(f"engine timings of {len(before)} then {len(after)} workers: need the same, non-zero count",
                        kind="worker_metrics")
    metrics: dict[str, float] = {}
    idle, pause, calls, aborted = [], [], 0, 0
    for i, (a, b) in enumerate(zip(before, after)):
        elapsed = b["clock_s"] - a["clock_s"]
        if elapsed <= 0:
            raise GRPOError(f"worker {i}'s engine clock did not advance ({a['clock_s']} -> {b['clock_s']})",
                            kind="worker_metrics")
        idle.append((b["idle_s"] - a["idle_s"]) / elapsed)
        pause.append(b["refit_pause_s"] - a["refit_pause_s"])
        drained = b["refit_drained_calls"] - a["refit_drained_calls"]
        calls += drained
        aborted += int(b["refits_aborted"] > a["refits_aborted"])
        metrics[f"async/worker_{i}/engine_idle_fraction"] = idle[-1]
        metrics[f"async/worker_{i}/refit_pause_s"] = pause[-1]
        metrics[f"async/worker_{i}/refit_calls_in_flight"] = float(drained)
    metrics["async/engine_idle_fraction"] = sum(idle) / len(idle)
    metrics["async/refit_pause_s"] = max(pause)
    metrics["async/refit_calls_in_flight"] = float(calls)
    metrics["refit/aborted_workers"] = float(aborted)
    return metrics


async def engine_window_metrics(run: GRPORun, before: Sequence[dict] | None) -> tuple[dict[str, float], list[dict] | None]:
    """The synchronous loop's engine metrics since `before` (a previous reading), and the new reading.

    The same keys and counters as the async loop (`engine_step_metrics`: the engines' own
    idle clock, so `async/engine_idle_fraction` compares the two loops directly). A dead worker has
    no counter: the reading is None and the step logs none; a step after a None reading logs none."""
    if any_down(_down(run), ComponentKind.VLLM_WORKER):
        return {}, None
    now = await asyncio.to_thread(run.stack.workers.engine_timings)
    if before is None:
        return {}, now
    return engine_step_metrics(before, now), now


async def log_and_checkpoint(run: GRPORun, step: int, metrics: dict[str, float], weight_version: int | None = None,
                             ledger: PromptLedger | None = None) -> None:
    """The step's metrics line, then its checkpoint when due (with `ledger`'s snapshot: the async loop)."""
    run.logger.log(step, metrics)
    # After the metrics line: a run killed in between redoes this step from the previous
    # checkpoint, and the resume cuts this line (resumable_logs) so no step is logged twice.
    ckpt = run.cfg.checkpointing
    if ckpt.enabled and should_save(step, ckpt.save_period, run.cfg.grpo.max_num_steps):
        # Here, on the event loop that owns the ledger: the group tasks change it while the save's thread runs.
        snapshot = ledger.snapshot() if ledger is not None else None
        await asyncio.to_thread(save_checkpoint, run, step, weight_version, snapshot)


async def run_grpo(cfg: MasterConfig, progress=print) -> Path:
    """Run the loop; returns the metrics.jsonl path. Everything started is stopped on exit.

    With `grpo.async_rollouts.enabled` the async loop runs instead (`grpo_async.run_grpo_async`)."""
    if cfg.grpo.async_rollouts.enabled:
        from nemo_rl.algorithms.grpo_async import run_grpo_async  # it builds on this module

        return await run_grpo_async(cfg, progress)
    run = await start_run(cfg, progress)
    if run is None:
        return Path(cfg.logger.log_dir) / METRICS_FILE
    try:
        _, timings = await engine_window_metrics(run, None)
        for step in range(run.start_step, cfg.grpo.max_num_steps + 1):
            metrics: dict[str, float] = dict(run.resume_metrics) if step == run.start_step else {}
            with Timer("step_s", metrics):
                groups, rollout_metrics = await rollout_step(run, step)
                metrics.update(rollout_metrics)
                if run.step_component_deaths and cfg.token_capture.on_component_failure == "abort":
                    run.logger.log(step, metrics)  # the step that stops the run keeps its accounting line
                    check_abort(cfg.token_capture.on_component_failure, run.step_component_deaths, step)
                cleaner = run.train_cleaner
                await train_groups(run, step, groups, metrics,
                                   lambda batch: clear_train_rows(cleaner, batch.train_keys))  # type: ignore[arg-type]
                engine, timings = await engine_window_metrics(run, timings)
            metrics.update(engine)
            await log_and_checkpoint(run, step, metrics)
        return run.logger.metrics_path
    finally:
        await run.aclose()  # the teardown joins processes and Ray actors: off the event loop
