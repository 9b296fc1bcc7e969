"""The driver's set-up: the stack brought up in order, the run's records, and the resumed state.

`start_stack` starts or joins Ray, spawns the vLLM workers, starts the data plane (capture only)
and the Gym servers while the engines load, then lets the workers serve; every step has its own
deadline. `setup(cfg, progress, resume)` returns a `GRPORun`, proves the refit folder shared,
writes `<log_dir>/run_info.json` (run id, venv, placement, components) and, with `resume`, restores
the checkpoint (fingerprints checked, every engine refit to the saved version).
Invariants: `Stack.stop()` tears down exactly what was started, in reverse order, idempotently,
and a failure stops what came before it; inside coroutines no blocking Ray call runs on the
event loop (only `ray.init` runs on the main thread).
See docs/design-docs/distributed.md, "The driver's stack".
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nemo_rl.algorithms.errors import GRPOError
from nemo_rl.algorithms.grpo_checkpoint import (
    POLICY_SUBDIR,
    ResumePoint,
    TrainerState,
    check_prompt_position,
    check_resumable,
)
from nemo_rl.algorithms.grpo_config import REFIT_DIR_KNOB, MasterConfig, model_path, policy_config, refit_root
from nemo_rl.algorithms.grpo_health import build_watch
from nemo_rl.algorithms.refit import max_abs_diff, refit_to
from nemo_rl.data_plane import DataPlane, DataPlaneClient, DataPlaneConfig, attach_client, start_data_plane
from nemo_rl.data_plane.partitions import TQStagingCleaner, TrainRowCleaner
from nemo_rl.distributed.actor_call import ActorCallTimeoutError, ActorDiedError, call_with_deadline
from nemo_rl.distributed.component_watch import ComponentWatch
from nemo_rl.distributed.placement import actor_node_ids
from nemo_rl.distributed.ray_cluster import (
    RayClusterHandle,
    alive_node_count,
    ray_address_from_env,
    start_or_join_ray,
)
from nemo_rl.distributed.shared_fs import remove_probe, write_probe
from nemo_rl.distributed.topology import check_cluster_binds
from nemo_rl.environments.datasets import make_prompt_source
from nemo_rl.environments.gym_client import NemoGymEnvironment, PromptSource
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.environments.task import RowSampling
from nemo_rl.experience.finalizer_pool import FinalizeOutcome, FinalizerPool, TQSourceFactory, TQTrainRowsFactory
from nemo_rl.experience.rollout_manager import RolloutManager, RolloutManagerConfig
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.client import WorkerGroup, worker_name
from nemo_rl.models.generation.vllm.launcher import await_workers, resolve_flavor, spawn_workers
from nemo_rl.models.policy.worker import RayPolicyClient
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RolloutEvidence
from nemo_rl.utils.checkpoint import CheckpointError, restore_rng_states
from nemo_rl.utils.logger import MetricsLogger, write_run_info
from nemo_rl.utils.venvs import spec_hash, venv_folder_name, vllm_spec


@dataclass
class Stack:
    ray: RayClusterHandle
    data_plane: DataPlane | None
    client: DataPlaneClient | None
    workers: WorkerGroup | None
    env: NemoGymEnvironment | None
    timings_s: dict[str, float] = field(default_factory=dict)
    nodes: int = 1  # alive nodes of the cluster when the stack started
    _stopped: bool = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.env is not None:
            self.env.stop()
        if self.workers is not None:
            self.workers.shutdown()
        if self.client is not None:
            self.client.close()
        if self.data_plane is not None:
            self.data_plane.shutdown()
        self.ray.shutdown()

    async def aclose(self) -> None:
        """`stop()` from a coroutine: the Gym client's session closes on this loop, and the blocking
        teardown (processes, Ray) runs on a worker thread."""
        if self.env is not None:
            await self.env.aclose()
        await asyncio.to_thread(self.stop)


def start_ray_for_stack(
    num_cpus: int,
    ray_address: str | None,
    *,
    generation: GenerationConfig,
    data_plane: DataPlaneConfig,
    token_capture: TokenCaptureConfig,
) -> tuple[RayClusterHandle, int]:
    """Start or join Ray (see `start_or_join_ray`) and accept its node count for these binds.

    Returns the handle and the alive node count. A cluster of several nodes with a loopback bind
    raises `RayClusterError` (kind `bind`) after disconnecting (`check_cluster_binds`).
    """
    handle = start_or_join_ray(num_cpus, ray_address)
    try:
        nodes = alive_node_count()
        check_cluster_binds(
            nodes,
            vllm_bind=generation.vllm.bind,
            data_plane_bind=data_plane.bind,
            data_plane_used=token_capture.enabled,
            address=handle.gcs_address,
        )
    except BaseException:
        handle.shutdown()
        raise
    return handle, nodes


async def start_stack(
    *,
    model_dir: Path,
    log_dir: Path,
    generation: GenerationConfig,
    token_capture: TokenCaptureConfig,
    data_plane: DataPlaneConfig,
    nemo_gym: NemoGymConfig,
    num_cpus: int,
    progress: Callable[[str], None] = print,
    gym_worker_urls: Callable[[list[str]], list[str]] | None = None,
) -> Stack:
    """`gym_worker_urls` maps the workers' base URLs to the ones the Gym gate is given (None: the
    same); a test puts a loopback proxy between the gate and the workers this way."""
    log_dir.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def step(name: str, t0: float) -> None:
        timings[name] = time.monotonic() - t0
        progress(f"[stack] {name} up in {timings[name]:.1f}s")

    t0 = time.monotonic()
    ray_address = ray_address_from_env(os.environ)
    # On the main thread: ray.init installs its SIGTERM handler only there (nothing else runs yet).
    ray_handle, nodes = start_ray_for_stack(
        num_cpus, ray_address, generation=generation, data_plane=data_plane, token_capture=token_capture
    )
    stack = Stack(ray=ray_handle, data_plane=None, client=None, workers=None, env=None, timings_s=timings, nodes=nodes)
    if ray_address is not None:
        progress(
            f"[stack] joined the Ray cluster at {ray_address} (RAY_ADDRESS); stopping only disconnects; "
            f"{nodes} alive node(s)"
        )
    step("ray", t0)
    try:
        t0 = time.monotonic()
        # The engines import vLLM for about a minute; the data plane and the Gym servers start
        # meanwhile on the other core (the workers answer 503 until they serve).
        pending = await asyncio.to_thread(
            spawn_workers,
            model_dir,
            generation,
            token_capture.model_dump(),
            data_plane.model_dump() if token_capture.enabled else None,
            progress=progress,
        )
        stack.workers = pending.group
        if token_capture.enabled:
            t_dp = time.monotonic()
            stack.data_plane = await asyncio.to_thread(start_data_plane, data_plane)
            stack.client = await asyncio.to_thread(attach_client, data_plane)
            step("data_plane", t_dp)
        t_gym = time.monotonic()
        gate_urls = pending.base_urls if gym_worker_urls is None else gym_worker_urls(list(pending.base_urls))
        stack.env = NemoGymEnvironment(nemo_gym, token_capture, worker_base_url=gate_urls, log_dir=log_dir)
        await stack.env.start()
        step("gym_servers", t_gym)
        await asyncio.to_thread(await_workers, pending, progress=progress)
        step("vllm_workers", t0)
    except BaseException:
        await stack.aclose()
        raise
    return stack


class TimedFinalizer:
    """Wraps the finalizer pool to measure time spent finalizing (summed over groups, `timing/finalize_s`).

    `clock` is injectable so a test can read the sum exactly."""

    def __init__(self, pool: FinalizerPool, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.seconds = 0.0
        self._clock = clock

    async def finalize_group(self, items: Sequence[RolloutEvidence]) -> list[FinalizeOutcome]:
        t0 = self._clock()
        try:
            return await self.pool.finalize_group(items)
        finally:
            self.seconds += self._clock() - t0


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
    resumed_from: TrainerState | None = None  # the checkpoint's state (the async loop restores its prompt ledger)

    def close(self) -> None:
        """Stop everything this run started (idempotent per component; blocking: sync callers)."""
        self.logger.close()
        self.policy.kill()
        if self.pool is not None:
            self.pool.shutdown()
        self.stack.stop()

    async def aclose(self) -> None:
        """`close()` from a coroutine: the Gym client closes on this loop, the rest off it."""
        if self.stack.env is not None:
            await self.stack.env.aclose()
        await asyncio.to_thread(self.close)


def probe_sequence(tokenizer_eos: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length - 1)] + [tokenizer_eos]


def venv_record(flavor: str, workers: Sequence[dict]) -> dict:
    """`generation/venv` of run_info.json: the venv the driver's spec names, and what each worker ran in."""
    spec = vllm_spec(flavor)
    digest = spec_hash(spec)
    return {"flavor": flavor, "spec": spec.name, "spec_hash": digest,
            "folder": venv_folder_name(spec.name, digest), "workers": list(workers)}


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
        measured_others = actor_node_ids(list(others.values()), timeout_s, actor=", ".join(sorted(others)))
    except (ActorCallTimeoutError, ActorDiedError) as e:
        raise GRPOError(f"asking {sorted(others)} which node they run on failed within {timeout_s:g}s: {e.cause}",
                        kind="placement") from e
    actors = {"policy": policy.node_id(), **dict(zip(others, measured_others))}
    return {
        "nodes": stack.nodes,
        "workers": [
            {"worker": i, "planned_node": planned, "node": node, "base_url": url}
            for i, (planned, node, url) in enumerate(zip(workers.planned_nodes, measured, workers.base_urls))
        ],
        "actors": actors,
    }


def _own_pid(_actor: object) -> int:
    return os.getpid()


def component_pids(stack: Stack, pool: FinalizerPool | None, timeout_s: float) -> dict[str, int]:
    """run_info.json `components`: the pid of every watched component by its watch name (Ray actors
    asked with one bounded call; engine cores as their worker reports them), for operators and
    chaos tests."""
    pids = dict(stack.env.servers.pids()) if stack.env is not None else {}
    actors = {}
    if stack.workers is not None:
        actors.update({worker_name(i): h for i, h in enumerate(stack.workers.handles)})
    if stack.data_plane is not None:
        actors.update(stack.data_plane.actors())
    if pool is not None:
        actors.update(pool.actors())
    refs = [handle.__ray_call__.remote(_own_pid) for handle in actors.values()]
    pids.update(zip(actors, call_with_deadline(refs, actor=", ".join(actors), op="pid", timeout_s=timeout_s)))
    if stack.workers is not None:
        pids.update(stack.workers.engine_core_pids())
    return pids


def restore_from_checkpoint(run: GRPORun, resume: ResumePoint) -> dict:
    """Policy + optimizer, engine weights and version, loop state and driver RNG from `resume`.

    Returns the facts recorded under `resume` in run_info.json; `run.resume_metrics` (the first
    resumed step's `resume/*` metrics) is set from them. Blocking (Ray calls).
    """
    state = resume.state
    info = run.policy.load_state(resume.folder / POLICY_SUBDIR)
    saved = (state.policy_steps_taken, state.policy_fingerprint, state.optimizer_fingerprint)
    if (info.steps_taken, info.policy_fingerprint, info.optimizer_fingerprint) != saved:
        raise CheckpointError(
            f"{resume.folder}: the policy restored {info} but the trainer state recorded steps_taken, policy and "
            f"optimizer fingerprints {saved} (fix: the policy/ folder belongs to another checkpoint; delete {resume.folder})",
            kind="mismatch",
        )
    initial_probe = run.previous_engine_probe
    # The killed run's refit scratch (never a checkpoint); only our step_* folders, since
    # grpo.refit_dir may name a folder that holds other things too.
    for stale in sorted(run.weights_root.glob("step_*")):
        shutil.rmtree(stale)
    assert run.stack.workers is not None
    refit = refit_to(
        run.policy, run.stack.workers, run.weights_root / f"step_{state.step}", state.weight_version, run.probe,
        context=f"resume from step {state.step}: refit to the saved weight version {state.weight_version}",
    )
    run.served_version = refit.version
    engine_probe = list(refit.engine_probe)
    run.previous_engine_probe = engine_probe
    run.masked_streak = state.masked_streak
    run.start_step = state.step + 1
    run.resumed_from = state
    run.worker_calls = run.stack.workers.served_calls()
    restore_rng_states(state.rng)
    run.resume_metrics = {
        "resume/from_step": float(state.step),
        # The engine serves the restored weights: its probe equals the one it gave at save time ...
        "resume/engine_probe_vs_saved_max_abs_diff": max_abs_diff(engine_probe, state.engine_probe),
        # ... agrees with the restored trainer, and moved off the initial weights it started with.
        "resume/engine_trainer_max_abs_diff": refit.engine_trainer_max_abs_diff,
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


@dataclass(frozen=True)
class RunStart:
    """What the live stack says before the first step: the run's records and the engines' state."""

    probe: tuple[int, ...]  # the refit probe sequence (`probe_sequence`)
    run_info: dict  # run_info.json without `resume`: `generation/venv`, `placement`, `components`
    served_version: int  # the one weight version every worker starts from
    engine_probe: tuple[float, ...]  # the first engine's logprobs of `probe`
    worker_calls: tuple[int, ...]  # each worker's served-call counter


def read_run_start(stack: Stack, policy: RayPolicyClient, pool: FinalizerPool | None, cfg: MasterConfig,
                   flavor: str, model_dir: Path) -> RunStart:
    """`RunStart` from the live actors (blocking Ray calls: run it off the event loop)."""
    from transformers import AutoTokenizer

    assert stack.workers is not None
    eos = AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id
    probe = probe_sequence(eos, cfg.grpo.refit_probe_tokens, cfg.grpo.seed)
    run_info: dict = {"generation/venv": venv_record(flavor, stack.workers.venv_info()),
                      "placement": placement_record(stack, policy, pool, cfg.generation.vllm.call_timeout_s),
                      "components": component_pids(stack, pool, cfg.generation.vllm.call_timeout_s)}
    initial_versions = set(stack.workers.weight_versions())
    if len(initial_versions) != 1:
        raise GRPOError(f"the generation workers start from different weight versions {sorted(initial_versions)}",
                        kind="stale_weights")
    return RunStart(probe=tuple(probe), run_info=run_info, served_version=initial_versions.pop(),
                    engine_probe=tuple(stack.workers.prompt_logprobs(probe)[0]),
                    worker_calls=tuple(stack.workers.served_calls()))


async def setup(
    cfg: MasterConfig, progress: Callable[[str], None] = print, resume: ResumePoint | None = None
) -> GRPORun:
    """Model, prompt source, stack, policy, finalizer pool, rollout manager; with `resume`, the
    checkpoint restored (`restore_from_checkpoint`). Stops what it started on failure."""
    log_dir = Path(cfg.logger.log_dir)
    # Absolute: actors (on any node) resolve a relative path against their own working dir.
    model_dir = model_path(cfg.model).resolve()
    # Before Ray or any venv: a GPU recipe on a host without enough GPUs fails here, by name.
    flavor = resolve_flavor(cfg.generation, extra_gpus=int(cfg.policy.device == "cuda"))
    pcfg = policy_config(cfg, str(model_dir), flavor)  # the flavor is what the export is for
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
        # Capture rows reach the policy through the train partition; legacy rows as the driver's TrainBatch.
        policy = RayPolicyClient.spawn(pcfg, data_plane=cfg.data_plane if capture.enabled else None)
        weights_root = refit_root(cfg)
        await asyncio.to_thread(check_refit_dir_shared, stack, policy, weights_root)
        finalizer = cleaner = watch = train_cleaner = None
        if capture.enabled:
            rows_factory = TQTrainRowsFactory(cfg.data_plane, capture.train_partition, capture.stage_timeout_s,
                                              carry_prompt_ids=cfg.logger.dump_first_call_prompt_ids)
            train_cleaner = TrainRowCleaner(stack.client, capture.train_partition, capture.stage_timeout_s)
            pool = FinalizerPool.from_config(capture, TQSourceFactory.from_config(cfg.data_plane, capture), rows_factory)
            await pool.wait_ready(cfg.data_plane.startup_timeout_s)
            finalizer = TimedFinalizer(pool)
            cleaner = TQStagingCleaner(stack.client, capture.staging_partition, capture.stage_timeout_s)
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
            served=stack.workers.served if cfg.token_capture.enabled else None,
            health=watch,
        )
        start = await asyncio.to_thread(read_run_start, stack, policy, pool, cfg, flavor, model_dir)
        run = GRPORun(
            cfg=cfg, stack=stack, policy=policy, manager=manager, prompts=prompts, logger=MetricsLogger(cfg.logger),
            progress=progress, weights_root=weights_root, probe=list(start.probe), pool=pool, finalizer=finalizer,
            cleaner=cleaner, watch=watch, train_cleaner=train_cleaner,
            previous_engine_probe=list(start.engine_probe), served_version=start.served_version,
            worker_calls=list(start.worker_calls),
        )
        # The run id prefixes every rollout id; fresh per launch, so a resumed run's ids are new too.
        run_info = {"run_id": manager.run_id, **start.run_info}
        if resume is not None:
            run_info["resume"] = await asyncio.to_thread(restore_from_checkpoint, run, resume)
        write_run_info(log_dir, run_info)
        return run
    except BaseException:
        if run is not None:
            await run.aclose()
        else:
            if stack.env is not None:  # its HTTP session closes on this loop, before the blocking rest
                await stack.env.aclose()
            await asyncio.to_thread(_stop_started, stack, policy, pool)
        raise


def _stop_started(stack: Stack, policy: RayPolicyClient | None, pool: FinalizerPool | None) -> None:
    """What a failed `setup` started, stopped in reverse order (blocking: off the event loop)."""
    if policy is not None:
        policy.kill()
    if pool is not None:
        pool.shutdown()
    stack.stop()
