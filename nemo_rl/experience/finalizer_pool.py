"""Finalizer actors: fetch a rollout's staged snapshots and run the judge off the driver.

`FinalizerWorker` is a thin Ray actor shell (its TransferQueue source and row store are built
inside the actor by factories); it runs the same pure judge as the driver
(`judge_group_from_source`, which attaches R3 routes), then hands every kept rollout to its row
store (`store_kept`): in a run, one write to the train partition (`TQTrainRowsFactory`) that
returns `RowRef`s, so capture rows reach the policy only through the data plane. `FinalizerPool.finalize_group`
answers exactly one `FinalizeOutcome` per item, in order, with one bounded actor call per
healthy worker; a timeout or dead actor is `finalize_timeout` / `finalizer_unavailable` for its
items, and the actor is replaced. Data faults are verdicts, never exceptions; an exception in an
actor is a bug (a `FinalizerPoolError` of kind `bug`) and stops the run. `probes()`, `mark_dead` and
`take_deaths()` serve the component watch; `shutdown()` kills only this pool's actors.
`fetch_snapshots(source, keys)` never raises for a per-key fault: missing, invalid or unavailable
keys become typed `FetchProblem`s, so the judge drops exactly the chains that need them.
See docs/design-docs/token-capture-receipts.md, "The finalizer pool".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import ray
from nemo_gym.token_id_capture.staging import StagedCallBaseSnapshot

from nemo_rl.data.errors import FatalError, Kinded, error_name
from nemo_rl.data.rows import GroupEntry, KeptRollout, Placeholder, PlaceholderReason
from nemo_rl.data.calls import StagedRecordInvalidError, StagingFetchError
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig, DataPlaneError, FieldEncodingError, attach_client
from nemo_rl.data_plane.partitions import StagedKeysMissingError, TQTokenSource, store_many_rows
from nemo_rl.distributed.actor_call import ActorCallTimeoutError, ActorDiedError, ActorRaisedError, await_with_deadline
from nemo_rl.distributed.component_watch import Probe, Role, first_line, ray_actor_probe
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import (FetchProblem, RolloutEvidence, all_served_lost, fetch_error_reason,
                                         judge_rollout, reward_of)
from nemo_rl.token_capture.router_replay import attach_router_replay

LOGGER = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """Gym's `StagingSource` shape (`TQTokenSource` implements it): one base snapshot per key, in
    key order, or a `StagingFetchError` subclass naming the keys (missing / invalid / unavailable).
    """

    def fetch(self, staging_keys: list[str]) -> list[StagedCallBaseSnapshot]: ...


def fetch_snapshots(
    source: SnapshotSource, keys: Sequence[str]
) -> tuple[dict[str, StagedCallBaseSnapshot], dict[str, FetchProblem]]:
    """Every readable snapshot by key, and a typed problem for every key that is not."""
    pending = list(dict.fromkeys(keys))
    problems: dict[str, FetchProblem] = {}
    for _ in range(len(pending) + 1):
        if not pending:
            return {}, problems
        try:
            snapshots = source.fetch(pending)
        except StagedKeysMissingError as error:
            missing = [key for key in error.keys if key in pending] or list(pending)
            for key in missing:
                problems[key] = FetchProblem(fetch_error_reason(error), str(error))
            pending = [key for key in pending if key not in problems]
            continue
        except StagedRecordInvalidError as error:
            key = error.key if error.key in pending else pending[0]
            problems[key] = FetchProblem(fetch_error_reason(error), f"invalid_staged_record: {error}")
            pending = [k for k in pending if k != key]
            continue
        except StagingFetchError as error:
            for key in pending:
                problems[key] = FetchProblem(fetch_error_reason(error), f"{error_name(error)}: {error}")
            return {}, problems
        by_key = {}
        for key, snapshot in zip(pending, snapshots):
            if isinstance(snapshot, StagedCallBaseSnapshot) and snapshot.staging_key == key:
                by_key[key] = snapshot
        for key in pending:
            if key not in by_key:
                problems[key] = FetchProblem(
                    PlaceholderReason.STAGED_RECORD_MISSING, f"the source answered {len(snapshots)} snapshots for "
                    f"{len(pending)} keys and none for {key}")
        return by_key, problems
    raise AssertionError("unreachable: every iteration removes at least one pending key")


SourceFactory = Callable[[], SnapshotSource]
RowStore = Callable[[Sequence[KeptRollout]], list[KeptRollout]]  # rows -> RowRefs, all in one write
RowStoreFactory = Callable[[], RowStore]
TRAIN_PARTITION_DETAIL_PREFIX = "train_partition"


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
        return TQTokenSource(attach_client(self.data_plane), self.partition, timeout_s=self.timeout_s)


@dataclass(frozen=True)
class TQTrainRowsFactory:
    """Builds the train-partition row store inside the actor (`partitions.store_many_rows` over its own client)."""

    data_plane: DataPlaneConfig
    partition: str
    timeout_s: float
    carry_prompt_ids: bool  # logger.dump_first_call_prompt_ids: the driver's dump needs them

    def __call__(self) -> RowStore:
        return functools.partial(
            _store_with, attach_client(self.data_plane), self.partition, self.timeout_s, self.carry_prompt_ids
        )


def _store_with(
    client: DataPlaneClient, partition: str, timeout_s: float, carry_prompt_ids: bool, kept: Sequence[KeptRollout]
) -> list[KeptRollout]:
    return store_many_rows(client, partition, kept, timeout_s, carry_prompt_ids)


def split_evenly(items: list[RolloutEvidence], parts: int) -> list[list[RolloutEvidence]]:
    """`items` in order, cut into at most `parts` non-empty contiguous chunks whose sizes differ by <= 1."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        chunks.append(items[start:end])
        start = end
    return [chunk for chunk in chunks if chunk]


FinalizerPoolKind = Literal["config", "start", "closed", "bug"]
"""Why the pool stops the run: it is misconfigured; its workers were not ready within the deadline
or died while starting; it was shut down; or a worker raised while judging (or answered another
number of verdicts than items): a bug in our code, never a data verdict."""


class FinalizerPoolError(Kinded, FatalError, RuntimeError):
    """The pool cannot serve, or a finalizer actor hit a bug; `kind` says which (`FinalizerPoolKind`)."""

    KINDS = typing.get_args(FinalizerPoolKind)
    kind: FinalizerPoolKind

    def __init__(self, message: str, *, kind: FinalizerPoolKind) -> None:
        super().__init__(message, kind=kind)


@dataclass(frozen=True)
class WorkerReply:
    result: GroupEntry
    started_at_s: float  # worker wall clock when it began this item


@dataclass(frozen=True)
class FinalizeOutcome:
    result: GroupEntry
    queue_wait_ms: float | None  # None when the worker never answered


def judge_from_source(source: SnapshotSource, evidence: RolloutEvidence, cfg: TokenCaptureConfig) -> GroupEntry:
    """`judge_group_from_source` for one rollout."""
    return judge_group_from_source(source, [evidence], cfg)[0]


def judge_group_from_source(
    source: SnapshotSource, items: Sequence[RolloutEvidence], cfg: TokenCaptureConfig
) -> list[GroupEntry]:
    """Fetch what the judge needs for every item in ONE read, judge each rollout and attach R3
    routes; one verdict per item, in item order, kept rows whole (`store_kept` moves them out).

    A failed run's verdict needs no snapshot (the judge decides it first): its keys are not
    fetched, so a dead data plane cannot hold a component-failure verdict up by `stage_timeout_s`.
    Keys are per rollout (`<rollout_id>/<call>`), so one shared fetch gives each judge exactly
    its own snapshots and problems.
    """
    keys = [key for ev in items if ev.run_failure is None for key in ev.staging_keys()]
    snapshots, problems = fetch_snapshots(source, keys) if keys else ({}, {})
    verdicts: list[GroupEntry] = []
    for ev in items:
        verdict = judge_rollout(ev, snapshots, problems, cfg) if ev.run_failure is None else judge_rollout(ev, {}, {}, cfg)
        if isinstance(verdict, KeptRollout) and ev.staged_extras():  # R3 runs for MoE rollouts only
            verdict = attach_router_replay(source, ev, snapshots, verdict)
        verdicts.append(verdict)
    return verdicts


def store_kept(items: Sequence[RolloutEvidence], verdicts: Sequence[GroupEntry], rows: RowStore) -> list[GroupEntry]:
    """`verdicts` with every kept rollout's rows stored by `rows` in ONE write (their `RowRef`s in
    place); a `DataPlaneError` makes each of them a `data_plane_error` placeholder."""
    out = list(verdicts)
    kept = [i for i, verdict in enumerate(out) if isinstance(verdict, KeptRollout)]
    if not kept:
        return out
    try:
        stored = rows([out[i] for i in kept])
    except FieldEncodingError:
        raise  # our encoding of a row is wrong: a bug, never a data verdict
    except DataPlaneError as error:
        detail = f"{TRAIN_PARTITION_DETAIL_PREFIX}: {error_name(error)}: {error}"
        stored = [_store_failed(items[i], out[i], detail) for i in kept]
    for i, verdict in zip(kept, stored, strict=True):
        out[i] = verdict
    return out


def _store_failed(evidence: RolloutEvidence, verdict: KeptRollout, detail: str) -> Placeholder:
    reason = PlaceholderReason.DATA_PLANE_ERROR
    chains = verdict.yield_.chains if verdict.yield_ is not None else 0
    return Placeholder(
        verdict.rollout_id, verdict.group_index, verdict.sample_index, reason, detail, verdict.reward,
        verdict.terminal_selection, all_served_lost(evidence, reason.value, chains),
    )


def evidence_placeholder(evidence: RolloutEvidence, reason: PlaceholderReason, detail: str) -> Placeholder:
    """A transport verdict (the finalizer could not judge): keeps the run's reward for metrics."""
    reward = reward_of(evidence.run_result) if evidence.run_result is not None else None
    return Placeholder(evidence.rollout_id, evidence.group_index, evidence.sample_index, reason, detail, reward)


class FinalizerWorker:
    """Thin actor shell around `judge_group_from_source` and `store_kept` (plain class, usable without Ray)."""

    def __init__(self, source_factory: SourceFactory, cfg: TokenCaptureConfig, rows_factory: RowStoreFactory) -> None:
        self._source = source_factory()
        self._rows = rows_factory()
        self._cfg = cfg

    def ready(self) -> bool:
        return True

    def finalize(self, evidence: RolloutEvidence) -> WorkerReply:
        return self.finalize_many([evidence])[0]

    def finalize_many(self, items: Sequence[RolloutEvidence]) -> list[WorkerReply]:
        """One reply per item: one staging read and one train-partition write for all of them."""
        started_at_s = time.time()
        results = store_kept(items, judge_group_from_source(self._source, list(items), self._cfg), self._rows)
        return [WorkerReply(result=result, started_at_s=started_at_s) for result in results]


_RemoteFinalizerWorker = ray.remote(FinalizerWorker)


@dataclass
class _WorkerSlot:
    index: int
    handle: ray.actor.ActorHandle
    inflight: int = 0
    suspect: bool = False  # timed out or died: no new work; replaced when inflight drops to 0
    generation: int = 0  # replacements of this slot so far

    @property
    def name(self) -> str:
        return f"finalizer_{self.index}" + (f"_r{self.generation}" if self.generation else "")


class FinalizerPool:
    """Round-robin pool of `FinalizerWorker` actors with a deadline on every call."""

    def __init__(
        self, num_workers: int, source_factory: SourceFactory, call_timeout_s: float, cfg: TokenCaptureConfig,
        *, rows_factory: RowStoreFactory, worker_num_cpus: float = 0.0,
    ) -> None:
        if num_workers < 1:
            raise FinalizerPoolError(
                f"num_workers must be >= 1, got {num_workers}; set token_capture.num_finalizer_workers >= 1",
                kind="config",
            )
        if not call_timeout_s > 0:
            raise FinalizerPoolError(f"call_timeout_s must be > 0, got {call_timeout_s}", kind="config")
        self._source_factory = source_factory
        self._rows_factory = rows_factory
        self._cfg = cfg
        self._call_timeout_s = float(call_timeout_s)
        self._worker_num_cpus = worker_num_cpus
        self._workers = [_WorkerSlot(i, self._spawn()) for i in range(num_workers)]
        self._cursor = 0
        self._closed = False
        self.replacements = 0
        self._deaths: dict[str, str] = {}  # actor name -> description, reported once

    @classmethod
    def from_config(
        cls, cfg: TokenCaptureConfig, source_factory: SourceFactory, rows_factory: RowStoreFactory
    ) -> "FinalizerPool":
        """`num_finalizer_workers` actors, each call bounded by `finalize_timeout_s`."""
        return cls(cfg.num_finalizer_workers, source_factory, cfg.finalize_timeout_s, cfg, rows_factory=rows_factory)

    def _spawn(self) -> ray.actor.ActorHandle:
        return _RemoteFinalizerWorker.options(num_cpus=self._worker_num_cpus).remote(self._source_factory, self._cfg, self._rows_factory)

    async def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker has built its source (one shared deadline); failures name the workers."""
        pending = {asyncio.ensure_future(slot.handle.ready.remote()): slot.index for slot in self._workers}
        done, late = await asyncio.wait(pending, timeout=timeout_s)
        for future in late:
            future.cancel()
        if late:
            raise FinalizerPoolError(
                f"finalizer workers {sorted(pending[f] for f in late)} not ready within {timeout_s}s", kind="start"
            )
        dead = {pending[future]: future.exception() for future in done if future.exception() is not None}
        if dead:
            causes = "; ".join(f"{index}: {error}" for index, error in sorted(dead.items()))
            raise FinalizerPoolError(f"finalizer workers died while starting ({causes})", kind="start")

    def _pick(self) -> _WorkerSlot:
        healthy = [slot for slot in self._workers if not slot.suspect] or self._workers
        slot = healthy[self._cursor % len(healthy)]
        self._cursor += 1
        return slot

    def _replace_if_idle(self, slot: _WorkerSlot) -> None:
        if slot.suspect and slot.inflight == 0 and not self._closed:
            ray.kill(slot.handle, no_restart=True)
            slot.handle = self._spawn()
            slot.suspect = False
            slot.generation += 1
            self.replacements += 1

    def _release(self, slot: _WorkerSlot) -> None:
        slot.inflight -= 1
        self._replace_if_idle(slot)

    def probes(self) -> list[Probe]:
        return [ray_actor_probe(name, Role.OFF_PATH, handle, f"finalizer worker {name}")
                for name, handle in self.actors().items()]

    def actors(self) -> dict[str, ray.actor.ActorHandle]:
        """The current actors by watch name."""
        return {slot.name: slot.handle for slot in self._workers}

    def mark_dead(self, name: str) -> bool:
        """Take the actor `name` out of rotation (replaced once idle); False if no current actor has that name."""
        for slot in self._workers:
            if slot.name == name:
                slot.suspect = True
                self._replace_if_idle(slot)
                return True
        return False

    def take_deaths(self) -> dict[str, str]:
        """Actors found dead by a failed call since the last call: name -> description."""
        deaths, self._deaths = self._deaths, {}
        return deaths

    async def _finalize_chunk(self, items: Sequence[RolloutEvidence]) -> list[FinalizeOutcome]:
        slot = self._pick()
        slot.inflight += 1
        submitted_at_s = time.time()
        what = (f"rollout {items[0].rollout_id}" if len(items) == 1
                else f"{len(items)} rollouts ({items[0].rollout_id} .. {items[-1].rollout_id})")
        try:
            ref = slot.handle.finalize_many.remote(list(items))
            replies: list[WorkerReply] = await await_with_deadline(
                ref, actor=slot.name, op="finalize_many", timeout_s=self._call_timeout_s)
        except ActorRaisedError as error:
            raise FinalizerPoolError(
                f"finalizer worker {slot.index} raised while judging {what} (a bug, not a data fault):\n{error.cause}",
                kind="bug",
            ) from error.cause
        except ActorCallTimeoutError:
            slot.suspect = True
            return self._failed(items, PlaceholderReason.FINALIZE_TIMEOUT,
                                f"finalizer worker {slot.index} gave no answer within {self._call_timeout_s}s")
        except ActorDiedError as error:
            slot.suspect = True
            assert error.cause is not None
            cause = first_line(error.cause)
            self._deaths.setdefault(slot.name, f"finalizer worker {slot.index} (Ray actor) died: {cause}")
            return self._failed(items, PlaceholderReason.FINALIZER_UNAVAILABLE,
                                f"finalizer worker {slot.index} died: {cause}")
        finally:
            self._release(slot)
        if len(replies) != len(items):
            raise FinalizerPoolError(f"finalizer worker {slot.index} answered {len(replies)} verdicts for {what}",
                                     kind="bug")
        return [FinalizeOutcome(result=reply.result, queue_wait_ms=max(0.0, (reply.started_at_s - submitted_at_s) * 1000.0))
                for reply in replies]

    @staticmethod
    def _failed(items: Sequence[RolloutEvidence], reason: PlaceholderReason, detail: str) -> list[FinalizeOutcome]:
        return [FinalizeOutcome(result=evidence_placeholder(item, reason, detail), queue_wait_ms=None) for item in items]

    async def finalize_group(self, items: Sequence[RolloutEvidence]) -> list[FinalizeOutcome]:
        """One outcome per item, in item order (see the module docstring)."""
        if self._closed:
            raise FinalizerPoolError("finalize_group called after shutdown(); build a new FinalizerPool", kind="closed")
        chunks = split_evenly(list(items), sum(1 for slot in self._workers if not slot.suspect) or 1)
        answers = await asyncio.gather(*(self._finalize_chunk(chunk) for chunk in chunks))
        return [outcome for answer in answers for outcome in answer]

    def shutdown(self) -> None:
        """Kill this pool's actors (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for slot in self._workers:
            ray.kill(slot.handle, no_restart=True)
