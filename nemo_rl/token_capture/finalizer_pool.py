"""Finalizer actors: fetch a rollout's staged snapshots and run the judge off the driver.

Contract:
- `FinalizerWorker` is a thin Ray actor shell. Its snapshot source is built inside the actor by
  the `source_factory` passed in (so the real TransferQueue source, whose client cannot be
  pickled, is created where it is used). `finalize(evidence)` fetches the snapshots of every
  committed record of the evidence's manifest (`finalizer.fetch_snapshots`: per-key faults
  become typed problems) and returns a `WorkerReply` holding `judge.judge_rollout`'s verdict:
  the same pure judge the driver and `capture_one_rollout.py` use. An exception inside the
  actor is a bug (data faults are verdicts, never exceptions): it surfaces as
  `FinalizerBugError` with the actor's traceback and stops the run.
  `TQSourceFactory` builds the real TransferQueue source (`TQTokenSource` over
  `DataPlaneClient.attach`).
- Router replay (R3) in `judge_from_source`: a kept rollout's row gets `routed_experts` (an int16
  `[len(row), L, K]` array, -1 where a token has no route) when at least one of its calls'
  manifest records commits to non-empty extras (`extras_digest != EMPTY_EXTRAS_DIGEST`). All such
  calls of the rollout are read in ONE `source.fetch_extras` call, each payload bound to its
  manifest record's `extras_digest` (what the verified chain committed to); rollouts whose
  calls staged no extras make no extras round trip and keep `routed_experts=None`, as does a row
  whose fetched extras carry no `routed_experts` value. Each call's delta splits into carry then
  `gen_len` = the mask-1 count of its staged snapshot's `token_mask_delta` (never the row mask:
  a call owned by an earlier row is masked out in later rows but its routes still apply), and
  the routes are placed by `router_replay.build_router_replay` (Gym's `classify_route_span`).
  Extras that cannot be fetched, fail their digest or are not valid route fragments make the
  rollout a placeholder with detail `router_replay_extras: <error>` (an MoE must not train
  without its routes silently): reason `verification_failed` for a digest mismatch, an invalid
  record or a malformed/mismatched fragment, `staged_record_missing` for a missing key and
  `data_plane_error` for an unavailable store (the same mapping as `fetch_snapshots`). A source
  without `fetch_extras` is a misconfiguration and raises `TypeError` (only when routes are needed).
- `FinalizerPool.finalize_group(items)` answers exactly one `FinalizeOutcome` per item, in item
  order, never raising for a per-item failure: each actor call is bounded by `call_timeout_s`
  (expiry -> finalize_timeout), a dead actor -> finalizer_unavailable; a task error raises
  `FinalizerBugError`. Work is spread round-robin over healthy workers; a worker that timed out or
  died gets no new work and is killed and replaced once its last in-flight call has resolved.
- Queue wait = worker start time - driver submit time (wall clock, both on the same host for
  a meaningful number), reported per answered item; None when the worker never answered.
- `shutdown()` kills only this pool's actors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from nemo_gym.token_id_capture.staging import EMPTY_EXTRAS_DIGEST, CallRecord, StagedCallBaseSnapshot
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.finalizer import SnapshotSource, fetch_snapshots
from nemo_rl.token_capture.judge import RolloutEvidence, judge_rollout
from nemo_rl.token_capture.receipt import reward_of
from nemo_rl.token_capture.router_replay import (
    CallRoutes,
    RoutedExpertsDecodeError,
    RouteShapeMismatchError,
    RouteShapeUnknownError,
    RouteValueError,
    RowRoutes,
    build_router_replay,
    decode_call_routes,
    routes_from_extras,
)
from nemo_rl.token_capture.rows import GroupEntry, KeptRollout, Placeholder, PlaceholderReason, RolloutYield, TrainRow
from nemo_rl.token_capture.staging import (
    StagedKeysMissingError,
    StagingFetchError,
    StagingStoreUnavailableError,
    TQTokenSource,
)

LOGGER = logging.getLogger(__name__)


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


class FinalizerBugError(RuntimeError):
    """The judge raised inside a finalizer actor: a bug in our code, never a data verdict."""


@dataclass(frozen=True)
class WorkerReply:
    result: GroupEntry
    started_at_s: float  # worker wall clock when it began this item


@dataclass(frozen=True)
class FinalizeOutcome:
    result: GroupEntry
    queue_wait_ms: float | None  # None when the worker never answered


def judge_from_source(source: SnapshotSource, evidence: RolloutEvidence, cfg: TokenCaptureConfig) -> GroupEntry:
    """Fetch what the judge needs from the staging source, judge the rollout, attach R3 routes."""
    snapshots, problems = fetch_snapshots(source, evidence.staging_keys())
    verdict = judge_rollout(evidence, snapshots, problems, cfg)
    if not isinstance(verdict, KeptRollout):
        return verdict
    return attach_router_replay(source, evidence, snapshots, verdict)


# Route-payload faults that make a rollout's verdict (a RouteSpanError would be our own bug).
_ROUTE_DATA_ERRORS = (RoutedExpertsDecodeError, RouteShapeMismatchError, RouteValueError)
ROUTER_REPLAY_DETAIL_PREFIX = "router_replay_extras"


def attach_router_replay(
    source: Any, evidence: RolloutEvidence, snapshots: Mapping[str, StagedCallBaseSnapshot], kept: KeptRollout
) -> GroupEntry:
    """`kept` with `routed_experts` on every row that staged routes, or the extras-fault placeholder.

    See the module docstring. `snapshots` are the verified base snapshots the judge used (by
    staging key); `evidence.manifest` supplies each call's committed `extras_digest`.
    """
    records = {record.model_call_id: record for record in evidence.manifest.records}
    wanted: dict[str, CallRecord] = {}  # staging key -> record, rows' calls with non-empty extras
    for row in kept.rows:
        for call_id in row.model_call_ids:
            record = records[call_id]
            if record.extras_digest != EMPTY_EXTRAS_DIGEST:
                wanted.setdefault(record.staging_key, record)
    if not wanted:
        return kept
    fetch_extras = getattr(source, "fetch_extras", None)
    if not callable(fetch_extras):
        raise TypeError(
            f"rollout {kept.rollout_id} staged extras (router replay) but the staging source "
            f"{type(source).__name__} has no fetch_extras(keys, expected_extras_digests); use TQTokenSource"
        )
    keys = list(wanted)
    try:
        fetched = fetch_extras(keys, expected_extras_digests=[wanted[key].extras_digest for key in keys])
        extras = dict(zip(keys, fetched, strict=True))
        rows = tuple(_row_with_routes(row, records, snapshots, extras) for row in kept.rows)
    except StagingFetchError as error:
        return _extras_placeholder(kept, _fetch_reason(error), f"{type(error).__name__}: {error}")
    except _ROUTE_DATA_ERRORS as error:
        return _extras_placeholder(kept, PlaceholderReason.VERIFICATION_FAILED, f"{type(error).__name__}: {error}")
    return dataclasses.replace(kept, rows=rows)


def _fetch_reason(error: StagingFetchError) -> PlaceholderReason:
    if isinstance(error, StagedKeysMissingError):
        return PlaceholderReason.STAGED_RECORD_MISSING
    if isinstance(error, StagingStoreUnavailableError):
        return PlaceholderReason.DATA_PLANE_ERROR
    return PlaceholderReason.VERIFICATION_FAILED


def _row_with_routes(
    row: TrainRow,
    records: Mapping[str, CallRecord],
    snapshots: Mapping[str, StagedCallBaseSnapshot],
    extras: Mapping[str, dict[str, Any] | None],
) -> TrainRow:
    """The row with its `[len, L, K]` routes, or unchanged when none of its calls staged a route."""
    calls = []
    for call_id, (start, end) in zip(row.model_call_ids, row.call_spans, strict=True):
        record = records[call_id]
        gen_len = sum(1 for m in snapshots[record.staging_key].token_mask_delta if m == 1.0)
        payload = routes_from_extras(extras.get(record.staging_key))
        calls.append(CallRoutes(call_id, (end - start) - gen_len, gen_len, payload))
    payloads = [(call.model_call_id, call.routed_experts) for call in calls if call.routed_experts is not None]
    if not payloads:
        return row
    shaped = RowRoutes(tuple(calls), row.token_mask)
    try:
        batch = build_router_replay([shaped])
    except RouteShapeUnknownError:
        # Every fragment is too short to use: the row is all sentinel, shaped like its fragments.
        shapes = {decode_call_routes(call_id, payload).shape[1:] for call_id, payload in payloads}
        if len(shapes) != 1:
            raise RouteShapeMismatchError(f"row {row.rollout_id}#{row.chain_index}: fragments disagree on "
                                          f"(layers, topk): {sorted(shapes)}") from None
        ((layers, topk),) = shapes
        batch = build_router_replay([shaped], num_layers=int(layers), topk=int(topk))
    return dataclasses.replace(row, routed_experts=batch.routes[0])


def _extras_placeholder(kept: KeptRollout, reason: PlaceholderReason, error: str) -> Placeholder:
    """The kept rollout's slot, reward and terminal selection, masked for an extras fault."""
    served_yield = None
    if kept.yield_ is not None:
        served = kept.yield_.served_generated_tokens
        served_yield = RolloutYield(
            served, 0, ((reason.value, served),) if served else (), kept.yield_.chains, kept.yield_.witness_disagreement
        )
    return Placeholder(
        kept.rollout_id, kept.group_index, kept.sample_index, reason, f"{ROUTER_REPLAY_DETAIL_PREFIX}: {error}",
        kept.reward, kept.terminal_selection, served_yield,
    )


def evidence_placeholder(evidence: RolloutEvidence, reason: PlaceholderReason, detail: str) -> Placeholder:
    """A transport verdict (the finalizer could not judge): keeps the run's reward for metrics."""
    reward = reward_of(evidence.run_result) if evidence.run_result is not None else None
    return Placeholder(evidence.rollout_id, evidence.group_index, evidence.sample_index, reason, detail, reward)


class FinalizerWorker:
    """Thin actor shell around `judge_from_source` (plain class, usable without Ray)."""

    def __init__(self, source_factory: SourceFactory, cfg: TokenCaptureConfig) -> None:
        self._source = source_factory()
        self._cfg = cfg

    def ready(self) -> bool:
        return True

    def finalize(self, evidence: RolloutEvidence) -> WorkerReply:
        started_at_s = time.time()
        result = judge_from_source(self._source, evidence, self._cfg)
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
        self, num_workers: int, source_factory: SourceFactory, call_timeout_s: float, cfg: TokenCaptureConfig,
        *, worker_num_cpus: float = 0.0,
    ) -> None:
        if num_workers < 1:
            raise FinalizerPoolError(
                f"num_workers must be >= 1, got {num_workers}; set token_capture.num_finalizer_workers >= 1"
            )
        if not call_timeout_s > 0:
            raise FinalizerPoolError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self._source_factory = source_factory
        self._cfg = cfg
        self._call_timeout_s = float(call_timeout_s)
        self._worker_num_cpus = worker_num_cpus
        self._workers = [_WorkerSlot(i, self._spawn()) for i in range(num_workers)]
        self._cursor = 0
        self._closed = False
        self.replacements = 0

    @classmethod
    def from_config(cls, cfg: TokenCaptureConfig, source_factory: SourceFactory) -> "FinalizerPool":
        """`num_finalizer_workers` actors, each call bounded by `finalize_timeout_s`."""
        return cls(cfg.num_finalizer_workers, source_factory, cfg.finalize_timeout_s, cfg)

    def _spawn(self) -> ray.actor.ActorHandle:
        return _RemoteFinalizerWorker.options(num_cpus=self._worker_num_cpus).remote(self._source_factory, self._cfg)

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

    async def _finalize_one(self, item: RolloutEvidence) -> FinalizeOutcome:
        slot = self._pick()
        slot.inflight += 1
        submitted_at_s = time.time()
        try:
            ref = slot.handle.finalize.remote(item)
            reply: WorkerReply = await asyncio.wait_for(ref, self._call_timeout_s)
        except RayTaskError as error:
            # First: Ray re-raises a task's TimeoutError as a subclass of TimeoutError too, which the
            # deadline branch below would misread as "the actor gave no answer".
            raise FinalizerBugError(
                f"finalizer worker {slot.index} raised while judging rollout {item.rollout_id} (a bug, not a data "
                f"fault):\n{error}"
            ) from error
        except (asyncio.TimeoutError, GetTimeoutError):
            slot.suspect = True
            return self._failed(item, PlaceholderReason.FINALIZE_TIMEOUT,
                                f"finalizer worker {slot.index} gave no answer within {self._call_timeout_s}s")
        except RayActorError as error:
            slot.suspect = True
            return self._failed(
                item, PlaceholderReason.FINALIZER_UNAVAILABLE, f"finalizer worker {slot.index} died: {error}"
            )
        finally:
            self._release(slot)
        wait_ms = max(0.0, (reply.started_at_s - submitted_at_s) * 1000.0)
        return FinalizeOutcome(result=reply.result, queue_wait_ms=wait_ms)

    @staticmethod
    def _failed(item: RolloutEvidence, reason: PlaceholderReason, detail: str) -> FinalizeOutcome:
        return FinalizeOutcome(result=evidence_placeholder(item, reason, detail), queue_wait_ms=None)

    async def finalize_group(self, items: Sequence[RolloutEvidence]) -> list[FinalizeOutcome]:
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
