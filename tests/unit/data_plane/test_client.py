"""DataPlaneClient against a real private Ray cluster and real TransferQueue actors."""

from __future__ import annotations

import struct

import pytest
import ray
import torch

from nemo_rl.data_plane import (
    DataPlane,
    DataPlaneClient,
    DataPlaneClosedError,
    DataPlaneConfig,
    DataPlaneError,
    FieldEncodingError,
    MissingKeysError,
    start_data_plane,
)

# Values whose float64 bits a lossy path would change: subnormals, -0.0, non-terminating fractions.
EXACT_FLOATS = [-0.0, 0.0, 1 / 3, -2.5e-8, 5e-324, -1.7976931348623157e308, 0.1 + 0.2, -123.456789012345678]


def bits(values: list[float]) -> list[bytes]:
    return [struct.pack(">d", v) for v in values]


def test_round_trip_is_exact(client: DataPlaneClient) -> None:
    row = {
        "ids": torch.tensor([0, 7, 2**62, 151_643], dtype=torch.int64),
        "logprobs": torch.tensor(EXACT_FLOATS, dtype=torch.float64),
        "meta": '{"rollout_id": "r1"}',
        "blob": b"\x00\xffraw",
    }
    client.put("exact", "r1/c1", row)
    (got,) = client.get("exact", ["r1/c1"], ["ids", "logprobs", "meta", "blob"])
    assert got["ids"].dtype == torch.int64
    assert got["ids"].tolist() == [0, 7, 2**62, 151_643]
    assert got["logprobs"].dtype == torch.float64
    floats = got["logprobs"].tolist()
    assert all(type(v) is float for v in floats)
    assert bits(floats) == bits(EXACT_FLOATS)
    assert got["meta"] == '{"rollout_id": "r1"}'
    assert got["blob"] == b"\x00\xffraw"


def test_get_returns_rows_in_request_order_with_repeats(client: DataPlaneClient) -> None:
    keys = [f"order/{i}" for i in range(6)]
    rows = [{"ids": torch.arange(i + 1, dtype=torch.int64), "tag": f"row{i}"} for i in range(6)]
    client.put_many("order", keys, rows)
    request = ["order/4", "order/0", "order/5", "order/0", "order/2"]
    got = client.get("order", request, ["tag", "ids"])
    assert [r["tag"] for r in got] == ["row4", "row0", "row5", "row0", "row2"]
    assert [r["ids"].tolist() for r in got] == [list(range(5)), [0], list(range(6)), [0], list(range(3))]


def test_put_overwrites_and_equal_length_rows_decode(client: DataPlaneClient) -> None:
    client.put_many("dense", ["a", "b"], [{"ids": torch.tensor([1, 2])}, {"ids": torch.tensor([3, 4])}])
    client.put("dense", "a", {"ids": torch.tensor([9, 9])})
    assert [r["ids"].tolist() for r in client.get("dense", ["a", "b"], ["ids"])] == [[9, 9], [3, 4]]


def test_missing_keys_are_named(client: DataPlaneClient) -> None:
    client.put_many("miss", ["m/1", "m/2"], [{"tag": "1"}, {"tag": "2"}])
    with pytest.raises(MissingKeysError) as info:
        client.get("miss", ["m/1", "m/absent", "m/2", "m/gone"], ["tag"])
    assert info.value.partition == "miss"
    assert info.value.missing_keys == ["m/absent", "m/gone"]
    assert "'m/absent', 'm/gone'" in str(info.value)
    with pytest.raises(MissingKeysError) as no_partition:
        client.get("never-created", ["m/1"], ["tag"])
    assert no_partition.value.missing_keys == ["m/1"]
    with pytest.raises(MissingKeysError) as no_field:
        client.get("miss", ["m/1"], ["not_a_field"])
    assert no_field.value.missing_keys == ["m/1"]
    assert no_field.value.fields == ["not_a_field"]


def test_list_and_clear(client: DataPlaneClient) -> None:
    client.put_many("retain", ["x", "y", "z"], [{"tag": "x"}, {"tag": "y"}, {"tag": "z"}])
    assert sorted(client.list_keys("retain")) == ["x", "y", "z"]
    client.clear("retain", ["x", "z", "never-written"])
    assert client.list_keys("retain") == ["y"]
    with pytest.raises(MissingKeysError):
        client.get("retain", ["x"], ["tag"])
    assert client.list_keys("no-such-partition") == []


def test_invalid_rows_fail_before_any_call(client: DataPlaneClient) -> None:
    with pytest.raises(FieldEncodingError, match="key 'bad' field 'ids': tensor dtype torch.int32"):
        client.put("p", "bad", {"ids": torch.tensor([1], dtype=torch.int32)})
    with pytest.raises(DataPlaneError, match="partition must be a non-empty str"):
        client.put("", "k", {"tag": "x"})


def test_close_of_one_client_leaves_others_working(client: DataPlaneClient, cfg: DataPlaneConfig) -> None:
    other = DataPlaneClient.attach(cfg)
    other.put("shared", "from-other", {"tag": "o"})
    other.close()
    other.close()
    assert other.closed
    with pytest.raises(DataPlaneClosedError, match="this client is closed"):
        other.get("shared", ["from-other"], ["tag"])
    assert client.get("shared", ["from-other"], ["tag"]) == [{"tag": "o"}]
    client.put("shared", "after-close", {"tag": "a"})
    with DataPlaneClient.attach(cfg) as fresh:
        assert fresh.get("shared", ["after-close"], ["tag"]) == [{"tag": "a"}]


@ray.remote(num_cpus=0)
class _RemoteUser:
    """A Ray actor that attaches its own client (another process of the same job)."""

    def round_trip(self, cfg_json: str) -> tuple[list[int], str]:
        from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig

        remote = DataPlaneClient.attach(DataPlaneConfig.model_validate_json(cfg_json))
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


def test_second_data_plane_in_one_cluster_is_refused(plane: DataPlane, cfg: DataPlaneConfig) -> None:
    with pytest.raises(DataPlaneError, match="already runs in this Ray cluster"):
        start_data_plane(cfg)
    assert not plane.stopped
