"""The vLLM workers' placement plan: node order, round-robin spread, GPU room, pinning options."""

from __future__ import annotations

import pytest
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_rl.distributed.errors import RayClusterError
from nemo_rl.distributed.placement import NodeInfo, node_affinity, order_nodes, plan_worker_placement

HEAD = NodeInfo("n-head", "10.0.0.9", 0.0)
B = NodeInfo("n-b", "10.0.0.2", 0.0)
C = NodeInfo("n-c", "10.0.0.3", 0.0)


def test_the_driver_node_comes_first_then_ip_then_id() -> None:
    twin = NodeInfo("n-a", "10.0.0.2", 0.0)  # same IP as B: the node id breaks the tie
    assert [n.node_id for n in order_nodes([C, B, HEAD, twin], "n-head")] == ["n-head", "n-a", "n-b", "n-c"]
    assert [n.node_id for n in order_nodes([C, B, HEAD], "n-c")] == ["n-c", "n-b", "n-head"]


def test_spread_pins_cpu_workers_round_robin() -> None:
    nodes = order_nodes([B, HEAD], "n-head")
    assert plan_worker_placement(1, nodes, "spread", 0) == ["n-head"]
    assert plan_worker_placement(2, nodes, "spread", 0) == ["n-head", "n-b"]
    assert plan_worker_placement(5, nodes, "spread", 0) == ["n-head", "n-b", "n-head", "n-b", "n-head"]
    assert plan_worker_placement(3, [HEAD], "spread", 0) == ["n-head", "n-head", "n-head"]


def test_spread_puts_gpu_workers_only_where_their_gpus_fit() -> None:
    head = NodeInfo("n-head", "10.0.0.9", 0.0)  # a CPU-only head: no GPU worker goes there
    g4 = NodeInfo("n-g4", "10.0.0.4", 4.0)
    g2 = NodeInfo("n-g2", "10.0.0.5", 2.0)
    nodes = order_nodes([g2, head, g4], "n-head")
    assert plan_worker_placement(3, nodes, "spread", 2) == ["n-g4", "n-g2", "n-g4"]
    assert plan_worker_placement(6, nodes, "spread", 1) == ["n-g4", "n-g2", "n-g4", "n-g2", "n-g4", "n-g4"]


def test_too_many_gpu_workers_fail_by_name() -> None:
    nodes = order_nodes([NodeInfo("n-g4", "10.0.0.4", 4.0), NodeInfo("n-h", "10.0.0.9", 0.0)], "n-h")
    with pytest.raises(RayClusterError) as e:
        plan_worker_placement(3, nodes, "spread", 2)
    assert e.value.kind == "placement"
    assert str(e.value) == (
        "generation.num_workers=3 workers of 2 GPU(s) each (generation.vllm.tensor_parallel_size) do not fit the "
        "cluster: its 2 alive node(s) have room for 2 (GPUs per node: 10.0.0.9=0, 10.0.0.4=4) (fix: lower "
        "generation.num_workers, add nodes with GPUs, or set generation.vllm.placement=ray to let Ray queue them)"
    )


def test_ray_placement_pins_nothing_and_bad_input_is_an_error() -> None:
    assert plan_worker_placement(3, [HEAD, B], "ray", 0) == [None, None, None]
    assert plan_worker_placement(2, [], "ray", 1) == [None, None]
    with pytest.raises(RayClusterError, match="^the Ray cluster reports no alive node to place the vLLM workers on$") as e:
        plan_worker_placement(1, [], "spread", 0)
    assert e.value.kind == "placement"
    with pytest.raises(ValueError, match=r"^num_workers must be >= 1, got 0$"):
        plan_worker_placement(0, [HEAD], "spread", 0)
    with pytest.raises(ValueError, match=r"^placement='pack' is not one of \('spread', 'ray'\)$"):
        plan_worker_placement(1, [HEAD], "pack", 0)  # type: ignore[arg-type]


def test_node_affinity_is_a_hard_pin_or_nothing() -> None:
    assert node_affinity(None) == {}
    node_id = "ab" * 28  # Ray checks the form of a node id: 28 bytes in hex
    options = node_affinity(node_id)
    assert list(options) == ["scheduling_strategy"]
    strategy = options["scheduling_strategy"]
    assert isinstance(strategy, NodeAffinitySchedulingStrategy)
    assert (strategy.node_id, strategy.soft) == (node_id, False)
