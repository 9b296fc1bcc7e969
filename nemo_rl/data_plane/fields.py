"""Row and field-value rules of the data plane (pure functions, no TransferQueue import).

A row is a non-empty `dict[str, FieldValue]` (both types: `nemo_rl.data.calls`). A field value
is one of:
- a 1-D CPU `torch.Tensor` of dtype int64 (token ids) or float64 (masks, logprobs: float64 holds
  every Python float exactly, so values round-trip bit for bit);
- a `str` (e.g. JSON metadata) or `bytes` (opaque payloads), stored as a TQ non-tensor field.
Every row of one `put_many` must have the same field names and, per field, the same kind.
Keys are non-empty strings, unique within one call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from nemo_rl.data_plane.errors import FieldEncodingError

FieldKind = Literal["int64", "float64", "str", "bytes"]
Schema = tuple[tuple[str, FieldKind], ...]

_TENSOR_KINDS: dict[torch.dtype, FieldKind] = {torch.int64: "int64", torch.float64: "float64"}


def field_kind(key: str, name: str, value: object) -> FieldKind:
    """The kind of one field value; raises FieldEncodingError naming key, field and fix."""
    if isinstance(value, torch.Tensor):
        kind = _TENSOR_KINDS.get(value.dtype)
        if kind is None:
            raise FieldEncodingError(
                f"key {key!r} field {name!r}: tensor dtype {value.dtype} is not stored; use int64 for "
                f"ids or float64 for masks/logprobs"
            )
        if value.dim() != 1 or value.is_nested or value.device.type != "cpu":
            raise FieldEncodingError(
                f"key {key!r} field {name!r}: expected a 1-D CPU tensor, got shape {tuple(value.shape)} "
                f"on {value.device}"
            )
        return kind
    if isinstance(value, str):
        return "str"
    if isinstance(value, bytes):
        return "bytes"
    raise FieldEncodingError(
        f"key {key!r} field {name!r}: {type(value).__name__} is not stored; use a 1-D int64/float64 "
        f"tensor, str or bytes"
    )


def row_schema(key: str, row: Mapping[str, object]) -> Schema:
    """The (field, kind) schema of one row, sorted by field name."""
    if not isinstance(row, Mapping) or not row:
        raise FieldEncodingError(f"key {key!r}: a row must be a non-empty mapping of field -> value")
    for name in row:
        if not isinstance(name, str) or not name:
            raise FieldEncodingError(f"key {key!r}: field names must be non-empty str, got {name!r}")
    return tuple((name, field_kind(key, name, row[name])) for name in sorted(row))


def check_keys(keys: Sequence[str], operation: str) -> None:
    """Keys are a non-empty list of non-empty, unique strings."""
    if isinstance(keys, str) or not isinstance(keys, Sequence) or len(keys) == 0:
        raise FieldEncodingError(f"{operation}: keys must be a non-empty list of str, got {keys!r}")
    bad = [k for k in keys if not isinstance(k, str) or not k]
    if bad:
        raise FieldEncodingError(f"{operation}: keys must be non-empty str, got {bad[:5]!r}")


def check_unique(keys: Sequence[str], operation: str) -> None:
    """Reject repeated keys (a batch write of one key twice has no defined winner)."""
    repeated = sorted(k for k, count in Counter(keys).items() if count > 1)
    if repeated:
        raise FieldEncodingError(f"{operation}: keys repeat within one call: {repeated[:5]!r}")


def batch_schema(keys: Sequence[str], rows: Sequence[Mapping[str, object]]) -> Schema:
    """Validate a batch write and return its common schema."""
    check_keys(keys, "put_many")
    check_unique(keys, "put_many")
    if len(rows) != len(keys):
        raise FieldEncodingError(f"put_many: {len(keys)} keys but {len(rows)} rows")
    schema = row_schema(keys[0], rows[0])
    for key, row in zip(keys[1:], rows[1:]):
        other = row_schema(key, row)
        if other != schema:
            raise FieldEncodingError(
                f"put_many: key {key!r} has fields {list(other)} but key {keys[0]!r} has {list(schema)}; "
                f"every row of one call must share field names and kinds"
            )
    return schema


def check_fields(fields: Sequence[str]) -> None:
    """Field selections are non-empty lists of distinct non-empty names."""
    if isinstance(fields, str) or not isinstance(fields, Sequence) or len(fields) == 0:
        raise FieldEncodingError(f"get: fields must be a non-empty list of field names, got {fields!r}")
    if any(not isinstance(f, str) or not f for f in fields) or len(set(fields)) != len(fields):
        raise FieldEncodingError(f"get: fields must be distinct non-empty str, got {list(fields)!r}")


def unique_in_order(keys: Sequence[str]) -> list[str]:
    """Keys with repeats removed, first occurrence kept."""
    return list(dict.fromkeys(keys))
