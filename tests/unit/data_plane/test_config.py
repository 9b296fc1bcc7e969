"""DataPlaneConfig validation, the TQ env knobs it maps to, and the error messages."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_rl.data_plane import DataPlaneConfig, DataPlaneTimeoutError, MissingKeysError
from nemo_rl.data_plane.tq_backend import prepare_process, tq_env


def test_defaults() -> None:
    cfg = DataPlaneConfig()
    assert cfg.num_storage_units == 1
    assert cfg.storage_capacity is None
    assert cfg.call_timeout_s == 30.0
    assert cfg.tq_num_threads == 1


def test_rejects_unknown_and_invalid_values() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DataPlaneConfig.model_validate({"num_storage_unit": 2})
    with pytest.raises(ValidationError, match="greater than 0"):
        DataPlaneConfig(call_timeout_s=0.0)
    with pytest.raises(ValidationError):
        DataPlaneConfig(call_timeout_s=float("inf"))
    with pytest.raises(ValidationError):
        DataPlaneConfig.model_validate({"num_storage_units": "2"})


def test_tq_env_maps_every_knob() -> None:
    cfg = DataPlaneConfig(tq_num_threads=2, tq_storage_send_recv_timeout_s=7, tq_storage_max_attempts=1)
    assert tq_env(cfg) == {
        "TQ_NUM_THREADS": "2",
        "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": "7",
        "TQ_SIMPLE_STORAGE_MAX_ATTEMPTS": "1",
        "TQ_LOGGING_LEVEL": "ERROR",
    }


def test_tq_binds_loopback_by_default_and_node_ip_on_request() -> None:
    assert DataPlaneConfig().bind == "loopback"
    assert DataPlaneConfig(bind="node_ip").bind == "node_ip"
    with pytest.raises(ValidationError):
        DataPlaneConfig(bind="0.0.0.0")


def test_the_loopback_hook_changes_only_the_node_ip_lookup_of_its_process(monkeypatch) -> None:
    import ray.util

    from nemo_rl.data_plane.bind import bind_tq_to_loopback

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda address=None: "192.0.2.7")
    bind_tq_to_loopback()
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    # TQ's own wrapper reads it at call time, which is what its constructors call. TQ is imported
    # the way the data plane imports it (its knobs fixed first), so the process's later real plane
    # (the session's `shared_plane`) finds the knobs it asks for.
    prepare_process(DataPlaneConfig())
    from transfer_queue.utils.zmq_utils import get_node_ip_address

    assert get_node_ip_address() == "127.0.0.1"


def test_timeout_error_names_operation_partition_and_deadline() -> None:
    error = DataPlaneTimeoutError("get", "staging", 2.5)
    assert (error.operation, error.partition, error.timeout_s) == ("get", "staging", 2.5)
    assert "data plane get on partition 'staging' did not finish within its 2.5 s deadline" in str(error)


def test_missing_keys_error_names_keys_and_truncates_long_lists() -> None:
    error = MissingKeysError("p", ["r/1", "r/2"], ["header"])
    assert error.missing_keys == ["r/1", "r/2"]
    assert "2 key(s) not readable with fields ['header'] in partition 'p': ['r/1', 'r/2']" in str(error)
    many = MissingKeysError("p", [f"k{i}" for i in range(25)])
    assert many.missing_keys == [f"k{i}" for i in range(25)]
    assert "'k19', ... (25 keys in total)" in str(many)
    assert "'k20'" not in str(many)
