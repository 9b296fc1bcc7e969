"""The data plane's set-up (`plane`): one deployment per Ray cluster, and a client attached in other processes."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch

from nemo_rl.data_plane import DataPlane, DataPlaneClient, DataPlaneConfig, DataPlaneError, start_data_plane


@ray.remote(num_cpus=0)
class _RemoteUser:
    """A Ray actor that attaches its own client (another process of the same job)."""

    def round_trip(self, cfg_json: str) -> tuple[list[int], str]:
        from nemo_rl.data_plane import DataPlaneConfig, attach_client

        remote = attach_client(DataPlaneConfig.model_validate_json(cfg_json))
        (row,) = remote.get("xproc", ["driver"], ["ids", "tag"])
        remote.put("xproc", "actor", {"ids": torch.tensor([42, 43], dtype=torch.int64), "tag": "from-actor"})
        remote.close()
        return row["ids"].tolist(), row["tag"]


def test_actor_process_attaches_reads_and_writes(client: DataPlaneClient, cfg: DataPlaneConfig) -> None:
    client.put("xproc", "driver", {"ids": torch.tensor([5, 6, 7]), "tag": "from-driver"})
    user = _RemoteUser.remote()
    assert ray.get(user.round_trip.remote(cfg.model_dump_json()), timeout=180) == ([5, 6, 7], "from-driver")
    ray.kill(user)
    (row,) = client.get("xproc", ["actor"], ["ids", "tag"])
    assert (row["ids"].tolist(), row["tag"]) == ([42, 43], "from-actor")


@ray.remote(num_cpus=0)
class _AsyncUser:
    """An asyncio actor, as the vLLM worker is: Ray warns about any blocking `ray.get` in its process."""

    async def round_trip(self, cfg_json: str, use_async_attach: bool) -> tuple[str, bool]:
        import ray._private.worker as ray_worker

        from nemo_rl.data_plane import DataPlaneConfig, attach_client, attach_client_async

        cfg = DataPlaneConfig.model_validate_json(cfg_json)
        if use_async_attach:
            remote = await attach_client_async(cfg)
        else:  # what the worker did before: the sync attach, off the event loop
            remote = await asyncio.to_thread(attach_client, cfg)
        (row,) = await asyncio.to_thread(remote.get, "xproc", ["driver-async"], ["tag"])
        await asyncio.to_thread(remote.close)
        return row["tag"], ray_worker.blocking_get_inside_async_warned


def test_an_async_actor_attaches_without_any_blocking_ray_get(client: DataPlaneClient, cfg: DataPlaneConfig) -> None:
    client.put("xproc", "driver-async", {"tag": "from-driver"})
    for use_async_attach, warned in [(True, False), (False, True)]:  # the sync attach is the control: it warns
        user = _AsyncUser.remote()
        result = ray.get(user.round_trip.remote(cfg.model_dump_json(), use_async_attach), timeout=180)
        ray.kill(user)
        assert result == ("from-driver", warned), use_async_attach


def test_second_data_plane_in_one_cluster_is_refused(plane: DataPlane, cfg: DataPlaneConfig) -> None:
    with pytest.raises(DataPlaneError, match="already runs in this Ray cluster"):
        start_data_plane(cfg)
    assert not plane.stopped
