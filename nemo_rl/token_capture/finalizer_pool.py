"""Finalizer actors: fetch a rollout's staged snapshots and run `finalize_rollout` off the driver.

Contract:
- `FinalizerWorker` is a thin Ray actor shell. Its snapshot source is built inside the actor by
  the `source_factory` passed in (so the real TransferQueue source, whose client cannot be
  pickled, is created where it is used). `finalize(receipt_json, group_index, sample_index)`
  fetches one snapshot per manifest row IN MANIFEST ORDER and returns a `WorkerReply`; every
  failure is already a typed `Placeholder` before it crosses the Ray boundary: missing keys
  (`StagedKeysMissingError`) or a short answer -> staged_record_missing; a stored record that
  fails Gym's validation (`StagedRecordInvalidError`) -> verification_failed; an unavailable
  store or any other source error -> data_plane_error. `TQSourceFactory` builds the real
  TransferQueue source (`TQTokenSource` over `DataPlaneClient.attach`).
- `FinalizerPool.finalize_group(items)` answers exactly one `FinalizeOutcome` per item, in item
  order, never raising for a per-item failure: each actor call is bounded by `call_timeout_s`
  (expiry -> finalize_timeout), a dead actor -> finalizer_unavailable, a task error ->
  data_plane_error. Work is spread round-robin over healthy workers; a worker that timed out or
  died gets no new work and is killed and replaced once its last in-flight call has resolved.
- Queue wait = worker start time - driver submit time (wall clock, both on the same host for
  a meaningful number), reported per answered item; None when the worker never answered.
- `shutdown()` kills only this pool's actors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from nemo_gym.token_id_capture.staging import RolloutReceipt, StagedCallBaseSnapshot

from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.finalizer import finalize_rollout, receipt_placeholder
from nemo_rl.token_capture.rows import GroupEntry, PlaceholderReason
from nemo_rl.token_capture.staging import (
    StagedKeysMissingError,
    StagedRecordInvalidError,
    StagingFetchError,
    TQTokenSource,
)

LOGGER = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """Gym's `StagingSource` shape (`TQTokenSource` implements it): one base snapshot per key, in
    key order, or a `StagingFetchError` subclass naming the keys (missing / invalid / unavailable).
    """

    def fetch(self, staging_keys: list[str]) -> list[StagedCallBaseSnapshot]: ...


SourceFactory = Callable[[], SnapshotSource]


@dataclass(frozen=True)
class TQSourceFactory:
    """Builds the TransferQueue staging source inside the actor (a TQ client cannot be pickled)."""

    data_plane: DataPlaneConfig
    partition: str
    timeout_s: float

    @classmethod
    def from_config(cls, data_plane: DataPlaneConfig, capture: TokenCaptureConfig) -> "TQSourceFactory":
        return cls(data_plane, capture.staging_partition, capture.stage_timeout_s)

    def __call__(self) -> TQTokenSource:
        return TQTokenSource(DataPlaneClient.attach(self.data_plane), self.partition, timeout_s=self.timeout_s)


class FinalizerPoolError(RuntimeError):
    """The pool cannot serve: misconfigured, not ready within its deadline, or shut down."""


@dataclass(frozen=True)
class FinalizeItem:
    """One unpoisoned receipt to finalize, with its place in the GRPO group."""

    receipt: RolloutReceipt
    group_index: int
    sample_index: int


@dataclass(frozen=True)
class WorkerReply:
    result: GroupEntry
    started_at_s: float  # worker wall clock when it began this item


@dataclass(frozen=True)
class FinalizeOutcome:
    result: GroupEntry
    queue_wait_ms: float | None  # None when the worker never answered


def finalize_from_source(
    source: SnapshotSource, receipt: RolloutReceipt, *, group_index: int, sample_index: int
) -> GroupEntry:
    """Fetch the receipt's snapshots in manifest order and finalize; data faults become placeholders."""
    slot = {"group_index": group_index, "sample_index": sample_index}
    if receipt.capture_poisoned or receipt.reward is None:
        return finalize_rollout(receipt, (), **slot)
    keys = [record.staging_key for record in receipt.manifest]
    try:
        snapshots = source.fetch(keys)
    except StagedKeysMissingError as error:
        return receipt_placeholder(receipt, PlaceholderReason.STAGED_RECORD_MISSING, str(error), **slot)
    except StagedRecordInvalidError as error:
        detail = f"invalid_staged_record: {error}"
        return receipt_placeholder(receipt, PlaceholderReason.VERIFICATION_FAILED, detail, **slot)
    except StagingFetchError as error:
        detail = f"{type(error).__name__}: {error}"
        return receipt_placeholder(receipt, PlaceholderReason.DATA_PLANE_ERROR, detail, **slot)
    if len(snapshots) != len(keys):
        answered = {s.staging_key for s in snapshots if isinstance(s, StagedCallBaseSnapshot)}
        missing = [key for key in keys if key not in answered]
        return receipt_placeholder(
            receipt, PlaceholderReason.STAGED_RECORD_MISSING,
            f"{len(snapshots)} snapshots for {len(keys)} keys; missing {missing}", **slot,
        )
    return finalize_rollout(receipt, snapshots, **slot)


class FinalizerWorker:
    """Thin actor shell around `finalize_from_source` (plain class, usable without Ray)."""

    def __init__(self, source_factory: SourceFactory) -> None:
        self._source = source_factory()

    def ready(self) -> bool:
        return True

    def finalize(self, receipt_json: str, group_index: int, sample_index: int) -> WorkerReply:
        started_at_s = time.time()
        receipt = RolloutReceipt.model_validate_json(receipt_json)
        try:
            result = finalize_from_source(self._source, receipt, group_index=group_index, sample_index=sample_index)
        except Exception as error:  # the Ray boundary: the source is third-party, ship a typed verdict
            LOGGER.exception("finalizing rollout %s failed", receipt.rollout_id)
            result = receipt_placeholder(
                receipt, PlaceholderReason.DATA_PLANE_ERROR, f"{type(error).__name__}: {error}",
                group_index=group_index, sample_index=sample_index,
            )
        return WorkerReply(result=result, started_at_s=started_at_s)


_RemoteFinalizerWorker = ray.remote(FinalizerWorker)


@dataclass
class _WorkerSlot:
    index: int
    handle: ray.actor.ActorHandle
    inflight: int = 0
    suspect: bool = False  # timed out or died: no new work; replaced when inflight drops to 0


class FinalizerPool:
    """Round-robin pool of `FinalizerWorker` actors with a deadline on every call."""

    def __init__(
        self, num_workers: int, source_factory: SourceFactory, call_timeout_s: float, *, worker_num_cpus: float = 0.0
    ) -> None:
        if num_workers < 1:
            raise FinalizerPoolError(
                f"num_workers must be >= 1, got {num_workers}; set token_capture.num_finalizer_workers >= 1"
            )
        if not call_timeout_s > 0:
            raise FinalizerPoolError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self._source_factory = source_factory
        self._call_timeout_s = float(call_timeout_s)
        self._worker_num_cpus = worker_num_cpus
        self._workers = [_WorkerSlot(i, self._spawn()) for i in range(num_workers)]
        self._cursor = 0
        self._closed = False
        self.replacements = 0

    @classmethod
    def from_config(cls, cfg: TokenCaptureConfig, source_factory: SourceFactory) -> "FinalizerPool":
        """`num_finalizer_workers` actors, each call bounded by `finalize_timeout_s`."""
        return cls(cfg.num_finalizer_workers, source_factory, cfg.finalize_timeout_s)

    def _spawn(self) -> ray.actor.ActorHandle:
        return _RemoteFinalizerWorker.options(num_cpus=self._worker_num_cpus).remote(self._source_factory)

    async def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker has built its source (one shared deadline); failures name the workers."""
        pending = {asyncio.ensure_future(slot.handle.ready.remote()): slot.index for slot in self._workers}
        done, late = await asyncio.wait(pending, timeout=timeout_s)
        for future in late:
            future.cancel()
        if late:
            raise FinalizerPoolError(
                f"finalizer workers {sorted(pending[f] for f in late)} not ready within {timeout_s}s"
            )
        dead = {pending[future]: future.exception() for future in done if future.exception() is not None}
        if dead:
            causes = "; ".join(f"{index}: {error}" for index, error in sorted(dead.items()))
            raise FinalizerPoolError(f"finalizer workers died while starting ({causes})")

    def _pick(self) -> _WorkerSlot:
        healthy = [slot for slot in self._workers if not slot.suspect] or self._workers
        slot = healthy[self._cursor % len(healthy)]
        self._cursor += 1
        return slot

    def _release(self, slot: _WorkerSlot) -> None:
        slot.inflight -= 1
        if slot.suspect and slot.inflight == 0 and not self._closed:
            ray.kill(slot.handle, no_restart=True)
            slot.handle = self._spawn()
            slot.suspect = False
            self.replacements += 1

    async def _finalize_one(self, item: FinalizeItem) -> FinalizeOutcome:
        slot = self._pick()
        slot.inflight += 1
        submitted_at_s = time.time()
        try:
            ref = slot.handle.finalize.remote(item.receipt.model_dump_json(), item.group_index, item.sample_index)
            reply: WorkerReply = await asyncio.wait_for(ref, self._call_timeout_s)
        except (asyncio.TimeoutError, GetTimeoutError):
            slot.suspect = True
            return self._failed(item, PlaceholderReason.FINALIZE_TIMEOUT,
                                f"finalizer worker {slot.index} gave no answer within {self._call_timeout_s}s")
        except RayActorError as error:
            slot.suspect = True
            return self._failed(
                item, PlaceholderReason.FINALIZER_UNAVAILABLE, f"finalizer worker {slot.index} died: {error}"
            )
        except RayTaskError as error:
            return self._failed(item, PlaceholderReason.DATA_PLANE_ERROR, f"finalizer worker {slot.index}: {error}")
        finally:
            self._release(slot)
        wait_ms = max(0.0, (reply.started_at_s - submitted_at_s) * 1000.0)
        return FinalizeOutcome(result=reply.result, queue_wait_ms=wait_ms)

    @staticmethod
    def _failed(item: FinalizeItem, reason: PlaceholderReason, detail: str) -> FinalizeOutcome:
        placeholder = receipt_placeholder(
            item.receipt, reason, detail, group_index=item.group_index, sample_index=item.sample_index
        )
        return FinalizeOutcome(result=placeholder, queue_wait_ms=None)

    async def finalize_group(self, items: Sequence[FinalizeItem]) -> list[FinalizeOutcome]:
        """One outcome per item, in item order (see the module docstring)."""
        if self._closed:
            raise FinalizerPoolError("finalize_group called after shutdown(); build a new FinalizerPool")
        return list(await asyncio.gather(*(self._finalize_one(item) for item in items)))

    def shutdown(self) -> None:
        """Kill this pool's actors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for slot in self._workers:
            ray.kill(slot.handle, no_restart=True)
