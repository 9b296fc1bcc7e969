"""A real two-node Ray cluster on this one host, for multi-node tests.

`two_node_cluster(head_cpus, second_cpus)` starts, in this process, a Ray head (node IP 127.0.0.1) and a
second node whose node IP is 127.0.0.2 (`ray.cluster_utils.Cluster`: each node its own raylet,
object store and workers; one GCS). On Linux every 127/8 address is this host's loopback, so the
second node has its own IP, as a real second machine would, while nothing needs a routable
address: a worker that binds `node_ip` there listens on 127.0.0.2 and the test can tell the two
nodes' endpoints apart. (Ray's raylet of a node whose IP is not 127.0.0.1 listens on all
interfaces, on OS-picked ports, for the lifetime of the test.)

Isolation: the nodes live in a fresh short temp dir, also set as `RAY_TMPDIR` while the cluster
runs, so the address file Ray's test cluster writes (and removes) is in that dir, never in the
host-wide default. On exit the nodes are stopped by the cluster object that started them (it
kills exactly its own processes; never `ray stop`), then `RAY_TMPDIR` is restored and the dir
removed. It needs `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` in this process before ray is imported
(`tests/conftest.py` and `nemo_rl` set it when no RAY_ADDRESS is given), which keeps the head's sockets on 127.0.0.1; a driver subprocess
joining the cluster needs it too (`driver_env`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import nemo_rl  # noqa: F401  (sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER before ray is imported)
from nemo_rl.distributed.ray_cluster import check_temp_dir

SECOND_NODE_IP = "127.0.0.2"
OBJECT_STORE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class TwoNodes:
    address: str  # the GCS host:port to join
    head_node_id: str
    second_node_id: str
    temp_dir: str

    def driver_env(self, base: dict[str, str]) -> dict[str, str]:
        """Environment for a driver subprocess that joins this cluster through RAY_ADDRESS."""
        return {**base, "RAY_ADDRESS": self.address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@contextmanager
def two_node_cluster(head_cpus: int = 1, second_cpus: int = 1) -> Iterator[TwoNodes]:
    """Logical CPUs per node decide where Ray may put actors that need one (e.g. head_cpus=0 keeps
    every CPU-reserving actor off the driver's node)."""
    import ray._private.ray_constants as ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(
            "two_node_cluster needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before ray is imported (nemo_rl sets it when "
            "RAY_ADDRESS is unset); without it the head binds the host's routable IP"
        )
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="nrl-2n")
    check_temp_dir(temp_dir)
    os.makedirs(os.path.join(temp_dir, "ray"))  # Ray's default temp dir under RAY_TMPDIR
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir
    cluster = None
    try:
        common = {"temp_dir": temp_dir, "object_store_memory": OBJECT_STORE_BYTES}
        cluster = Cluster(initialize_head=True, head_node_args={**common, "num_cpus": head_cpus, "include_dashboard": False})
        second = cluster.add_node(**common, num_cpus=second_cpus, node_ip_address=SECOND_NODE_IP)
        yield TwoNodes(
            address=cluster.address,
            head_node_id=cluster.head_node.node_id,
            second_node_id=second.node_id,
            temp_dir=temp_dir,
        )
    finally:
        if cluster is not None:
            cluster.shutdown()
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(temp_dir, ignore_errors=True)
