"""Where the vLLM generation workers run: a placement plan over the cluster's alive nodes.

`plan_worker_placement` is pure: `spread` puts worker i on the i-th node with room, round-robin
over nodes in a fixed order (the driver's node first), so a cluster gets the same plan every
run; `ray` leaves scheduling to Ray. Not enough room is a `RayClusterError` (kind `placement`)
naming the knobs.
`node_affinity` pins an actor hard (an actor whose node dies is never silently moved);
`alive_nodes` and `actor_node_ids` read the cluster and measure where actors run (bounded).
What runs where: docs/guides/launching.md ("Multi-node"); the contract in full:
docs/design-docs/distributed.md, "Where the vLLM workers run".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nemo_rl.distributed.errors import RayClusterError

Placement = Literal["spread", "ray"]


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    gpus: float  # the node's total GPU resource as Ray reports it


def order_nodes(nodes: Sequence[NodeInfo], driver_node_id: str) -> list[NodeInfo]:
    """The driver's node first (it hosts the Gym gate), then the rest by (IP, node id)."""
    return sorted(nodes, key=lambda n: (n.node_id != driver_node_id, n.ip, n.node_id))


def _capacity(node: NodeInfo, gpus_per_worker: int) -> int | None:
    """Workers a node can host; None = unbounded (a CPU worker reserves no Ray resource)."""
    if gpus_per_worker == 0:
        return None
    return int(node.gpus // gpus_per_worker)


def plan_worker_placement(
    num_workers: int, nodes: Sequence[NodeInfo], placement: Placement, gpus_per_worker: int
) -> list[str | None]:
    """The node id each worker is pinned to (worker order), or None entries for placement=ray."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if placement == "ray":
        return [None] * num_workers
    if placement != "spread":
        raise ValueError(f"placement={placement!r} is not one of ('spread', 'ray')")
    if not nodes:
        raise RayClusterError("the Ray cluster reports no alive node to place the vLLM workers on", kind="placement")
    room = {n.node_id: _capacity(n, gpus_per_worker) for n in nodes}
    plan: list[str | None] = []
    cursor = 0  # the next node in round-robin order; full nodes are skipped
    for _ in range(num_workers):
        for _ in range(len(nodes)):
            node = nodes[cursor % len(nodes)]
            cursor += 1
            if room[node.node_id] is None or room[node.node_id] > 0:
                break
        else:
            total = sum(_capacity(n, gpus_per_worker) or 0 for n in nodes)
            raise RayClusterError(
                f"generation.num_workers={num_workers} workers of {gpus_per_worker} GPU(s) each "
                f"(generation.vllm.tensor_parallel_size) do not fit the cluster: its {len(nodes)} alive node(s) "
                f"have room for {total} (GPUs per node: {', '.join(f'{n.ip}={n.gpus:g}' for n in nodes)}) "
                "(fix: lower generation.num_workers, add nodes with GPUs, or set generation.vllm.placement=ray "
                "to let Ray queue them)",
                kind="placement",
            )
        plan.append(node.node_id)
        if room[node.node_id] is not None:
            room[node.node_id] -= 1
    return plan


def node_affinity(node_id: str | None) -> dict[str, Any]:
    """Actor options pinning it to `node_id` (hard affinity), or none for None."""
    if node_id is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


def alive_nodes(driver_node_id: str) -> list[NodeInfo]:
    """The connected cluster's alive nodes, in `order_nodes` order."""
    import ray

    nodes = [
        NodeInfo(node_id=n["NodeID"], ip=n["NodeManagerAddress"], gpus=float(n.get("Resources", {}).get("GPU", 0.0)))
        for n in ray.nodes()
        if n["Alive"]
    ]
    return order_nodes(nodes, driver_node_id)


def _own_node_id(_actor: object) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def actor_node_ids(handles: Sequence[Any], timeout_s: float, *, actor: str = "actors") -> list[str]:
    """The node id each actor runs on, measured inside the actor (one call each, bounded); a
    failure is an `ActorCallError` naming `actor`."""
    from nemo_rl.distributed.actor_call import call_with_deadline

    refs = [h.__ray_call__.remote(_own_node_id) for h in handles]
    return list(call_with_deadline(refs, actor=actor, op="node_id", timeout_s=timeout_s))
