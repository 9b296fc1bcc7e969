"""Which addresses the stack's endpoints listen on, and whether a cluster fits those choices.

Two knobs, `generation.vllm.bind` and `data_plane.bind`, are each `loopback` (the default) or
`node_ip` (trusted networks only: neither endpoint authenticates generation or TQ traffic).
`listen_host` is the host a server binds AND advertises, one address, never 0.0.0.0 or a guess.
`check_cluster_binds` accepts a multi-node cluster only when every endpoint another node must
reach binds `node_ip`, else a `RayClusterError` (kind `bind`) naming each knob and the fix. The
Gym servers stay on loopback whatever the knobs. Pure and Ray-free.
See docs/design-docs/distributed.md, "Which addresses endpoints listen on".
"""

from __future__ import annotations

from typing import Literal

from nemo_rl.distributed.errors import RayClusterError

Bind = Literal["loopback", "node_ip"]
LOOPBACK_IP = "127.0.0.1"
BIND_CHOICES: tuple[str, ...] = ("loopback", "node_ip")


def listen_host(bind: Bind, node_ip: str) -> str:
    """The address to listen on and advertise: 127.0.0.1 for `loopback`, `node_ip` for `node_ip`."""
    if bind == "loopback":
        return LOOPBACK_IP
    if bind == "node_ip":
        if not node_ip:
            raise ValueError("bind=node_ip needs the node's IP as Ray reports it, got an empty string")
        return node_ip
    raise ValueError(f"bind={bind!r} is not one of {BIND_CHOICES}")


def http_base_url(host: str, port: int, path: str = "/v1") -> str:
    """`http://host:port<path>`, with an IPv6 host in brackets."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


def check_cluster_binds(
    alive_nodes: int, *, vllm_bind: Bind, data_plane_bind: Bind, data_plane_used: bool, address: str
) -> None:
    """Accept the cluster at `address` with `alive_nodes` nodes, or raise `RayClusterError` (`bind`)."""
    if alive_nodes <= 1:
        return
    wrong = []
    if vllm_bind != "node_ip":
        wrong.append(
            f"generation.vllm.bind={vllm_bind} (a vLLM worker on another node would listen on that node's "
            "127.0.0.1, which the Gym gate on the driver's node cannot reach)"
        )
    if data_plane_used and data_plane_bind != "node_ip":
        wrong.append(
            f"data_plane.bind={data_plane_bind} (a TransferQueue actor on another node would listen on that "
            "node's 127.0.0.1, which workers, finalizers and the policy elsewhere cannot reach)"
        )
    if not wrong:
        return
    fix = " ".join(
        knob for knob, needed in (("generation.vllm.bind=node_ip", True), ("data_plane.bind=node_ip", data_plane_used))
        if needed
    )
    raise RayClusterError(
        f"the Ray cluster at {address} has {alive_nodes} alive nodes, but {'; and '.join(wrong)} "
        f"(fix: override {fix} on a trusted network, since neither the worker's generation routes nor "
        "TransferQueue have authentication; or launch with --nodes 1)",
        kind="bind",
    )
