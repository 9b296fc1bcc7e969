"""init_local_ray: a private Ray instance with a short temp dir and nemo_rl importable in actors."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import ray

from nemo_rl.distributed.ray_cluster import (
    MAX_TEMP_DIR_CHARS,
    RayClusterError,
    check_temp_dir,
    init_local_ray,
    job_runtime_env,
    repo_root,
)


def test_repo_root_holds_the_package() -> None:
    assert (repo_root() / "nemo_rl" / "distributed" / "ray_cluster.py").is_file()


def test_job_runtime_env_puts_repo_root_first_once() -> None:
    root = Path("/repo")
    assert job_runtime_env(root, None) == {"env_vars": {"PYTHONPATH": "/repo"}}
    inherited = os.pathsep.join(["/a", "/repo", "", "/b"])
    assert job_runtime_env(root, inherited) == {"env_vars": {"PYTHONPATH": os.pathsep.join(["/repo", "/a", "/b"])}}


def test_temp_dir_must_be_absolute_and_short() -> None:
    check_temp_dir("/t/" + "x" * (MAX_TEMP_DIR_CHARS - 3))
    with pytest.raises(RayClusterError, match="must be an absolute path"):
        check_temp_dir("relative/dir")
    too_long = "/t/" + "x" * MAX_TEMP_DIR_CHARS
    with pytest.raises(RayClusterError, match=f"is {len(too_long)} chars"):
        check_temp_dir(too_long)


def test_num_cpus_must_be_a_positive_int() -> None:
    with pytest.raises(RayClusterError, match="num_cpus must be an int >= 1, got 0"):
        init_local_ray(0)


@ray.remote(num_cpus=0)
def _actor_environment() -> tuple[str, str]:
    import nemo_rl

    return os.environ["PYTHONPATH"].split(os.pathsep)[0], nemo_rl.__file__


def test_private_cluster_lifecycle() -> None:
    previous = os.environ.get("RAY_TMPDIR")
    handle = init_local_ray(num_cpus=2)
    try:
        assert len(handle.temp_dir) <= MAX_TEMP_DIR_CHARS
        assert os.path.dirname(handle.temp_dir) == tempfile.gettempdir()
        assert os.environ["RAY_TMPDIR"] == handle.temp_dir
        assert ray.cluster_resources()["CPU"] == 2.0
        first_path, package_file = ray.get(_actor_environment.remote(), timeout=120)
        assert first_path == str(repo_root())
        assert package_file == str(repo_root() / "nemo_rl" / "__init__.py")
        with pytest.raises(RayClusterError, match="already initialized"):
            init_local_ray(num_cpus=1)
    finally:
        handle.shutdown()
    assert not ray.is_initialized()
    assert handle.stopped
    assert not os.path.exists(handle.temp_dir)
    assert os.environ.get("RAY_TMPDIR") == previous
    handle.shutdown()
