"""Pure row/field rules of the data plane (no Ray, no TransferQueue)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl.data_plane import FieldEncodingError
from nemo_rl.data_plane.fields import (
    batch_schema,
    check_fields,
    check_keys,
    check_unique,
    field_kind,
    row_schema,
    unique_in_order,
)


def test_field_kinds() -> None:
    assert field_kind("k", "ids", torch.tensor([1, 2], dtype=torch.int64)) == "int64"
    assert field_kind("k", "lp", torch.tensor([0.5], dtype=torch.float64)) == "float64"
    assert field_kind("k", "meta", "{}") == "str"
    assert field_kind("k", "blob", b"\x00") == "bytes"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (torch.tensor([1, 2], dtype=torch.int32), "dtype torch.int32 is not stored"),
        (torch.tensor([0.5], dtype=torch.float32), "dtype torch.float32 is not stored"),
        (torch.zeros((2, 2), dtype=torch.int64), "expected a 1-D CPU tensor, got shape (2, 2)"),
        (torch.tensor(3, dtype=torch.int64), "expected a 1-D CPU tensor, got shape ()"),
        ([1, 2, 3], "list is not stored"),
        (None, "NoneType is not stored"),
    ],
)
def test_field_kind_rejects_with_key_and_field(value: object, fragment: str) -> None:
    with pytest.raises(FieldEncodingError) as info:
        field_kind("rollout/call", "ids", value)
    message = str(info.value)
    assert "key 'rollout/call' field 'ids'" in message
    assert fragment in message


def test_row_schema_is_sorted_and_rejects_empty_rows() -> None:
    row = {"b": "x", "a": torch.tensor([1], dtype=torch.int64)}
    assert row_schema("k", row) == (("a", "int64"), ("b", "str"))
    with pytest.raises(FieldEncodingError, match="key 'k': a row must be a non-empty mapping"):
        row_schema("k", {})
    with pytest.raises(FieldEncodingError, match="field names must be non-empty str"):
        row_schema("k", {"": "x"})


def test_batch_schema_requires_one_shared_schema() -> None:
    ids = torch.tensor([1], dtype=torch.int64)
    assert batch_schema(["a", "b"], [{"ids": ids}, {"ids": ids}]) == (("ids", "int64"),)
    with pytest.raises(FieldEncodingError, match="key 'b' has fields"):
        batch_schema(["a", "b"], [{"ids": ids}, {"ids": "text"}])
    with pytest.raises(FieldEncodingError, match="2 keys but 1 rows"):
        batch_schema(["a", "b"], [{"ids": ids}])
    with pytest.raises(FieldEncodingError, match=r"keys repeat within one call: \['a'\]"):
        batch_schema(["a", "a"], [{"ids": ids}, {"ids": ids}])


def test_key_and_field_selection_checks() -> None:
    with pytest.raises(FieldEncodingError, match="non-empty list of str"):
        check_keys([], "get")
    with pytest.raises(FieldEncodingError, match="non-empty list of str"):
        check_keys("single-string", "get")
    with pytest.raises(FieldEncodingError, match="keys must be non-empty str"):
        check_keys(["ok", ""], "get")
    check_unique(["a", "b"], "put_many")
    with pytest.raises(FieldEncodingError, match="fields must be distinct"):
        check_fields(["a", "a"])
    with pytest.raises(FieldEncodingError, match="non-empty list of field names"):
        check_fields("a")
    assert unique_in_order(["b", "a", "b", "c", "a"]) == ["b", "a", "c"]
