"""Write-behind staging: a worker's staged rows reach TransferQueue off the response path.

Contract:
- `StageWriter.submit(rollout_id, key, row)` queues one staged row and returns at once; one
  background thread drains the queue and writes whatever has queued up (at most `max_batch`
  rows) in ONE data-plane `put_many` under the `timeout_s` deadline. With several calls in flight
  their rows share a write, so a call costs at most one write and often a fraction of one.
- `wait_keys(keys, timeout_s)` is the parent barrier: it blocks until none of `keys` is queued or
  in flight here (or the deadline passes) and returns `{key: why}` for those of them this writer
  failed to write or is still writing; keys it never queued are ignored. A zero deadline
  never blocks (the worker checks that way first, off-thread waits only when a parent is pending).
- `flush(rollout_ids, timeout_s)` is the report barrier: it blocks until no row of those rollouts is
  queued or in flight (or the deadline passes) and returns `{staging_key: why}` for every row of
  theirs that is not known to be written: its write failed (the data-plane error, named), or it
  was still pending at the deadline. It forgets what it returned. A rollout with nothing
  pending and nothing failed returns `{}` at once.
- Failures are remembered per rollout for at most `max_rollouts` rollouts (least recently
  failed dropped first, counted in `stats["failures_evicted_rollouts"]`), so a run that never
  flushes cannot grow the worker without bound.
- A data-plane error (`DataPlaneError`: deadline, dead controller or storage unit) fails only its
  batch; the writer keeps serving. Any other exception is a bug: its batch is failed, the writer
  stops, and every later `submit` raises `StageWriterFailedError` naming the cause (Gym's capture
  core turns that into `capture_failed` coordinates: the call is served, never claimed staged).
- `close(timeout_s)` stops taking rows, lets the thread write what is queued and joins it.

Why a response may leave before its row is written (the safety argument; the design doc has it
in full): a call's row is durable before anything uses the call as a parent or reads its row:
- a child of the call served by this worker is generated only after `wait_keys` saw its parents'
  rows written (the worker answers 503 `staging_unavailable` otherwise);
- the finalizer reads a rollout's rows only after the driver took the workers' served-call report
  for it, and a worker answers that report only after `flush` (rows that failed are reported
  `staged=False` with the reason, so the judge and the yield metric see them);
- another worker resolving the row as a `staging_chain` parent waits (bounded) for a missing key
  (`TQTokenSource(missing_wait_s=...)`);
- every row that is read is checked against the digest the gate committed, so a row that never
  landed or landed different cannot train: its chain becomes a placeholder.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_rl.data_plane import DataPlaneError
from nemo_rl.token_capture import wire_metrics  # opt-in counters (benchmarks/capture_ab.py)

DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_ROLLOUTS = 16_384


class BatchStore(Protocol):
    """What the writer needs from the data plane (`DataPlaneClient` implements it)."""

    def put_many(
        self, partition: str, keys: Sequence[str], rows: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None
    ) -> None: ...


class StageWriterFailedError(RuntimeError):
    """The write-behind thread stopped on a bug; nothing more can be staged by this worker."""


@dataclass(frozen=True, slots=True)
class _Queued:
    rollout_id: str
    key: str
    row: Mapping[str, Any]


class StageWriter:
    def __init__(
        self,
        store: BatchStore,
        partition: str,
        *,
        timeout_s: float,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_rollouts: int = DEFAULT_MAX_ROLLOUTS,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 (token_capture.stage_timeout_s)")
        if max_batch < 1 or max_rollouts < 1:
            raise ValueError(f"max_batch={max_batch}, max_rollouts={max_rollouts}: both must be >= 1")
        self._store = store
        self._partition = partition
        self._timeout_s = timeout_s
        self._max_batch = max_batch
        self._max_rollouts = max_rollouts
        self._cv = threading.Condition()
        self._queue: deque[_Queued] = deque()
        self._pending: dict[str, set[str]] = {}  # rollout_id -> keys queued or in flight
        self._failed: OrderedDict[str, dict[str, str]] = OrderedDict()  # rollout_id -> key -> why
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
            self._cv.notify_all()

    def flush(self, rollout_ids: Sequence[str], timeout_s: float) -> dict[str, str]:
        """Wait until the rollouts' rows are written; {staging_key: why} for those that are not."""
        ids = list(rollout_ids)
        started = time.monotonic()
        deadline = started + timeout_s
        with self._cv:
            while any(r in self._pending for r in ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            failures: dict[str, str] = {}
            for rollout_id in ids:
                failures.update(self._failed.pop(rollout_id, {}))
                for key in sorted(self._pending.get(rollout_id, ())):
                    failures[key] = f"staging write not finished within token_capture.stage_timeout_s={timeout_s}s"
            waited = time.monotonic() - started
            self.stats["flushes"] += 1
            self.stats["flush_wait_s"] += waited
        wire_metrics.add_counter("stage_flushes", 1)
        wire_metrics.add_counter("stage_flush_wait_s", waited)
        return failures

    def wait_keys(self, keys: Sequence[str], timeout_s: float) -> dict[str, str]:
        """Wait until none of `keys` is queued or in flight here; {key: why} for those not written.

        Keys this writer never queued are not its to answer for (another worker's, or written long
        ago): they are neither waited for nor reported. Failures are reported, not forgotten (the
        served report still names them).
        """
        wanted = set(keys)
        started = time.monotonic()
        deadline = started + timeout_s
        with self._cv:
            while wanted & self._pending_keys():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            lost = {key: why for failed in self._failed.values() for key, why in failed.items() if key in wanted}
            for key in wanted & self._pending_keys():
                lost[key] = f"staging write not finished within token_capture.stage_timeout_s={timeout_s}s"
            self.stats["parent_waits"] += 1
            self.stats["parent_wait_s"] += time.monotonic() - started
            return lost

    def _pending_keys(self) -> set[str]:
        return {key for keys in self._pending.values() for key in keys}

    def pending_rows(self) -> int:
        with self._cv:
            return sum(len(keys) for keys in self._pending.values())

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

    def _settle(self, batch: list[_Queued], error: str | None, elapsed_s: float) -> None:
        with self._cv:
            for item in batch:
                keys = self._pending.get(item.rollout_id)
                if keys is not None:
                    keys.discard(item.key)
                    if not keys:
                        del self._pending[item.rollout_id]
                if error is not None:
                    self._failed.setdefault(item.rollout_id, {})[item.key] = error
                    self._failed.move_to_end(item.rollout_id)
            while len(self._failed) > self._max_rollouts:
                self._failed.popitem(last=False)
                self.stats["failures_evicted_rollouts"] += 1
            self.stats["batches"] += 1
            self.stats["rows"] += len(batch)
            self.stats["write_s"] += elapsed_s
            self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(batch))
            if error is not None:
                self.stats["failed_rows"] += len(batch)
            self._cv.notify_all()
        wire_metrics.add_counter("stage_write_batches", 1)
        wire_metrics.add_counter("stage_write_rows", len(batch))
        wire_metrics.add_counter("stage_write_s", elapsed_s)
