"""Write-behind staging: a worker's staged rows reach TransferQueue off the response path.

Owns `StageWriter`: `submit` queues a row and returns at once; one background thread writes
what has queued in one `put_many` per batch. Every key it queued is in exactly one state:
pending, written or lost; a key it never queued or forgot is unvouched (it proves nothing about
it). Barriers: `when_written` (run a hook once a row is durable), `wait_keys` (the parents'
check) and `flush` (the served-report barrier, which never returns with a row pending: at the
deadline queued rows are withdrawn and rows in a write abandoned, lost for good).
Refuses to carry on after a bug: a `DataPlaneError` fails only its batch, any other exception
stops the writer and every later `submit` raises `StageWriterFailedError`.
Invariant: a call's row is durable before the call is used as a parent or its row is read.
See docs/design-docs/vllm-worker-capture.md, "Staging behind the reply" and "The stage writer".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_rl.data.errors import FatalError
from nemo_rl.data_plane import DataPlaneError
from nemo_rl.utils import instrumentation  # opt-in counters (benchmarks/capture_ab.py)
from nemo_rl.utils.lru import BoundedLRU

LOGGER = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_ROLLOUTS = 16_384
# Written keys remembered so a same-worker child needs no read to know its parent is durable
# (about 0.1 KB each); a forgotten one is proven by a read instead, so the bound costs only speed.
DEFAULT_MAX_WRITTEN_KEYS = 65_536


class BatchStore(Protocol):
    """What the writer needs from the data plane (`DataPlaneClient` implements it)."""

    def put_many(
        self, partition: str, keys: Sequence[str], rows: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None
    ) -> None: ...


class StageWriterFailedError(FatalError, RuntimeError):
    """The write-behind thread stopped on a bug; nothing more can be staged by this worker."""


@dataclass(frozen=True, slots=True)
class _Queued:
    rollout_id: str
    key: str
    row: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ParentRows:
    """What the writer knows of a set of keys after `wait_keys` (see the module contract)."""

    lost: Mapping[str, str]  # key -> why its row is not durable (lost, or still pending at the deadline)
    unvouched: tuple[str, ...]  # keys neither written nor lost here: to be proven durable by a read


def _not_finished(timeout_s: float) -> str:
    return f"staging write not finished within token_capture.stage_timeout_s={timeout_s}s"


class StageWriter:
    def __init__(
        self,
        store: BatchStore,
        partition: str,
        *,
        timeout_s: float,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_rollouts: int = DEFAULT_MAX_ROLLOUTS,
        max_written_keys: int = DEFAULT_MAX_WRITTEN_KEYS,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 (token_capture.stage_timeout_s)")
        if max_batch < 1 or max_rollouts < 1 or max_written_keys < 1:
            raise ValueError(
                f"max_batch={max_batch}, max_rollouts={max_rollouts}, max_written_keys={max_written_keys}: "
                "all must be >= 1"
            )
        self._store = store
        self._partition = partition
        self._timeout_s = timeout_s
        self._max_batch = max_batch
        self._cv = threading.Condition()
        self._queue: deque[_Queued] = deque()
        self._pending: dict[str, set[str]] = {}  # rollout_id -> keys queued or in a write
        self._pending_keys: set[str] = set()
        self._abandoned: set[str] = set()  # in a write the report barrier gave up on (lost already)
        self._failed: BoundedLRU[str, dict[str, str]] = BoundedLRU(max_rollouts)  # rollout_id -> key -> why
        self._lost: dict[str, str] = {}  # key -> why, the same entries as `_failed`, by key
        self._written: BoundedLRU[str, None] = BoundedLRU(max_written_keys)  # keys whose write returned
        self._on_written: dict[str, list[Callable[[], object]]] = {}
        self._closed = False
        self._fatal: BaseException | None = None
        self.stats: Counter[str] = Counter()  # rows, batches, failed_rows, write_s, flush_wait_s, ...
        self._thread = threading.Thread(target=self._run, name=f"stage-writer:{partition}", daemon=True)
        self._thread.start()

    def submit(self, rollout_id: str, key: str, row: Mapping[str, Any]) -> None:
        """Queue one row; it is written by the background thread (see the module contract)."""
        with self._cv:
            if self._fatal is not None:
                raise StageWriterFailedError(
                    f"the stage writer for partition {self._partition!r} stopped on "
                    f"{type(self._fatal).__name__}: {self._fatal}; staging key {key!r} was not queued"
                ) from self._fatal
            if self._closed:
                raise StageWriterFailedError(f"the stage writer for {self._partition!r} is closed; {key!r} not queued")
            self._queue.append(_Queued(rollout_id, key, row))
            self._pending.setdefault(rollout_id, set()).add(key)
            self._pending_keys.add(key)
            self._cv.notify_all()

    def when_written(self, key: str, fn: Callable[[], object]) -> bool:
        """Run `fn` once `key` is written (see the module contract); False if it never will be."""
        with self._cv:
            if key in self._pending_keys:
                self._on_written.setdefault(key, []).append(fn)
                return True
            if not self._written.touch(key):
                return False  # lost, or unvouched
            fn()
            return True

    def flush(self, rollout_ids: Sequence[str], timeout_s: float) -> dict[str, str]:
        """Wait until the rollouts' rows are written; {staging_key: why} for those that are lost."""
        ids = list(rollout_ids)
        started = time.monotonic()
        deadline = started + timeout_s
        with self._cv:
            while any(r in self._pending for r in ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._give_up(set(ids), timeout_s)
                    break
                self._cv.wait(remaining)
            failures = {key: why for rollout_id in ids for key, why in (self._failed.peek(rollout_id) or {}).items()}
            waited = time.monotonic() - started
            self.stats["flushes"] += 1
            self.stats["flush_wait_s"] += waited
        instrumentation.add_counter("stage_flushes", 1)
        instrumentation.add_counter("stage_flush_wait_s", waited)
        return failures

    def _give_up(self, rollout_ids: set[str], timeout_s: float) -> None:
        """The report deadline passed: withdraw the rollouts' queued rows, abandon their writes (lock held)."""
        queued = [q for q in self._queue if q.rollout_id in rollout_ids]
        self._queue = deque(q for q in self._queue if q.rollout_id not in rollout_ids)
        withdrawn = {q.key for q in queued}
        for rollout_id in sorted(rollout_ids & set(self._pending)):
            for key in sorted(self._pending.pop(rollout_id)):
                self._pending_keys.discard(key)
                self._on_written.pop(key, None)
                if key in withdrawn:
                    why = f"{_not_finished(timeout_s)}: withdrawn from the queue, never written"
                    self.stats["withdrawn_rows"] += 1
                else:
                    why = f"{_not_finished(timeout_s)}: abandoned in its write, a late landing is never used"
                    self._abandoned.add(key)
                    self.stats["abandoned_rows"] += 1
                self._lose(rollout_id, key, why)
        self._cv.notify_all()

    def wait_keys(self, keys: Sequence[str], timeout_s: float) -> ParentRows:
        """Wait until none of `keys` is pending here; which are lost, and which this writer cannot vouch for."""
        wanted = list(dict.fromkeys(keys))
        started = time.monotonic()
        deadline = started + timeout_s
        with self._cv:
            while self._pending_keys.intersection(wanted):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            lost: dict[str, str] = {}
            unvouched: list[str] = []
            for key in wanted:
                if key in self._pending_keys:
                    lost[key] = _not_finished(timeout_s)
                elif key in self._lost:
                    lost[key] = self._lost[key]
                elif not self._written.touch(key):
                    unvouched.append(key)
            self.stats["parent_waits"] += 1
            self.stats["parent_wait_s"] += time.monotonic() - started
            return ParentRows(lost, tuple(unvouched))

    def pending_rows(self) -> int:
        with self._cv:
            return len(self._pending_keys)

    def close(self, timeout_s: float) -> None:
        """Write what is queued, then stop the thread (bounded by `timeout_s`)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    def _next_batch(self) -> list[_Queued] | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if not self._queue:
                return None  # closed and drained
            return [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            error: str | None = None
            started = time.perf_counter()
            try:
                self._store.put_many(
                    self._partition, [q.key for q in batch], [q.row for q in batch], timeout_s=self._timeout_s
                )
                error = None
            except DataPlaneError as e:  # recoverable: this batch fails, the next one is tried
                error = f"staging write failed: {type(e).__name__}: {e}"
            except BaseException as e:  # a bug: fail this batch and every queued row (finally), stop, surface
                self._fatal = e
                error = f"stage writer crashed: {type(e).__name__}: {e}"
                with self._cv:
                    batch = batch + list(self._queue)
                    self._queue.clear()
                raise
            finally:
                self._settle(batch, error, time.perf_counter() - started)
            if self._fatal is not None:  # a `when_written` callback raised while settling: a bug
                raise self._fatal

    def _lose(self, rollout_id: str, key: str, why: str) -> None:
        """Remember `key` as lost (lock held); the oldest rollouts' failures are evicted past the bound."""
        failed = self._failed.get(rollout_id)
        if failed is None:
            failed = {}
            for _, evicted in self._failed.put(rollout_id, failed):
                for old in evicted:
                    self._lost.pop(old, None)
                self.stats["failures_evicted_rollouts"] += 1
        failed[key] = why
        self._lost[key] = why

    def _settle(self, batch: list[_Queued], error: str | None, elapsed_s: float) -> None:
        with self._cv:
            for item in batch:
                if item.key in self._abandoned:  # the report already named it lost; its outcome changes nothing
                    self._abandoned.discard(item.key)
                    self.stats["late_rows_landed" if error is None else "late_rows_failed"] += 1
                    continue
                keys = self._pending.get(item.rollout_id)
                if keys is not None:
                    keys.discard(item.key)
                    if not keys:
                        del self._pending[item.rollout_id]
                self._pending_keys.discard(item.key)
                callbacks = self._on_written.pop(item.key, ())
                if error is not None:
                    self._lose(item.rollout_id, item.key, error)
                    continue
                self._written.put(item.key, None)
                for fn in callbacks:
                    if self._fatal is None:
                        self._call(fn, item.key)
            if self._fatal is not None and self._queue:
                for item in self._queue:  # a callback bug stops the writer: what is queued is lost
                    self._pending_keys.discard(item.key)
                    self._pending.get(item.rollout_id, set()).discard(item.key)
                    self._lose(item.rollout_id, item.key, f"stage writer crashed: {type(self._fatal).__name__}: {self._fatal}")
                self._pending = {r: keys for r, keys in self._pending.items() if keys}
                self._queue.clear()
            self.stats["batches"] += 1
            self.stats["rows"] += len(batch)
            self.stats["write_s"] += elapsed_s
            self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(batch))
            if error is not None:
                self.stats["failed_rows"] += len(batch)
            self._cv.notify_all()
        instrumentation.add_counter("stage_write_batches", 1)
        instrumentation.add_counter("stage_write_rows", len(batch))
        instrumentation.add_counter("stage_write_s", elapsed_s)

    def _call(self, fn: Callable[[], object], key: str) -> None:
        try:
            fn()
        except Exception as e:  # a bug in what the worker runs on a written row: stop loudly
            LOGGER.exception("when_written callback for %s raised; the stage writer stops", key)
            self._fatal = e
