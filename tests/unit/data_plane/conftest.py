"""The session's shared Ray cluster and data plane (tests/unit/conftest.py), as `plane` and `client`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nemo_rl.data_plane import DataPlane, DataPlaneClient, DataPlaneConfig, attach_client

# Short client deadline so a broken test fails in seconds, not the production 30 s: the shared
# plane's own (`TQ_TEST_CONFIG`, call_timeout_s=10.0).
TEST_CFG = DataPlaneConfig(call_timeout_s=10.0)


@pytest.fixture(scope="module")
def cfg() -> DataPlaneConfig:
    return TEST_CFG


@pytest.fixture(scope="module")
def plane(shared_plane: DataPlane) -> DataPlane:
    return shared_plane


@pytest.fixture(scope="module")
def client(plane: DataPlane) -> Iterator[DataPlaneClient]:
    attached = attach_client(TEST_CFG)
    try:
        yield attached
    finally:
        attached.close()
