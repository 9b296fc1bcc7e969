"""Where endpoints listen (`listen_host`, `http_base_url`) and which clusters the binds allow."""

from __future__ import annotations

import pytest

from nemo_rl.distributed.errors import RayClusterError
from nemo_rl.distributed.topology import check_cluster_binds, http_base_url, listen_host


def test_loopback_ignores_the_node_ip_and_node_ip_uses_it() -> None:
    assert listen_host("loopback", "10.1.2.3") == "127.0.0.1"
    assert listen_host("loopback", "") == "127.0.0.1"
    assert listen_host("node_ip", "10.1.2.3") == "10.1.2.3"
    assert listen_host("node_ip", "fd00::2") == "fd00::2"


def test_node_ip_without_an_ip_and_unknown_binds_are_errors() -> None:
    with pytest.raises(ValueError, match=r"^bind=node_ip needs the node's IP as Ray reports it, got an empty string$"):
        listen_host("node_ip", "")
    with pytest.raises(ValueError, match=r"^bind='any' is not one of \('loopback', 'node_ip'\)$"):
        listen_host("any", "10.1.2.3")  # type: ignore[arg-type]


def test_base_url_brackets_ipv6_hosts() -> None:
    assert http_base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/v1"
    assert http_base_url("10.0.0.7", 1, path="") == "http://10.0.0.7:1"
    assert http_base_url("fd00::2", 9000) == "http://[fd00::2]:9000/v1"


@pytest.mark.parametrize("vllm_bind", ["loopback", "node_ip"])
@pytest.mark.parametrize("dp_bind", ["loopback", "node_ip"])
def test_one_node_accepts_every_bind(vllm_bind: str, dp_bind: str) -> None:
    assert check_cluster_binds(1, vllm_bind=vllm_bind, data_plane_bind=dp_bind, data_plane_used=True,
                               address="h:1") is None


def test_several_nodes_accept_node_ip_binds_and_ignore_an_unused_data_plane() -> None:
    assert check_cluster_binds(3, vllm_bind="node_ip", data_plane_bind="node_ip", data_plane_used=True,
                               address="h:1") is None
    # Capture off: no data plane runs, so its bind does not matter.
    assert check_cluster_binds(2, vllm_bind="node_ip", data_plane_bind="loopback", data_plane_used=False,
                               address="h:1") is None


VLLM_WHY = ("generation.vllm.bind=loopback (a vLLM worker on another node would listen on that node's 127.0.0.1, "
            "which the Gym gate on the driver's node cannot reach)")
DP_WHY = ("data_plane.bind=loopback (a TransferQueue actor on another node would listen on that node's 127.0.0.1, "
          "which workers, finalizers and the policy elsewhere cannot reach)")
TAIL = ("on a trusted network, since neither the worker's generation routes nor TransferQueue have "
        "authentication; or launch with --nodes 1)")


def test_refusal_names_both_loopback_knobs_and_the_fix() -> None:
    with pytest.raises(RayClusterError) as e:
        check_cluster_binds(2, vllm_bind="loopback", data_plane_bind="loopback", data_plane_used=True,
                            address="10.0.0.1:6379")
    assert e.value.kind == "bind"
    assert str(e.value) == (
        f"the Ray cluster at 10.0.0.1:6379 has 2 alive nodes, but {VLLM_WHY}; and {DP_WHY} "
        f"(fix: override generation.vllm.bind=node_ip data_plane.bind=node_ip {TAIL}"
    )


def test_refusal_names_only_the_knob_at_fault() -> None:
    with pytest.raises(RayClusterError) as e:
        check_cluster_binds(2, vllm_bind="node_ip", data_plane_bind="loopback", data_plane_used=True, address="h:1")
    assert e.value.kind == "bind"
    assert str(e.value) == (
        f"the Ray cluster at h:1 has 2 alive nodes, but {DP_WHY} "
        f"(fix: override generation.vllm.bind=node_ip data_plane.bind=node_ip {TAIL}"
    )
    with pytest.raises(RayClusterError) as e:
        check_cluster_binds(4, vllm_bind="loopback", data_plane_bind="node_ip", data_plane_used=False, address="h:1")
    assert e.value.kind == "bind"
    assert str(e.value) == (
        f"the Ray cluster at h:1 has 4 alive nodes, but {VLLM_WHY} "
        f"(fix: override generation.vllm.bind=node_ip {TAIL}"
    )
