"""Bring the whole rollout stack up and down in order: Ray, data plane, vLLM workers, Gym servers.

Contract:
- `start_stack` first brings up Ray: a private local cluster of `num_cpus` CPUs or, when
  `RAY_ADDRESS` names one (`ultra_launch.sh` sets it inside a Slurm job), that existing cluster,
  which must offer at least `num_cpus` CPUs; stopping a joined stack only disconnects. A joined
  cluster of several nodes is accepted only when every endpoint another node must reach binds
  the node's IP (`generation.vllm.bind=node_ip`, and `data_plane.bind=node_ip` when token
  capture runs the data plane); otherwise `MultiNodeBindError` names the knobs and the fix
  (`nemo_rl.distributed.topology.check_cluster_binds`) and the driver disconnects. What runs
  where: the driver and the Gym servers (loopback, only the driver and they call them) on the
  driver's node; the vLLM workers as `generation.vllm.placement` plans them
  (`nemo_rl.distributed.placement`); TransferQueue's actors wherever Ray has room. Then it
  starts the vLLM generation workers in their
  flavored venv (ports open at once, answering 503; engines loading). While the engines load
  it starts the TransferQueue data plane (only when token capture is enabled: the staging
  partition lives there) and the Gym servers pointed at the first worker. Last, the workers
  install capture and start serving. Each step prints a progress line with its duration
  (`vllm_workers` counts from spawn, so it spans the overlapped steps); each has its own
  deadline in its config.
- `Stack.stop()` tears down exactly what was started, in reverse order, and is idempotent. If a
  start step fails, everything started before it is stopped before the error propagates.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nemo_rl.data_plane import DataPlane, DataPlaneClient, DataPlaneConfig, start_data_plane
from nemo_rl.distributed.ray_cluster import (
    RayClusterHandle,
    alive_node_count,
    ray_address_from_env,
    start_or_join_ray,
)
from nemo_rl.distributed.topology import check_cluster_binds
from nemo_rl.environments.nemo_gym import NemoGymConfig, NemoGymEnvironment
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.launcher import WorkerGroup, await_workers, spawn_workers
from nemo_rl.token_capture.config import TokenCaptureConfig


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
    raises `MultiNodeBindError` after disconnecting (`check_cluster_binds`).
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
        pending = spawn_workers(
            model_dir,
            generation,
            token_capture.model_dump(),
            data_plane.model_dump() if token_capture.enabled else None,
            progress=progress,
        )
        stack.workers = pending.group
        if token_capture.enabled:
            t_dp = time.monotonic()
            stack.data_plane = start_data_plane(data_plane)
            stack.client = DataPlaneClient.attach(data_plane)
            step("data_plane", t_dp)
        t_gym = time.monotonic()
        gate_urls = pending.base_urls if gym_worker_urls is None else gym_worker_urls(list(pending.base_urls))
        stack.env = NemoGymEnvironment(nemo_gym, token_capture, worker_base_url=gate_urls, log_dir=log_dir)
        await stack.env.start()
        step("gym_servers", t_gym)
        await_workers(pending, progress=progress)
        step("vllm_workers", t0)
    except BaseException:
        stack.stop()
        raise
    return stack
