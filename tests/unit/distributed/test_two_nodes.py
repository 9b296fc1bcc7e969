"""A real two-node Ray cluster on this host (`tests/two_node_cluster.py`): the stack's Ray step
accepts it only with node_ip binds (and disconnects when it refuses), and vLLM worker actors land
on the nodes the placement plan names, each listening on and advertising its own node's IP.

The worker actors are the real `VllmGenerationWorker` class pinned exactly as `spawn_workers`
pins them (`node_affinity(plan[i])`), run in the project interpreter and only bound (no engine):
what is under test is where they run and where they listen, not vLLM.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import ray

from nemo_rl.algorithms.setup import start_ray_for_stack
from nemo_rl.data_plane import DataPlaneConfig
from nemo_rl.distributed.errors import RayClusterError
from nemo_rl.distributed.placement import actor_node_ids, alive_nodes, node_affinity, plan_worker_placement
from nemo_rl.distributed.shared_fs import remove_probe, write_probe
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker
from nemo_rl.token_capture.config import TokenCaptureConfig
from tests.two_node_cluster import SECOND_NODE_IP, TwoNodes, two_node_cluster

CAPTURE_ON = TokenCaptureConfig(enabled=True)
NODE_IP = GenerationConfig.model_validate({"vllm": {"bind": "node_ip"}})


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodes]:
    with two_node_cluster(head_cpus=1, second_cpus=1) as nodes:
        yield nodes


def test_loopback_binds_are_refused_by_name_and_the_driver_disconnects(cluster: TwoNodes) -> None:
    with pytest.raises(RayClusterError) as e:
        start_ray_for_stack(2, cluster.address, generation=GenerationConfig(), data_plane=DataPlaneConfig(),
                            token_capture=CAPTURE_ON)
    assert e.value.kind == "bind"
    assert re.fullmatch(
        rf"the Ray cluster at {re.escape(cluster.address)} has 2 alive nodes, but generation.vllm.bind=loopback .*; "
        r"and data_plane.bind=loopback .* \(fix: override generation.vllm.bind=node_ip data_plane.bind=node_ip on a "
        r"trusted network, .*; or launch with --nodes 1\)", str(e.value))
    assert not ray.is_initialized()
    # One knob right is not enough with capture on (the data plane runs).
    with pytest.raises(RayClusterError, match=r"has 2 alive nodes, but data_plane.bind=loopback") as e:
        start_ray_for_stack(2, cluster.address, generation=NODE_IP, data_plane=DataPlaneConfig(), token_capture=CAPTURE_ON)
    assert e.value.kind == "bind"
    assert not ray.is_initialized()


async def _statuses(urls: list[str]) -> list[tuple[int, str]]:
    async def one(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        async with session.get(url) as resp:
            return resp.status, (await resp.json())["error"]["type"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        return list(await asyncio.gather(*(one(session, url) for url in urls)))


def test_node_ip_binds_are_accepted_and_workers_land_where_the_plan_says(cluster: TwoNodes, tmp_path: Path) -> None:
    handle, nodes = start_ray_for_stack(
        2, cluster.address, generation=NODE_IP, data_plane=DataPlaneConfig(bind="node_ip"), token_capture=CAPTURE_ON
    )
    actors = []
    try:
        assert nodes == 2 and handle.joined
        driver_node = ray.get_runtime_context().get_node_id()
        assert driver_node == cluster.head_node_id
        order = alive_nodes(driver_node)
        assert [(n.node_id, n.ip) for n in order] == [(cluster.head_node_id, "127.0.0.1"),
                                                      (cluster.second_node_id, SECOND_NODE_IP)]
        plan = plan_worker_placement(3, order, NODE_IP.vllm.placement, 0)
        assert plan == [cluster.head_node_id, cluster.second_node_id, cluster.head_node_id]

        actor_cls = ray.remote(num_cpus=0)(VllmGenerationWorker)
        actors = [actor_cls.options(**node_affinity(plan[i])).remote("/nonexistent", NODE_IP.model_dump(), {}, None,
                                                                     worker_index=i) for i in range(3)]
        assert actor_node_ids(actors, timeout_s=120) == plan
        urls = ray.get([a.bind.remote("per-run-token-for-this-test-0123") for a in actors], timeout=120)
        hosts = [re.fullmatch(r"http://([0-9.]+):\d+/v1", url).group(1) for url in urls]
        assert hosts == ["127.0.0.1", SECOND_NODE_IP, "127.0.0.1"]
        # Each advertised URL is where that worker listens: the driver reaches all three.
        answers = asyncio.run(_statuses([f"{u}/models" for u in urls]))
        assert answers == [(503, "worker_starting")] * 3
        # Both nodes read a folder the driver wrote (one host, so it is shared).
        probe = write_probe(tmp_path / "refit")
        try:
            assert ray.get([a.check_shared_dir.remote(probe, "grpo.refit_dir") for a in actors], timeout=60) == [None] * 3
        finally:
            remove_probe(probe)
    finally:
        if actors:
            ray.get([a.shutdown.remote() for a in actors], timeout=60)
            for a in actors:
                ray.kill(a)
        handle.shutdown()
    assert not ray.is_initialized()
    assert os.environ["RAY_TMPDIR"] == cluster.temp_dir  # the cluster's own dir, until the fixture ends
