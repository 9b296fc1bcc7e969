"""Module-scoped private Ray cluster + data plane: each test module gets its own, torn down after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nemo_rl.data_plane import DataPlane, DataPlaneClient, DataPlaneConfig, start_data_plane
from nemo_rl.distributed.ray_cluster import RayClusterHandle, init_local_ray

# Short client deadline so a broken test fails in seconds, not the production 30 s.
TEST_CFG = DataPlaneConfig(call_timeout_s=10.0)


@pytest.fixture(scope="module")
def cfg() -> DataPlaneConfig:
    return TEST_CFG


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayClusterHandle]:
    handle = init_local_ray(num_cpus=2)
    try:
        yield handle
    finally:
        handle.shutdown()


@pytest.fixture(scope="module")
def plane(ray_cluster: RayClusterHandle) -> Iterator[DataPlane]:
    started = start_data_plane(TEST_CFG)
    try:
        yield started
    finally:
        started.shutdown()


@pytest.fixture(scope="module")
def client(plane: DataPlane) -> Iterator[DataPlaneClient]:
    attached = DataPlaneClient.attach(TEST_CFG)
    try:
        yield attached
    finally:
        attached.close()
