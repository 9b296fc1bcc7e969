"""DataPlaneClient against a real private Ray cluster and real TransferQueue actors."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

from nemo_rl.data_plane import (
    DataPlaneClient,
    DataPlaneBugError,
    DataPlaneConfig,
    DataPlaneError,
    FieldEncodingError,
    MissingKeysError,
    attach_client,
    tq_backend,
)
from nemo_rl.data_plane.client import get_rows, transport_failure

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
    with pytest.raises(DataPlaneBugError, match="partition must be a non-empty str, got '' \\(fix the caller\\)") as bad:
        client.put("", "k", {"tag": "x"})
    assert bad.value.kind == "usage"


def test_a_bad_argument_is_a_caller_bug_not_weather(client: DataPlaneClient) -> None:
    # A caller that turns DataPlaneError into a placeholder must not swallow its own encoding bug.
    for call, kind in ((lambda: client.put("p", "bad", {"ids": [1, 2]}), "field_encoding"),
                       (lambda: client.get("p", [3], ["tag"]), "field_encoding"),
                       (lambda: client.clear(None, ["k"]), "usage")):  # type: ignore[arg-type]
        with pytest.raises(DataPlaneBugError) as info:
            try:
                call()
            except DataPlaneError as e:
                pytest.fail(f"a caller bug was raised as data-plane weather: {e!r}")
        assert isinstance(info.value, ValueError) and info.value.kind == kind


class _AnswerEditingTQ:
    """The real TQ client, with what its `async_get_data` answered passed through `edit` first."""

    def __init__(self, real: Any, edit: Callable[[Any, Any], Any]) -> None:
        self._real, self._edit = real, edit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    async def async_get_data(self, meta: Any) -> Any:
        return await self._edit(self._real, meta)


def test_a_type_error_inside_a_tq_call_surfaces_as_itself(client: DataPlaneClient) -> None:
    # TQ's own argument check raises TypeError for a non-str key (a bug of the layer above it).
    with pytest.raises(TypeError) as info:
        client._call("get", "bugs", lambda: get_rows(client._tq, "bugs", [7], ["tag"], client._errors.key_not_found), None)
    assert type(info.value) is TypeError
    assert str(info.value) == "Not all elements in `keys` are strings."
    assert info.value.__notes__ == [
        "raised inside data plane get on partition 'bugs': not a TransferQueue transport failure, so it is not "
        "data-plane weather (a bug, or a component's refusal)"]


def test_a_decode_bug_on_a_real_answer_surfaces_as_itself(client: DataPlaneClient, monkeypatch) -> None:
    client.put_many("decode", ["d/1", "d/2"], [{"tag": "1", "ids": torch.tensor([1])}, {"tag": "2", "ids": torch.tensor([2])}])

    async def drop_tag(real: Any, meta: Any) -> Any:
        data = await real.async_get_data(meta)
        del data["tag"]  # a malformed answer: a field the metadata promised is not in it
        return data

    monkeypatch.setattr(client, "_tq", _AnswerEditingTQ(client._tq, drop_tag))
    with pytest.raises(KeyError) as info:
        client.get("decode", ["d/1", "d/2"], ["ids", "tag"])
    assert type(info.value) is KeyError and not isinstance(info.value, DataPlaneError)
    assert info.value.__notes__[0].startswith("raised inside data plane get on partition 'decode'")

    async def first_row_only(real: Any, meta: Any) -> Any:
        return (await real.async_get_data(meta))[:1]

    monkeypatch.setattr(client, "_tq", _AnswerEditingTQ(client._tq._real, first_row_only))
    with pytest.raises(DataPlaneBugError) as short:
        client.get("decode", ["d/1", "d/2"], ["ids", "tag"])
    assert not isinstance(short.value, DataPlaneError) and short.value.kind == "decode"
    assert str(short.value) == ("TransferQueue returned 1 values for field 'ids', expected 2 (one per key): the "
                                "answer does not decode as one row per key")


def test_tqs_clear_vs_read_race_is_a_missing_key(client: DataPlaneClient, monkeypatch) -> None:
    client.put_many("race", ["r/1", "r/2"], [{"tag": "1"}, {"tag": "2"}])

    async def cleared_before_read(real: Any, meta: Any) -> Any:
        await real.async_clear_samples(meta)  # retention clears the keys between metadata and data
        return await real.async_get_data(meta)

    monkeypatch.setattr(client, "_tq", _AnswerEditingTQ(client._tq, cleared_before_read))
    with pytest.raises(MissingKeysError) as info:
        client.get("race", ["r/1", "r/2"], ["tag"])
    assert info.value.missing_keys == ["r/1", "r/2"]
    assert type(info.value.__cause__).__name__ == "StorageKeyNotFoundError"


def test_a_real_zmq_failure_is_transport_weather(cfg: DataPlaneConfig, client: DataPlaneClient) -> None:
    client.put("transport", "t", {"tag": "t"})
    broken = attach_client(cfg)
    broken._tq.zmq_context.destroy(linger=0)  # every socket of this client fails from here on
    try:
        with pytest.raises(DataPlaneError) as info:
            broken.get("transport", ["t"], ["tag"])
        assert info.value.kind == "transport"
    finally:
        broken.close()
    causes = []
    error: BaseException | None = info.value
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any(isinstance(c, zmq.ZMQError) for c in causes[1:])
    assert str(info.value).startswith("data plane get on partition 'transport' failed in TransferQueue's transport: "
                                      "ZMQError: ")
    assert client.get("transport", ["t"], ["tag"]) == [{"tag": "t"}]


def test_close_of_one_client_leaves_others_working(client: DataPlaneClient, cfg: DataPlaneConfig) -> None:
    other = attach_client(cfg)
    other.put("shared", "from-other", {"tag": "o"})
    other.close()
    other.close()
    assert other.closed
    with pytest.raises(DataPlaneError, match="this client is closed") as raised:
        other.get("shared", ["from-other"], ["tag"])
    assert raised.value.kind == "closed"
    assert client.get("shared", ["from-other"], ["tag"]) == [{"tag": "o"}]
    client.put("shared", "after-close", {"tag": "a"})
    with attach_client(cfg) as fresh:
        assert fresh.get("shared", ["after-close"], ["tag"]) == [{"tag": "a"}]


def _raised(make: Callable[[], None]) -> BaseException:
    try:
        make()
    except BaseException as e:  # the test inspects what was raised
        return e
    raise AssertionError("nothing was raised")


def _tq_wraps(cause: BaseException) -> None:
    """What TQ's client does with a failure inside a call: its own RuntimeError from the cause."""
    try:
        raise cause
    except Exception as e:
        raise RuntimeError(f"[client] Failed in async_kv_retrieve_meta: {e}") from e


def _bug_while_handling(cause: BaseException) -> None:
    try:
        raise cause
    except Exception:
        raise TypeError("a bug in the handler")  # noqa: B904 (implicit context on purpose)


def test_only_the_explicit_cause_chain_makes_a_failure_transport(cfg: DataPlaneConfig) -> None:
    tq_backend.prepare_process(cfg)  # imports TQ with this module's knobs; no Ray needed
    from transfer_queue.storage.managers.simple_storage_manager import StorageUnitTimeout

    errors = tq_backend.tq_errors()
    assert errors.transport == (zmq.ZMQError, StorageUnitTimeout, TimeoutError)
    assert errors.key_not_found.__module__ == "transfer_queue.storage.simple_storage"
    assert errors.key_not_found.__name__ == "StorageKeyNotFoundError"
    transport = errors.transport
    again = zmq.Again()
    wrapped = _raised(lambda: _tq_wraps(again))
    assert transport_failure(wrapped, transport) is again
    unit_timeout = StorageUnitTimeout("no answer in 30s during get from storage unit su0")
    assert transport_failure(_raised(lambda: _tq_wraps(unit_timeout)), transport) is unit_timeout
    assert transport_failure(_raised(lambda: _tq_wraps(TypeError("bad"))), transport) is None
    assert transport_failure(_raised(lambda: _bug_while_handling(zmq.Again())), transport) is None
    assert transport_failure(KeyError("tag"), transport) is None
