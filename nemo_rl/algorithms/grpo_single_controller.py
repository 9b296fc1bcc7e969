"""Single-controller GRPO on Ray, training on exactly the tokens the policy sampled.

The loop is four readable pieces: `setup` (everything started, in a `GRPORun`), `rollout_step`
(dispatch + accounting), `train_step` and `refit_step`, each returning its metrics; `run_grpo`
strings them together and stops everything on exit.

Contract of one step (`run_grpo`):
1. take `num_prompts_per_step` rows from the prompt source `env:` names (deterministic in seed and step);
2. dispatch one group of N rollouts per problem through the `RolloutManager` (receipt mode when
   `token_capture.enabled`, Gym's legacy token echo otherwise); every group comes back with
   exactly N entries, rows or typed placeholders;
3. group-normalised advantages over the kept ROLLOUTS (placeholders get 0 and are not trained);
   every row of a kept rollout (one per verified chain) carries its rollout's advantage;
4. one GRPO train step on the policy worker (loss mask = generated tokens only), which also
   reports `token_mult_prob_error` / `gen_kl_error` of its logprobs against the generation's.
   Legacy rows (and capture rows with `token_capture.train_partition=null`) reach it as a
   `TrainBatch` argument; capture rows with a train partition stay in TransferQueue: the
   finalizers wrote them there and returned `RowRef`s, the driver sends a `TrainPlan` (keys,
   digests, advantages) and the worker reads and digest-checks the rows itself
   (`token_capture.train_rows`). After the step the driver clears the plan's keys and any key a
   masked rollout left (`retention/train_keys_cleared`, `retention/train_keys_stray`,
   `retention/train_keys_remaining`, 0 when retention kept up);
5. export the new weights and refit every vLLM worker to version `step`; the version each worker
   reports back is the one the next step's rows must carry (checked from the rows, per call);
   a probe sequence is then scored by engine and trainer to prove the engine serves the new weights;
6. log one metrics line (stdout, `<log_dir>/metrics.jsonl`, TensorBoard when enabled); with
   `logger.dump_first_call_prompt_ids`, also append the step's first-call prompt records
   (`first_call_prompt_records`) to `<log_dir>/first_call_prompt_ids.jsonl`.
At set-up, `<log_dir>/run_info.json` records `generation/venv` (`venv_record`): the spec hash
and folder the driver expects for the worker venv, and what each worker reports running in; and
`placement` (`placement_record`): the cluster's node count and, per vLLM worker, the node the
plan chose, the node it runs on (measured in the actor) and its base URL, and the node each
other actor (policy, TransferQueue, finalizers) runs on. Before the first step
the refit folder (`grpo.refit_dir`, `refit_root`) is proven shared: the driver writes a marker
there and the policy and every worker must read it (`nemo_rl.distributed.shared_fs`), so a
multi-node run whose nodes do not share it stops at set-up, naming the knob.
Every step also appends one record per dispatched group (step, group, prompt digest) to
`<log_dir>/dispatched_prompts.jsonl`: the prompt sequence of the run, across resumes.
Invariant checked every step: `rollouts/dispatched == finalize/kept_rollouts + finalize/placeholders`.
A step whose rollouts are all placeholders is logged loudly, counted (`steps/masked_consecutive`)
and skipped (no train, no refit); `token_capture.max_consecutive_masked_steps` such steps in a row
raise `MaskedStepsError`.

Component deaths (both paths, capture on or off; `nemo_rl.algorithms.grpo_health`): a watch polls
every component the run has while a step runs, and once more as the step's rollouts end; the
first rollout-path death ends the in-flight rollouts as `component_failed` placeholders naming
it. `token_capture.on_component_failure=abort` stops the run with `ComponentFailedError` after
that step's metrics line; `continue` restarts dead Gym servers before the next step, replaces
finalizer actors, and masks steps while a vLLM worker (or its engine core) or a TransferQueue
actor stays dead (the masked-step streak then ends the run). A refit that fails because a worker
or its engine core died after the rollouts is named the same way (`grpo_health.refit_deaths`):
`abort` raises `ComponentFailedError` after the step's metrics line, `continue` skips the refit.
Every step logs `component/*`; capture steps also `retention/staged_keys_remaining` and
`retention/ledger_files_remaining` (0 when retention kept up).

Checkpoint and resume (`checkpointing:`; what a checkpoint holds: `nemo_rl.algorithms.grpo_checkpoint`):
after step k's metrics line, when `should_save(k, save_period, max_num_steps)`, `save_checkpoint`
writes `step_<k>` atomically. With `checkpointing.resume=latest`, `run_grpo` picks the newest
complete checkpoint before anything starts; `setup` restores policy + optimizer (checked bit for
bit against the fingerprints recorded at save time), checks that the prompt source gives step k
the saved batch, refits every engine with the restored weights at the saved weight version (so
step k+1's rows carry it, as in an uninterrupted run), restores the driver's RNG states, and the
loop continues at step k+1; that step's metrics line carries `resume/*` (the step resumed from,
the engine's probe now vs at save time). A checkpoint of the last step (or later) leaves nothing
to run: the run says so and starts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ray

from nemo_rl.algorithms.grpo import ClippedPGLossFn, compute_group_advantages
from nemo_rl.algorithms.grpo_checkpoint import (
    DISPATCHED_PROMPTS_FILE,
    POLICY_SUBDIR,
    ResumePoint,
    TrainerState,
    batch_digest,
    check_prompt_position,
    check_resumable,
    prepare_checkpointing,
    prompt_records,
    write_trainer_state,
)
from nemo_rl.algorithms.grpo_config import REFIT_DIR_KNOB, MasterConfig, model_path, policy_config, refit_root
from nemo_rl.algorithms.grpo_health import (
    build_watch,
    check_abort,
    component_metrics,
    component_pids,
    recover,
    refit_deaths,
    refit_failure_error,
    step_deaths,
    unrecoverable,
    untrainable,
)
from nemo_rl.distributed.component_watch import ComponentWatch
from nemo_rl.distributed.placement import actor_node_ids
from nemo_rl.distributed.shared_fs import remove_probe, write_probe
from nemo_rl.distributed.stack import Stack, start_stack
from nemo_rl.environments.datasets import PromptSource, make_prompt_source
from nemo_rl.environments.nemo_gym import RowSampling
from nemo_rl.experience.rollout_manager import RolloutManager, RolloutManagerConfig, component_failure_detail
from nemo_rl.models.generation.vllm.launcher import resolve_flavor
from nemo_rl.models.generation.vllm.worker import WorkerError
from nemo_rl.models.policy import TrainBatch
from nemo_rl.models.policy.worker import RayPolicyClient
from nemo_rl.token_capture.finalizer_pool import FinalizeOutcome, FinalizerPool, TQSourceFactory, TQTrainRowsFactory
from nemo_rl.token_capture.judge import RolloutEvidence
from nemo_rl.token_capture.metrics import finalize_metrics, first_call_prompt_records
from nemo_rl.token_capture.retention import TQStagingCleaner
from nemo_rl.token_capture.rows import GroupResult, KeptRollout, RowRef
from nemo_rl.token_capture.train_rows import TrainPlan, TrainRowCleaner
from nemo_rl.utils.aio import gather_cancelling
from nemo_rl.utils.checkpoint import (
    CheckpointMismatchError,
    capture_rng_states,
    commit_checkpoint,
    prune_checkpoints,
    restore_rng_states,
    should_save,
)
from nemo_rl.utils.logger import (
    FIRST_CALL_PROMPTS_FILE,
    METRICS_FILE,
    MetricsLogger,
    Timer,
    append_jsonl,
    write_run_info,
)
from nemo_rl.utils.venvs import spec_hash, venv_folder_name, vllm_spec


class GRPOError(RuntimeError):
    """The training loop cannot continue (the message names the step and the cause)."""


class MaskedStepsError(GRPOError):
    """Too many consecutive steps in which every rollout became a placeholder."""


class StaleWeightsError(GRPOError):
    """Rows carry a weight version other than the one the loop refit into every worker."""


class TimedFinalizer:
    """Wraps the finalizer pool to measure time spent finalizing (summed over groups)."""

    def __init__(self, pool: FinalizerPool) -> None:
        self.pool = pool
        self.seconds = 0.0

    async def finalize_group(self, items: Sequence[RolloutEvidence]) -> list[FinalizeOutcome]:
        t0 = time.monotonic()
        try:
            return await self.pool.finalize_group(items)
        finally:
            self.seconds += time.monotonic() - t0


@dataclass(frozen=True)
class StepBatch:
    batch: TrainBatch | None  # rows held by the driver (legacy, or capture without a train partition)
    rewards_mean: float
    plan: TrainPlan | None = None  # rows in the train partition (capture with one)

    @property
    def trainable(self) -> bool:
        return self.batch is not None or self.plan is not None


def build_train_batch(groups: Sequence[GroupResult], normalize: bool, train_partition: str | None = None) -> StepBatch:
    """Advantages per group over kept rollouts; each of a rollout's rows gets its rollout's advantage.

    Placeholders are accounted but never trained. Normalising per rollout (not per row) keeps a
    rollout that branched into several rows from weighing more in its group's statistics.
    `TrainRow`s become a `TrainBatch`; `RowRef`s (their payload in `train_partition`) a `TrainPlan`
    in the same row order. A step holds one kind or the other.
    """
    ids, masks, lps, advs = [], [], [], []
    refs: list[RowRef] = []
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
                    continue
                ids.append(list(row.token_ids))
                masks.append([int(m) for m in row.token_mask])
                lps.append(list(row.generation_logprobs))
                advs.append(adv)
    if refs and ids:
        raise GRPOError(f"a step holds {len(ids)} TrainRows and {len(refs)} RowRefs; the finalizers disagree on "
                        "token_capture.train_partition")
    if refs and train_partition is None:
        raise GRPOError(f"{len(refs)} rows are RowRefs but no train partition was given to read them from")
    batch = TrainBatch(token_ids=ids, token_mask=masks, generation_logprobs=lps, advantages=advs) if ids else None
    plan = TrainPlan.of(train_partition, refs, ref_advs) if refs else None
    return StepBatch(batch=batch, rewards_mean=sum(all_rewards) / max(1, len(all_rewards)), plan=plan)


def probe_sequence(tokenizer_eos: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length - 1)] + [tokenizer_eos]


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
        raise GRPOError(f"worker count changed during the step: {len(before)} -> {len(after)}")
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
        raise StaleWeightsError(
            f"step {step}: rows carry weight versions {stale} but every worker was refit to version "
            f"{served_version}; a worker served stale (or future) weights"
        )


def venv_record(flavor: str, workers: Sequence[dict]) -> dict:
    """`generation/venv` of run_info.json: the venv the driver's spec names, and what each worker ran in."""
    spec = vllm_spec(flavor)
    digest = spec_hash(spec)
    return {"flavor": flavor, "spec": spec.name, "spec_hash": digest,
            "folder": venv_folder_name(spec.name, digest), "workers": list(workers)}


@dataclass
class GRPORun:
    """Everything `setup` started for one run, and the state carried from step to step."""

    cfg: MasterConfig
    stack: Stack
    policy: RayPolicyClient
    manager: RolloutManager
    prompts: PromptSource
    logger: MetricsLogger
    progress: Callable[[str], None]
    weights_root: Path
    probe: list[int]
    pool: FinalizerPool | None = None
    finalizer: TimedFinalizer | None = None
    cleaner: TQStagingCleaner | None = None
    train_cleaner: TrainRowCleaner | None = None
    watch: ComponentWatch | None = None
    step_component_deaths: dict[str, str] = field(default_factory=dict)
    previous_engine_probe: list[float] = field(default_factory=list)
    served_version: int = 0
    worker_calls: list[int] = field(default_factory=list)
    masked_streak: int = 0
    start_step: int = 1
    resume_metrics: dict[str, float] = field(default_factory=dict)

    def close(self) -> None:
        """Stop everything this run started (idempotent per component)."""
        self.logger.close()
        self.policy.kill()
        if self.pool is not None:
            self.pool.shutdown()
        self.stack.stop()


async def setup(
    cfg: MasterConfig, progress: Callable[[str], None] = print, resume: ResumePoint | None = None
) -> GRPORun:
    """Model, prompt source, stack, policy, finalizer pool, rollout manager; with `resume`, the
    checkpoint restored (`restore_from_checkpoint`). Stops what it started on failure."""
    log_dir = Path(cfg.logger.log_dir)
    # Absolute: actors (on any node) resolve a relative path against their own working dir.
    model_dir = model_path(cfg.model).resolve()
    pcfg = policy_config(cfg.policy, str(model_dir))
    # Before Ray or any venv: a GPU recipe on a host without enough GPUs fails here, by name.
    flavor = resolve_flavor(cfg.generation, extra_gpus=int(pcfg.device == "cuda"))
    sampling = RowSampling(temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p, max_output_tokens=cfg.grpo.max_output_tokens)
    prompts = make_prompt_source(cfg.env, seed=cfg.grpo.seed, sampling=sampling, model_dir=model_dir,
                                 max_model_len=cfg.generation.vllm.max_model_len, progress=progress)
    if resume is not None:  # before the stack: a recipe that would continue with other prompts costs nothing
        check_resumable(resume.state, cfg.grpo.seed, cfg.grpo.num_prompts_per_step)
        check_prompt_position(resume.state, prompts.batch(resume.step, cfg.grpo.num_prompts_per_step))
    stack: Stack = await start_stack(
        model_dir=model_dir,
        log_dir=log_dir,
        generation=cfg.generation,
        token_capture=cfg.token_capture,
        data_plane=cfg.data_plane,
        nemo_gym=cfg.env,
        num_cpus=cfg.cluster.num_cpus,
        progress=progress,
    )
    policy: RayPolicyClient | None = None
    pool: FinalizerPool | None = None
    run: GRPORun | None = None
    try:
        assert stack.env is not None and stack.workers is not None
        capture = cfg.token_capture
        train_partition = capture.train_partition if capture.enabled else None
        policy = RayPolicyClient.spawn(pcfg, data_plane=cfg.data_plane if train_partition is not None else None)
        weights_root = refit_root(cfg)
        check_refit_dir_shared(stack, policy, weights_root)
        finalizer = cleaner = watch = train_cleaner = rows_factory = None
        if train_partition is not None:
            rows_factory = TQTrainRowsFactory(cfg.data_plane, train_partition, capture.stage_timeout_s,
                                              carry_prompt_ids=cfg.logger.dump_first_call_prompt_ids)
            train_cleaner = TrainRowCleaner(stack.client, train_partition, capture.stage_timeout_s)
        if cfg.token_capture.enabled:
            pool = FinalizerPool.from_config(cfg.token_capture, TQSourceFactory.from_config(cfg.data_plane, cfg.token_capture),
                                             rows_factory)
            await pool.wait_ready(cfg.data_plane.startup_timeout_s)
            finalizer = TimedFinalizer(pool)
            cleaner = TQStagingCleaner(stack.client, cfg.token_capture.staging_partition, cfg.token_capture.stage_timeout_s)
        # Both paths: without it a dead worker or gate would cost a whole env.run_timeout_s per step.
        watch = build_watch(stack, pool, cfg.token_capture, progress)
        manager = RolloutManager(
            RolloutManagerConfig(
                # Fresh per process, resumed or not: Gym appends to the ledger of a reused rollout id.
                run_id=f"grpo-{uuid.uuid4().hex[:8]}",
                run_timeout_s=cfg.env.run_timeout_s + 30.0,
                capture=cfg.token_capture,
            ),
            stack.env,
            finalizer=finalizer,
            cleaner=cleaner,
            served=stack.workers if cfg.token_capture.enabled else None,
            health=watch,
        )
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id
        probe = probe_sequence(eos, cfg.grpo.refit_probe_tokens, cfg.grpo.seed)
        run_info: dict = {"generation/venv": venv_record(flavor, stack.workers.venv_info()),
                          "placement": placement_record(stack, policy, pool, cfg.generation.vllm.call_timeout_s),
                          "components": component_pids(stack, pool, cfg.generation.vllm.call_timeout_s)}
        initial_versions = set(stack.workers.weight_versions())
        if len(initial_versions) != 1:
            raise StaleWeightsError(f"the generation workers start from different weight versions {sorted(initial_versions)}")
        run = GRPORun(
            cfg=cfg, stack=stack, policy=policy, manager=manager, prompts=prompts, logger=MetricsLogger(cfg.logger),
            progress=progress, weights_root=weights_root, probe=probe, pool=pool, finalizer=finalizer,
            cleaner=cleaner, watch=watch, train_cleaner=train_cleaner,
            previous_engine_probe=stack.workers.prompt_logprobs(probe)[0], served_version=initial_versions.pop(),
            worker_calls=stack.workers.served_calls(),
        )
        if resume is not None:
            run_info["resume"] = restore_from_checkpoint(run, resume)
        write_run_info(log_dir, run_info)
        return run
    except BaseException:
        if run is not None:
            run.close()
        else:
            if policy is not None:
                policy.kill()
            if pool is not None:
                pool.shutdown()
            stack.stop()
        raise


def check_refit_dir_shared(stack: Stack, policy: RayPolicyClient, weights_root: Path) -> None:
    """The policy (writer) and every worker (readers) see the driver's marker in the refit folder."""
    assert stack.workers is not None
    probe = write_probe(weights_root)
    try:
        policy.check_shared_dir(probe, REFIT_DIR_KNOB)
        stack.workers.check_shared_dir(probe, REFIT_DIR_KNOB)
    finally:
        remove_probe(probe)


def placement_record(stack: Stack, policy: RayPolicyClient, pool: FinalizerPool | None, timeout_s: float) -> dict:
    """Where things run: per vLLM worker the planned node, the measured node and its base URL; the
    measured node of the policy, the TransferQueue actors and the finalizers (Ray placed them)."""
    assert stack.workers is not None
    workers = stack.workers
    measured = workers.node_ids()
    others = dict(stack.data_plane.actors()) if stack.data_plane is not None else {}
    if pool is not None:
        others.update(pool.actors())
    try:
        measured_others = actor_node_ids(list(others.values()), timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
        raise GRPOError(f"asking {sorted(others)} which node they run on failed within {timeout_s:g}s: {e}") from e
    actors = {"policy": policy.node_id(), **dict(zip(others, measured_others))}
    return {
        "nodes": stack.nodes,
        "workers": [
            {"worker": i, "planned_node": planned, "node": node, "base_url": url}
            for i, (planned, node, url) in enumerate(zip(workers.planned_nodes, measured, workers.base_urls))
        ],
        "actors": actors,
    }


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b) or not a:
        raise ValueError(f"max_abs_diff of sequences of lengths {len(a)} and {len(b)}: need equal, non-zero lengths")
    return max(abs(x - y) for x, y in zip(a, b))


def restore_from_checkpoint(run: GRPORun, resume: ResumePoint) -> dict:
    """Policy + optimizer, engine weights and version, loop state and driver RNG from `resume`.

    Returns the facts recorded under `resume` in run_info.json; `run.resume_metrics` (the first
    resumed step's `resume/*` metrics) is set from them.
    """
    state = resume.state
    info = run.policy.load_state(resume.folder / POLICY_SUBDIR)
    saved = (state.policy_steps_taken, state.policy_fingerprint, state.optimizer_fingerprint)
    if (info.steps_taken, info.policy_fingerprint, info.optimizer_fingerprint) != saved:
        raise CheckpointMismatchError(
            f"{resume.folder}: the policy restored {info} but the trainer state recorded steps_taken, policy and "
            f"optimizer fingerprints {saved} (fix: the policy/ folder belongs to another checkpoint; delete {resume.folder})"
        )
    initial_probe = run.previous_engine_probe
    # The killed run's refit scratch (never a checkpoint); only our step_* folders, since
    # grpo.refit_dir may name a folder that holds other things too.
    for stale in sorted(run.weights_root.glob("step_*")):
        shutil.rmtree(stale)
    out_dir = run.policy.export_weights(run.weights_root / f"step_{state.step}")
    versions = run.stack.workers.update_weights(out_dir, state.weight_version)
    if set(versions) != {state.weight_version}:
        raise StaleWeightsError(
            f"resume from step {state.step}: refit to the saved weight version {state.weight_version} but the "
            f"workers report versions {versions}"
        )
    run.served_version = state.weight_version
    engine_probe = run.stack.workers.prompt_logprobs(run.probe)[0]
    trainer_probe = run.policy.get_logprobs([run.probe])[0]
    run.previous_engine_probe = engine_probe
    run.masked_streak = state.masked_streak
    run.start_step = state.step + 1
    run.worker_calls = run.stack.workers.served_calls()
    restore_rng_states(state.rng)
    run.resume_metrics = {
        "resume/from_step": float(state.step),
        # The engine serves the restored weights: its probe equals the one it gave at save time ...
        "resume/engine_probe_vs_saved_max_abs_diff": max_abs_diff(engine_probe, state.engine_probe),
        # ... agrees with the restored trainer, and moved off the initial weights it started with.
        "resume/engine_trainer_max_abs_diff": max_abs_diff(engine_probe, trainer_probe),
        "resume/engine_probe_change": max_abs_diff(engine_probe, initial_probe),
    }
    run.progress(
        f"[checkpoint] resumed from {resume.folder}: policy {info.policy_fingerprint[:12]}, optimizer "
        f"{info.optimizer_fingerprint[:12]} ({info.steps_taken} steps taken), engines refit to weight version "
        f"{state.weight_version}; continuing at step {run.start_step}"
    )
    return {
        **run.resume_metrics,
        "checkpoint": str(resume.folder),
        "weight_version": state.weight_version,
        "policy_fingerprint": info.policy_fingerprint,
        "optimizer_fingerprint": info.optimizer_fingerprint,
        "policy_steps_taken": info.steps_taken,
    }


def save_checkpoint(run: GRPORun, step: int) -> Path:
    """Write `step_<step>` atomically (policy, optimizer, TrainerState), then prune beyond keep_last."""
    ckpt, grpo = run.cfg.checkpointing, run.cfg.grpo
    assert ckpt.checkpoint_dir is not None  # CheckpointingConfig requires it when enabled
    root = Path(ckpt.checkpoint_dir)
    t0 = time.monotonic()

    def write(folder: Path) -> None:
        info = run.policy.save_state(folder / POLICY_SUBDIR)
        write_trainer_state(folder, TrainerState(
            step=step, weight_version=run.served_version, masked_streak=run.masked_streak, seed=grpo.seed,
            num_prompts_per_step=grpo.num_prompts_per_step,
            prompt_batch_digest=batch_digest(run.prompts.batch(step, grpo.num_prompts_per_step)),
            policy_fingerprint=info.policy_fingerprint, optimizer_fingerprint=info.optimizer_fingerprint,
            policy_steps_taken=info.steps_taken, engine_probe=tuple(run.previous_engine_probe),
            rng=capture_rng_states(),
        ))

    path = commit_checkpoint(root, step, write)
    pruned = prune_checkpoints(root, ckpt.keep_last)
    run.progress(
        f"[checkpoint] step {step} saved to {path} in {time.monotonic() - t0:.1f}s (weight version {run.served_version})"
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
    if not any(name.startswith("vllm_worker_") for name in down):  # a dead worker has no counter to read
        calls_now = await asyncio.to_thread(run.stack.workers.served_calls)
        metrics.update(worker_call_metrics(run.worker_calls, calls_now))
        run.worker_calls = calls_now
    if run.watch is not None:
        run.step_component_deaths = step_deaths(run.watch, run.pool, run.progress)
        replaced = run.pool.replacements - replaced_before if run.pool is not None else 0
        metrics.update(component_metrics(run.step_component_deaths, down, restarts, replaced))
        if cfg.token_capture.on_component_failure == "continue":
            groups = untrainable(groups, unrecoverable(run.stack, down))
    metrics.update(finalize_metrics(groups, run.manager.take_queue_waits_ms()))
    metrics["finalize/orphaned_staged_keys"] = float(run.manager.take_orphaned_staged_keys())
    metrics["finalize/dropped_groups"] = float(run.manager.take_dropped_groups())
    metrics["finalize/served_report_failures"] = float(run.manager.take_served_report_failures())
    if run.cleaner is not None:
        metrics["retention/failures"] = float(run.manager.take_retention_failures())
        if not any(name.startswith("tq_") for name in down):  # a dead data plane cannot list its keys
            metrics["retention/staged_keys_remaining"] = float(await asyncio.to_thread(run.cleaner.remaining))
        metrics["retention/ledger_files_remaining"] = float(run.stack.env.ledger_file_count())
    if metrics["rollouts/dispatched"] != metrics["finalize/kept_rollouts"] + metrics["finalize/placeholders"]:
        raise GRPOError(f"step {step}: always-N accounting broke: {metrics}")
    check_row_versions(groups, run.served_version, step)
    if cfg.logger.dump_first_call_prompt_ids:
        append_jsonl(Path(cfg.logger.log_dir) / FIRST_CALL_PROMPTS_FILE, first_call_prompt_records(step, groups))
    return groups, metrics


def train_step(run: GRPORun, step: int, step_batch: StepBatch) -> dict[str, float]:
    """One GRPO step on the policy worker; returns train/* and the generation-mismatch metrics."""
    metrics: dict[str, float] = {}
    with Timer("train_s", metrics):
        loss_fn = ClippedPGLossFn.from_config(run.cfg.loss_fn)
        if step_batch.plan is not None:
            run.progress(f"[step {step}] training on {step_batch.plan.num_samples} rows read from the train partition")
            train = run.policy.train_planned(step_batch.plan, loss_fn)
        else:
            assert step_batch.batch is not None  # the loop trains trainable steps only
            run.progress(f"[step {step}] training on {step_batch.batch.num_samples} rows")
            train = run.policy.train_step(step_batch.batch, loss_fn)
    metrics.update({f"train/{k}": v for k, v in train.items() if k not in ("token_mult_prob_error", "gen_kl_error")})
    metrics["token_mult_prob_error"] = train["token_mult_prob_error"]
    metrics["gen_kl_error"] = train["gen_kl_error"]
    return metrics


def clear_train_rows(cleaner: TrainRowCleaner, plan: TrainPlan | None) -> dict[str, float]:
    """Clear the step's trained keys, then any key the step left (rows of rollouts masked after they
    were judged); between steps no rollout is in flight, so every key left is this step's."""
    trained = list(plan.keys) if plan is not None else []
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
        out_dir = run.policy.export_weights(run.weights_root / f"step_{step}")
        versions = run.stack.workers.update_weights(out_dir, step)
        shutil.rmtree(run.weights_root / f"step_{step - 1}", ignore_errors=True)
    if set(versions) != {step}:
        raise StaleWeightsError(f"step {step}: refit to version {step} but the workers report versions {versions}")
    run.served_version = step
    engine_probe = run.stack.workers.prompt_logprobs(run.probe)[0]
    trainer_probe = run.policy.get_logprobs([run.probe])[0]
    metrics["refit/engine_trainer_max_abs_diff"] = max(abs(a - b) for a, b in zip(engine_probe, trainer_probe))
    metrics["refit/engine_logprob_change"] = max(abs(a - b) for a, b in zip(engine_probe, run.previous_engine_probe))
    run.previous_engine_probe = engine_probe
    return metrics


async def refit_or_name_deaths(run: GRPORun, step: int, metrics: dict[str, float]) -> dict[str, float]:
    """`refit_step`, or, when it fails because a component died after the rollouts, that death named.

    `abort`: the step's metrics line is logged, then `ComponentFailedError` names the dead
    components (never the refit's raw traceback). `continue`: the refit is skipped
    (`refit/skipped` 1, the engines keep the previous version) and the following steps are masked
    while the component stays dead. A refit failure with every component alive propagates.
    """
    try:
        return await asyncio.to_thread(refit_step, run, step)
    except WorkerError as error:
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


async def run_grpo(cfg: MasterConfig, progress=print) -> Path:
    """Run the loop; returns the metrics.jsonl path. Everything started is stopped on exit."""
    log_dir = Path(cfg.logger.log_dir)
    resume = prepare_checkpointing(cfg.checkpointing, resumable_logs(log_dir), progress)
    if resume is not None and resume.step >= cfg.grpo.max_num_steps:
        progress(
            f"[checkpoint] the newest checkpoint {resume.folder} is of step {resume.step} >= grpo.max_num_steps="
            f"{cfg.grpo.max_num_steps}: nothing left to run (raise grpo.max_num_steps to train further)"
        )
        return log_dir / METRICS_FILE
    if resume is not None and not cfg.checkpointing.enabled:
        progress("[checkpoint] checkpointing.enabled=false: this resumed run writes no further checkpoints")
    run = await setup(cfg, progress, resume)
    ckpt = cfg.checkpointing
    try:
        for step in range(run.start_step, cfg.grpo.max_num_steps + 1):
            metrics: dict[str, float] = dict(run.resume_metrics) if step == run.start_step else {}
            with Timer("step_s", metrics):
                groups, rollout_metrics = await rollout_step(run, step)
                metrics.update(rollout_metrics)
                if run.step_component_deaths and cfg.token_capture.on_component_failure == "abort":
                    run.logger.log(step, metrics)  # the step that stops the run keeps its accounting line
                    check_abort(cfg.token_capture.on_component_failure, run.step_component_deaths, step)
                step_batch = build_train_batch(groups, cfg.grpo.normalize_rewards,
                                               cfg.token_capture.train_partition if cfg.token_capture.enabled else None)
                trainable = step_batch.trainable
                metrics["reward/mean"] = metrics.get("reward/mean", step_batch.rewards_mean)
                metrics["steps/masked_consecutive"] = 0.0 if trainable else float(run.masked_streak + 1)
                if not trainable:
                    _report_masked(run, step, metrics)
                run.masked_streak = next_masked_streak(
                    run.masked_streak, trainable, cfg.token_capture.max_consecutive_masked_steps, step)
                if trainable:
                    # Blocking Ray calls run off the event loop (it may hold other I/O).
                    metrics.update(await asyncio.to_thread(train_step, run, step, step_batch))
                if run.train_cleaner is not None and not any(name.startswith("tq_") for name in _down(run)):
                    metrics.update(await asyncio.to_thread(clear_train_rows, run.train_cleaner, step_batch.plan))
                if trainable:
                    metrics.update(await refit_or_name_deaths(run, step, metrics))
            run.logger.log(step, metrics)
            # After the metrics line: a run killed in between redoes this step from the previous
            # checkpoint, and the resume cuts this line (resumable_logs) so no step is logged twice.
            if ckpt.enabled and should_save(step, ckpt.save_period, cfg.grpo.max_num_steps):
                await asyncio.to_thread(save_checkpoint, run, step)
        return run.logger.metrics_path
    finally:
        run.close()
