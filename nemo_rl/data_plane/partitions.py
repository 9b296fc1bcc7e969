"""The two partitions' I/O over the data plane: staging (Gym's sink, source, retention) and train rows.

Staging: `TQTokenSink` (vLLM worker) and `TQTokenSource` (finalizer) are Gym's `StagingSink` /
`StagingSource`; one staged call is one row under `staging_key(rollout_id, model_call_id)` (codec:
`nemo_rl.data.calls`). `stage` writes once per new key and never reads (or queues on a `StageWriter`);
a byte-identical re-stage is ok without a write, another digest is refused and the stored row kept.
`TQStagingCleaner` (driver) clears an accounted group's keys and its orphans in one bounded call.
Train rows (codec: `nemo_rl.data.train`): `store_many_rows` is ONE `put_many` returning `RowRef`s;
`read_train_batch` is ONE `get` that rechecks every digest (`TrainRowDigestError`: nothing is
trained). Invariants: a staging key is written once (else digests make it a placeholder); the batch
read is the very `TrainBatch` the driver would have built; failures are named, never None.
See docs/design-docs/vllm-worker-capture.md ("The TransferQueue sink and source"),
token-capture-receipts.md ("Retention", "Train partition").
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from nemo_gym.token_id_capture.staging import (
    LinearizedRow,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
    staging_key,
)

from nemo_rl.data.calls import (
    ALL_FIELDS,
    BASE_FIELDS,
    EXTRAS_FIELD,
    HEADER_FIELD,
    Row,
    ServedCall,
    StagingFetchError,
    record_to_row,
    row_nbytes,
    row_to_record,
    row_to_snapshot,
    verified_extras,
)
from nemo_rl.data.errors import PolicyWorkerError
from nemo_rl.data.rows import KeptRollout, RowRef, TrainRow
from nemo_rl.data.train import (
    FIELDS,
    LOGPROBS,
    TOKEN_IDS,
    TOKEN_MASK,
    TrainBatch,
    TrainPlan,
    batch_routes,
    decode_row_routes,
    payload_digest,
    row_payload,
    train_key,
)
from nemo_rl.data_plane import DataPlaneClient, DataPlaneError, MissingKeysError
from nemo_rl.data_plane.client import StageWriter
from nemo_rl.data_plane.errors import format_keys
from nemo_rl.utils import instrumentation
from nemo_rl.utils.lru import BoundedLRU

# Re-reads of a key another worker is still writing: a write takes milliseconds, so start small.
_FIRST_MISSING_PAUSE_S = 0.002
_MAX_MISSING_PAUSE_S = 0.1
# Per-key locks are striped so memory stays bounded however many keys a worker stages.
_LOCK_STRIPES = 64
# Digests of recently written keys, for the in-process retry/conflict check (about 0.2 KB per key).
# Retries come within a call's deadline, so a few thousand calls of history is plenty.
REMEMBERED_KEYS = 16_384


class StagingStore(Protocol):
    """What the sink and source need from the data plane (`DataPlaneClient` implements it)."""

    def put(self, partition: str, key: str, fields: Mapping[str, Any], *, timeout_s: float | None = None) -> None: ...

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str], *, timeout_s: float | None = None
    ) -> list[Row]: ...

    def clear(self, partition: str, keys: Sequence[str], *, timeout_s: float | None = None) -> None: ...


class StagedKeysMissingError(StagingFetchError):
    """Requested staging keys are not in the staging partition."""

    def __init__(self, partition: str, keys: Sequence[str]) -> None:
        self.partition = partition
        self.keys = list(keys)
        super().__init__(
            f"staging keys not found in partition {partition!r}: {format_keys(self.keys)}. The record was never "
            f"staged (capture failed), was already cleared by retention, or belongs to another run."
        )


class StagingStoreUnavailableError(StagingFetchError):
    """The data plane failed or missed its deadline while fetching."""


def conflict_error(key: str, stored_digest: str, new_digest: str) -> str:
    """The rejection message for a reused key."""
    return (
        f"staging key {key!r} already holds a different record (stored digest {stored_digest}, new digest "
        f"{new_digest}); a key is staged once, so mint a fresh model_call_id instead of reusing it"
    )


class TQTokenSink:
    """Gym `StagingSink` that writes each staged call as one row of a TQ partition."""

    def __init__(
        self, client: StagingStore, partition: str, *, timeout_s: float | None = None,
        remembered_keys: int = REMEMBERED_KEYS, writer: StageWriter | None = None,
    ) -> None:
        """`timeout_s` bounds each data-plane call; None uses the client's configured deadline.

        `writer`: queue rows on this write-behind writer (its partition) instead of writing them
        before `stage` returns.
        """
        self._client = client
        self._partition = partition
        self._timeout_s = timeout_s
        self._writer = writer
        self._locks = [threading.Lock() for _ in range(_LOCK_STRIPES)]
        if remembered_keys < 1:
            raise ValueError(f"max_keys={remembered_keys}: must be >= 1")
        # staging key -> digest of the record this process wrote (what a reused key is checked against).
        self._written: BoundedLRU[str, str] = BoundedLRU(remembered_keys)

    def stage(self, record: StagedCallRecord, *, attachments: Mapping[str, Any] | None = None) -> StageResult:
        """Durably stage one record under its staging key (see the module contract)."""
        if not isinstance(record, StagedCallRecord):
            raise TypeError(f"stage expects a StagedCallRecord, got {type(record).__name__}")
        key = staging_key(record.rollout_id, record.model_call_id)
        if attachments:
            return StageResult(
                ok=False,
                staging_key=key,
                error=(
                    f"staging key {key!r}: attachments {sorted(attachments)} are not supported by the TransferQueue "
                    f"sink; stage text-only calls or add attachment columns to the staging row"
                ),
            )
        try:
            row = record_to_row(record)
        except ValueError as e:
            return StageResult(ok=False, staging_key=key, error=f"staging key {key!r}: {e}")
        started = time.perf_counter()
        with self._locks[hash(key) % _LOCK_STRIPES]:
            written = self._written.get(key)
            if written is not None and written != record.digest:
                return StageResult(ok=False, staging_key=key, error=conflict_error(key, written, record.digest))
            if written is None:
                # One write, no read: vllm-worker-capture.md, "Why a blind write is safe".
                if self._writer is None:
                    self._client.put(self._partition, key, row, timeout_s=self._timeout_s)
                else:
                    self._writer.submit(record.rollout_id, key, row)
                self._written.put(key, record.digest)
        instrumentation.add_call_cost("stage_s", time.perf_counter() - started)
        if instrumentation.active():
            instrumentation.add_counter("staged_bytes", row_nbytes(row))
            instrumentation.add_counter("staged_calls", 1)
        return StageResult(ok=True, staging_key=key)


class TQTokenSource:
    """Gym `StagingSource` that reads staged calls back from a TQ partition."""

    def __init__(
        self, client: StagingStore, partition: str, *, timeout_s: float | None = None, missing_wait_s: float = 0.0
    ) -> None:
        """`timeout_s` bounds each data-plane call; None uses the client's configured deadline.

        `missing_wait_s`: how long a read re-tries keys that are not there yet (0: report at once).
        """
        if missing_wait_s < 0:
            raise ValueError(f"missing_wait_s={missing_wait_s}: must be >= 0")
        self._client = client
        self._partition = partition
        self._timeout_s = timeout_s
        self._missing_wait_s = missing_wait_s
        self.missing_waits = 0

    def _rows(self, staging_keys: list[str], fields: Sequence[str]) -> list[Row]:
        started = time.perf_counter()
        deadline = time.monotonic() + self._missing_wait_s
        pause_s = _FIRST_MISSING_PAUSE_S
        try:
            while True:
                try:
                    return self._client.get(self._partition, staging_keys, list(fields), timeout_s=self._timeout_s)
                except MissingKeysError as e:
                    if time.monotonic() + pause_s > deadline:
                        raise StagedKeysMissingError(self._partition, e.missing_keys) from e
                    self.missing_waits += 1
                    time.sleep(pause_s)  # a row another worker is still writing (write-behind staging)
                    pause_s = min(2 * pause_s, _MAX_MISSING_PAUSE_S)
        except DataPlaneError as e:
            raise StagingStoreUnavailableError(
                f"fetching {len(staging_keys)} staging key(s) {format_keys(staging_keys)} from partition "
                f"{self._partition!r} failed: {e}"
            ) from e
        finally:
            # Counted only inside a worker's call scope (the prefix fetch of a token-in call).
            instrumentation.add_call_cost("prefix_fetch_s", time.perf_counter() - started)

    def fetch(self, staging_keys: list[str]) -> list[StagedCallBaseSnapshot]:
        """Exactly one validated base snapshot per key, in request order."""
        keys = list(staging_keys)
        if not keys:
            return []
        rows = self._rows(keys, BASE_FIELDS)
        return [row_to_snapshot(key, row) for key, row in zip(keys, rows)]

    def fetch_records(self, staging_keys: list[str]) -> list[StagedCallSnapshot]:
        """Like `fetch`, plus each record's extras (verified against its extras digest)."""
        keys = list(staging_keys)
        if not keys:
            return []
        rows = self._rows(keys, ALL_FIELDS)
        return [row_to_record(key, row) for key, row in zip(keys, rows)]

    def fetch_extras(
        self, staging_keys: list[str], expected_extras_digests: Sequence[str] | None = None
    ) -> list[dict[str, Any] | None]:
        """Each record's verified extras (None when it staged none), in request order.

        Moves only `header` and `extras` in one data-plane call under this source's deadline.
        `expected_extras_digests` (one per key) binds each payload to the caller's verified row;
        see the module contract for the errors.
        """
        keys = list(staging_keys)
        expected: list[str | None] = [None] * len(keys)
        if expected_extras_digests is not None:
            expected = list(expected_extras_digests)
            if len(expected) != len(keys):
                raise ValueError(f"{len(expected)} expected extras digests for {len(keys)} staging keys")
        if not keys:
            return []
        rows = self._rows(keys, (HEADER_FIELD, EXTRAS_FIELD))
        return [verified_extras(key, row, digest) for key, row, digest in zip(keys, rows, expected)]

    def fetch_row_extras(self, row: LinearizedRow) -> list[dict[str, Any] | None]:
        """The verified extras of a `LinearizedRow`'s calls, root to terminal, bound to its commitments."""
        by_call = {c.model_call_id: c.extras_digest for c in row.extras_commitments}
        missing = [call_id for call_id in row.model_call_ids if call_id not in by_call]
        if missing:
            raise ValueError(f"row {row.rollout_id!r} has no extras commitment for calls {missing}")
        keys = [staging_key(row.rollout_id, call_id) for call_id in row.model_call_ids]
        return self.fetch_extras(keys, [by_call[call_id] for call_id in row.model_call_ids])

    def clear(self, staging_keys: list[str]) -> None:
        """Remove staged rows (retention after a group commits); absent keys are ignored."""
        keys = list(staging_keys)
        if keys:
            self._client.clear(self._partition, keys, timeout_s=self._timeout_s)


# Retention: once a group is accounted, its staged records go. A group owns the keys its fetched
# manifests name plus the ones the served report says were staged for its rollouts (orphans: staged,
# but the commit never reached the ledger). Not seen either way: a call staged after its group's
# report was taken, or a rollout the served registry evicted; it stays until the data plane is dropped.
STAGING_KEY_SEPARATOR = "/"


def _owner(key: str) -> str | None:
    owner, separator, _ = key.partition(STAGING_KEY_SEPARATOR)
    return owner if separator else None


def orphaned_keys(present: Iterable[str], named: Iterable[str], rollout_ids: Iterable[str]) -> list[str]:
    """Keys of `rollout_ids` in `present` that `named` lacks, in `present` order, each once."""
    named_set = set(named)
    owners = set(rollout_ids)
    seen: set[str] = set()
    orphans = []
    for key in present:
        if _owner(key) in owners and key not in named_set and key not in seen:
            seen.add(key)
            orphans.append(key)
    return orphans


def reported_staged_keys(served: Iterable[ServedCall]) -> list[str]:
    """The staging keys of the served calls whose delta was staged, in report order, each once."""
    return list(dict.fromkeys(staging_key(call.rollout_id, call.model_call_id) for call in served if call.staged))


class TQStagingCleaner:
    """Clears a group's staged records from the TQ staging partition (a `StagingCleaner`)."""

    def __init__(self, client: DataPlaneClient, partition: str, timeout_s: float) -> None:
        self._client, self._partition, self._timeout_s = client, partition, timeout_s

    def clear(self, named_keys: Sequence[str], rollout_ids: Sequence[str], reported_keys: Sequence[str] | None) -> int:
        """Clear the group's named keys and its orphans in one call; returns the orphan count."""
        if reported_keys is None:
            present = self._client.list_keys(self._partition, timeout_s=self._timeout_s)
        else:
            present = reported_keys
        orphans = orphaned_keys(present, named_keys, rollout_ids)
        keys = list(dict.fromkeys([*named_keys, *orphans]))
        if keys:
            self._client.clear(self._partition, keys, timeout_s=self._timeout_s)
        return len(orphans)

    def remaining(self) -> int:
        """How many keys the staging partition still holds (one bounded list)."""
        return len(self._client.list_keys(self._partition, timeout_s=self._timeout_s))


# ---------------------------------------------------------------- the train partition


class TrainRowDigestError(PolicyWorkerError):
    """A row read from the train partition is not the row the finalizer wrote: the step is not trained."""


def store_rows(
    client: DataPlaneClient, partition: str, kept: KeptRollout, timeout_s: float, carry_prompt_ids: bool
) -> KeptRollout:
    """Write the rollout's rows in one put; the rollout with `RowRef` rows (see the module contract)."""
    return store_many_rows(client, partition, [kept], timeout_s, carry_prompt_ids)[0]


def store_many_rows(
    client: DataPlaneClient, partition: str, kept: Sequence[KeptRollout], timeout_s: float, carry_prompt_ids: bool
) -> list[KeptRollout]:
    """Write the rows of several kept rollouts in ONE put; each rollout with `RowRef` rows, in order."""
    keys, payloads, refs = [], [], []
    for rollout in kept:
        refs.append([])
        for row in rollout.rows:
            if not isinstance(row, TrainRow):
                raise TypeError(f"rollout {rollout.rollout_id}: store_rows takes TrainRows, got {type(row).__name__}")
            key = train_key(row.rollout_id, row.chain_index)
            payload = row_payload(key, row)
            keys.append(key)
            payloads.append(payload)
            refs[-1].append(RowRef.of(row, key, payload_digest(payload), carry_prompt_ids))
    if keys:
        client.put_many(partition, keys, payloads, timeout_s=timeout_s)
    return [dataclasses.replace(rollout, rows=tuple(r)) for rollout, r in zip(kept, refs)]


def read_train_batch(client: DataPlaneClient, plan: TrainPlan, timeout_s: float | None = None) -> TrainBatch:
    """The plan's rows, digest-checked, as the TrainBatch the driver would have built."""
    rows = client.get(plan.partition, list(plan.keys), list(FIELDS), timeout_s=timeout_s)
    for key, expected, row in zip(plan.keys, plan.digests, rows, strict=True):
        found = payload_digest(row)
        if found != expected:
            raise TrainRowDigestError(
                f"train partition {plan.partition!r} key {key!r}: payload digest {found} != {expected} recorded by "
                "the finalizer; the row changed after it was judged, so this step is not trained"
            )
    token_ids = [row[TOKEN_IDS].tolist() for row in rows]
    return TrainBatch(
        token_ids=token_ids,
        token_mask=[row[TOKEN_MASK].tolist() for row in rows],
        generation_logprobs=[row[LOGPROBS].tolist() for row in rows],
        advantages=list(plan.advantages),
        routed_experts=batch_routes([decode_row_routes(row) for row in rows], [len(ids) for ids in token_ids]),
    )


class TrainRowCleaner:
    """Clears trained (or abandoned) rows from the train partition; every call bounded."""

    def __init__(self, client: DataPlaneClient, partition: str, timeout_s: float) -> None:
        self.client, self.partition, self._timeout_s = client, partition, timeout_s

    def clear(self, keys: Sequence[str]) -> None:
        if keys:
            self.client.clear(self.partition, list(keys), timeout_s=self._timeout_s)

    def remaining(self) -> list[str]:
        return self.client.list_keys(self.partition, timeout_s=self._timeout_s)
