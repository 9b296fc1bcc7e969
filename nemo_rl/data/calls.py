"""One model call's records that cross a process boundary: its staged row and its served witness.

Staged row (worker -> data plane -> finalizer): one Gym `StagedCallRecord` as one data-plane `Row`
(`dict[str, FieldValue]`): `token_ids_delta` int64, mask and logprobs float64 (bit-exact round
trip), `header` (JSON of every other base field) and `extras` (JSON, never moved by a base read).
Decoding validates with Gym's models (which recompute the digests) and requires the row to describe
its key; faults are `StagedRecordInvalidError` naming the key (`ExtrasDigestMismatchError` for extras).
Served call (worker -> driver -> finalizer): a `ServedCall` for every admitted call that produced a
completion, staged or not; `staged` is True exactly when the delta is durable and the reply carried
staged coordinates (else `failure` says why); `unresolved_continuation` is True exactly for a `text`
admission whose history holds an assistant turn (Gym's `has_assistant_turn`). It crosses Ray as a dict.
See docs/design-docs/vllm-worker-capture.md, "The staged-row codec", and
docs/design-docs/token-capture-receipts.md, "The served witness".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from nemo_gym.token_id_capture.staging import (
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    compute_extras_digest,
    staging_key,
)
from pydantic import ValidationError

from nemo_rl.data.errors import FatalError, RecoverableError

# What one data-plane row holds; the codecs (this module's, `train`'s) build rows that satisfy it.
FieldValue = torch.Tensor | str | bytes
Row = dict[str, FieldValue]

TOKEN_IDS_FIELD = "token_ids_delta"
TOKEN_MASK_FIELD = "token_mask_delta"
LOGPROBS_FIELD = "generation_log_probs_delta"
HEADER_FIELD = "header"
EXTRAS_FIELD = "extras"
_ARRAY_FIELDS = (TOKEN_IDS_FIELD, TOKEN_MASK_FIELD, LOGPROBS_FIELD)
BASE_FIELDS = (*_ARRAY_FIELDS, HEADER_FIELD)
ALL_FIELDS = (*BASE_FIELDS, EXTRAS_FIELD)
_INT64_MAX = 2**63 - 1


class StagingFetchError(RecoverableError, RuntimeError):
    """A staged record could not be fetched as a valid snapshot."""


class StagedRecordInvalidError(StagingFetchError):
    """A stored row does not form a valid staged record (corrupt, foreign, or mis-keyed)."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        super().__init__(f"staged record under key {key!r} is invalid: {reason}")


class ExtrasDigestMismatchError(StagedRecordInvalidError):
    """A fetched extras payload does not hash to the digest it is bound to."""

    def __init__(self, key: str, expected: str, actual: str, bound_by: str) -> None:
        self.expected = expected
        self.actual = actual
        self.bound_by = bound_by
        super().__init__(
            key,
            f"extras digest {actual} does not match the {bound_by} extras_digest {expected}; the extras were "
            f"altered after staging or belong to another record, so they must not be used",
        )


def record_to_row(record: StagedCallRecord) -> Row:
    """The data-plane row for one staged record (see the module docstring for the layout)."""
    if record.token_ids_delta and max(record.token_ids_delta) > _INT64_MAX:
        raise ValueError(f"token_ids_delta of {record.staging_key!r} holds an id above int64 max")
    header = record.model_dump(mode="json", exclude={*_ARRAY_FIELDS, "extras"})
    return {
        TOKEN_IDS_FIELD: torch.tensor(record.token_ids_delta, dtype=torch.int64),
        TOKEN_MASK_FIELD: torch.tensor(record.token_mask_delta, dtype=torch.float64),
        LOGPROBS_FIELD: torch.tensor(record.generation_log_probs_delta, dtype=torch.float64),
        HEADER_FIELD: json.dumps(header, sort_keys=True, allow_nan=False),
        EXTRAS_FIELD: json.dumps(record.extras, sort_keys=True, allow_nan=False),
    }


def row_nbytes(row: Row) -> int:
    """Bytes one staged row holds in the data plane: tensor payloads plus the UTF-8 JSON fields."""
    tensors = sum(row[name].element_size() * row[name].numel() for name in _ARRAY_FIELDS)
    return tensors + len(row[HEADER_FIELD].encode()) + len(row[EXTRAS_FIELD].encode())


def _header(key: str, row: Row) -> dict[str, Any]:
    """The row's `header` as a JSON object, else `StagedRecordInvalidError` naming `key`."""
    try:
        header = json.loads(row[HEADER_FIELD])
    except (TypeError, json.JSONDecodeError) as e:
        raise StagedRecordInvalidError(key, f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise StagedRecordInvalidError(key, f"header is {type(header).__name__}, expected a JSON object")
    return header


def _row_payload(key: str, row: Row) -> dict[str, Any]:
    payload = _header(key, row)
    for name in _ARRAY_FIELDS:
        value = row[name]
        if not isinstance(value, torch.Tensor):
            raise StagedRecordInvalidError(key, f"field {name!r} is {type(value).__name__}, expected a tensor")
        payload[name] = value.tolist()
    return payload


def _validated(key: str, model: type[StagedCallBaseSnapshot], payload: dict[str, Any]) -> Any:
    try:
        snapshot = model.model_validate(payload)
    except ValidationError as e:
        raise StagedRecordInvalidError(key, str(e)) from e
    if snapshot.staging_key != key:
        raise StagedRecordInvalidError(key, f"it describes staging key {snapshot.staging_key!r}")
    return snapshot


def row_to_snapshot(key: str, row: Row) -> StagedCallBaseSnapshot:
    """Validate one base row as Gym's snapshot (digest recomputed by Gym's model)."""
    return _validated(key, StagedCallBaseSnapshot, _row_payload(key, row))


def _row_extras(key: str, row: Row) -> dict[str, Any] | None:
    try:
        extras = json.loads(row[EXTRAS_FIELD])
    except (TypeError, json.JSONDecodeError) as e:
        raise StagedRecordInvalidError(key, f"extras is not JSON: {e}") from e
    if extras is not None and not isinstance(extras, dict):
        raise StagedRecordInvalidError(key, f"extras is {type(extras).__name__}, expected a JSON object or null")
    return extras


def _extras_digest(key: str, extras: dict[str, Any] | None) -> str:
    try:
        return compute_extras_digest(extras)
    except (TypeError, ValueError) as e:
        raise StagedRecordInvalidError(key, f"extras cannot be digested: {e}") from e


def verified_extras(key: str, row: Row, expected_extras_digest: str | None = None) -> dict[str, Any] | None:
    """The extras of one `header` + `extras` row, checked against the stored and expected digests.

    Raises `StagedRecordInvalidError` for a malformed row and `ExtrasDigestMismatchError` when the
    payload's digest differs from the header's `extras_digest` or from `expected_extras_digest`.
    """
    header = _header(key, row)
    try:
        described = staging_key(header.get("rollout_id", ""), header.get("model_call_id", ""))
    except ValueError as e:
        raise StagedRecordInvalidError(key, f"header names no record: {e}") from e
    if described != key:
        raise StagedRecordInvalidError(key, f"it describes staging key {described!r}")
    stored = header.get("extras_digest")
    if not isinstance(stored, str):
        raise StagedRecordInvalidError(key, "header has no extras_digest")
    extras = _row_extras(key, row)
    actual = _extras_digest(key, extras)
    if actual != stored:
        raise ExtrasDigestMismatchError(key, stored, actual, "staged")
    if expected_extras_digest is not None and actual != expected_extras_digest:
        raise ExtrasDigestMismatchError(key, expected_extras_digest, actual, "committed")
    return extras


def row_to_record(key: str, row: Row) -> StagedCallSnapshot:
    """Validate one full row, extras included (extras digest recomputed by Gym's model)."""
    payload = _row_payload(key, row)
    payload["extras"] = _row_extras(key, row)
    stored = payload.get("extras_digest")
    actual = _extras_digest(key, payload["extras"])
    if isinstance(stored, str) and stored != actual:
        raise ExtrasDigestMismatchError(key, stored, actual, "staged")
    return _validated(key, StagedCallSnapshot, payload)


class ServedCallError(FatalError, ValueError):
    """A served-call record violates its invariants (a worker bug or a version mismatch)."""


def has_assistant_turn(messages: Sequence[Any]) -> bool:
    """Whether a request's history holds model-authored output (Gym's rule; see the module contract)."""
    return any(
        isinstance(message, dict) and (message.get("role") == "assistant" or message.get("type") == "function_call")
        for message in messages
    )


@dataclass(frozen=True, slots=True)
class ServedCall:
    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    mode: str  # "text" (a chain root) or "token_in" (a continuation)
    generated_tokens: int
    staged: bool
    failure: str | None = None  # why the delta was not staged; None when staged
    worker_index: int = 0
    unresolved_continuation: bool = False  # text admission, history with assistant turns (see the contract)

    def __post_init__(self) -> None:
        where = f"ServedCall {self.rollout_id}/{self.model_call_id}"
        if not self.rollout_id or not self.model_call_id:
            raise ServedCallError(f"{where}: rollout_id and model_call_id must be non-empty")
        if self.mode not in ("text", "token_in"):
            raise ServedCallError(f"{where}: mode must be 'text' or 'token_in', got {self.mode!r}")
        if (self.mode == "text") != (self.parent_call_id is None):
            raise ServedCallError(f"{where}: a text root has no parent and a token_in call has one")
        if type(self.generated_tokens) is not int or self.generated_tokens < 0:
            raise ServedCallError(f"{where}: generated_tokens must be a non-negative int")
        if self.staged != (self.failure is None):
            raise ServedCallError(f"{where}: a staged call has no failure and an unstaged call names one")
        if type(self.unresolved_continuation) is not bool or (self.unresolved_continuation and self.mode != "text"):
            raise ServedCallError(f"{where}: unresolved_continuation is a bool, True only for a text admission "
                                  f"(got {self.unresolved_continuation!r} on a {self.mode} call)")

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "ServedCall":
        try:
            return cls(**data)
        except TypeError as e:
            raise ServedCallError(f"served-call record has unexpected fields: {sorted(data)}") from e
