"""The data plane's transport: `DataPlaneClient` (bounded kv calls) and `StageWriter` (write-behind puts).

`DataPlaneClient` (made by `plane.attach_client`) runs TQ's kv calls on its own loop thread. Every
call is bounded (`DataPlaneTimeoutError`); methods are thread-safe; `get` returns exactly one row
per key in request order or raises `MissingKeysError` (TQ drops missing keys silently); a write is
readable by every client once `put` / `put_many` returns; `close()` detaches this client only.
Weather vs bugs: only a transport failure in the explicit cause chain is a `DataPlaneError`; an
undecodable answer is a `decode` `DataPlaneBugError`; anything else propagates with a note naming the call.
`StageWriter` writes a worker's queued rows in batches off the reply path; each queued key is
pending, written or lost. Barriers: `when_written`, `wait_keys` (parents) and `flush` (the served
report: never returns with a row pending; at its deadline rows are withdrawn or abandoned, lost).
A `DataPlaneError` fails only its batch; a bug stops the writer (`DataPlaneBugError`, kind `stage_writer`).
See docs/design-docs/distributed.md ("The data-plane client"), vllm-worker-capture.md ("The stage writer").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from nemo_rl.data.calls import Row
from nemo_rl.data.errors import error_name
from nemo_rl.data_plane import tq_backend
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.data_plane.errors import DataPlaneBugError, DataPlaneError, DataPlaneTimeoutError, MissingKeysError
from nemo_rl.data_plane.fields import Schema, batch_schema, check_fields, check_keys, unique_in_order
from nemo_rl.utils import instrumentation  # opt-in counters (benchmarks/capture_ab.py)
from nemo_rl.utils.lru import BoundedLRU

T = TypeVar("T")

# Extra time the calling thread waits beyond the in-loop deadline, so the in-loop wait_for (which
# cancels TQ's coroutine and closes its socket) normally fires first.
_CALLER_GRACE_S = 0.5
_LOOP_STOP_TIMEOUT_S = 5.0


# ---------------------------------------------------------------- TQ's kv calls (run on the client's loop)


def transport_failure(error: BaseException, transport: tuple[type[BaseException], ...]) -> BaseException | None:
    """The transport failure (one of `TQErrors.transport`) in `error`'s explicit cause chain, or None.

    TQ wraps a failure in its own `RuntimeError(...) from cause`; implicit context (raised while
    handling another) is not followed: that is a bug in the handler, not weather.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, transport):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


def rows_to_tensordict(rows: list[Row], schema: Schema) -> Any:
    """Columns for one batch put: jagged int64/float64 tensors, non-tensor stacks for str/bytes."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    columns: dict[str, Any] = {}
    for name, kind in schema:
        values = [row[name] for row in rows]
        if kind in ("int64", "float64"):
            columns[name] = torch.nested.nested_tensor(values, layout=torch.jagged)
        else:
            columns[name] = NonTensorStack(*values)
    return TensorDict(columns, batch_size=[len(rows)])


def _column(data: Any, name: str, count: int) -> list[Any]:
    value = data[name]
    if isinstance(value, torch.Tensor):
        items = list(value.unbind()) if value.is_nested else [value[i] for i in range(value.shape[0])]
    elif isinstance(value, (str, bytes)):
        items = [value]
    else:
        items = list(value)
    if len(items) != count:
        raise DataPlaneBugError(f"TransferQueue returned {len(items)} values for field {name!r}, expected {count} "
                                "(one per key): the answer does not decode as one row per key", kind="decode")
    return items


async def put_rows(client: Any, partition: str, keys: list[str], rows: list[Row], schema: Schema) -> None:
    """Write rows under keys (overwriting existing keys); returns once the controller has ACKed."""
    meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=True)
    if meta.size != len(keys):
        raise DataPlaneBugError(f"put on partition {partition!r}: the controller registered {meta.size} of "
                                f"{len(keys)} keys asked with create=True", kind="decode")
    await client.async_put(rows_to_tensordict(rows, schema), meta)


async def _keys_lacking(client: Any, partition: str, keys: list[str], fields: list[str]) -> list[str]:
    """Keys (in order) that are absent or lack one of fields, checked one by one (error path only)."""
    lacking = []
    for key in keys:
        meta = await client.async_kv_retrieve_meta(keys=[key], partition_id=partition, create=False)
        if meta.size == 0 or not set(fields) <= set(meta.field_names):
            lacking.append(key)
        elif not meta.select_fields(fields).is_ready:
            lacking.append(key)
    return lacking


async def _unreadable(client: Any, partition: str, keys: list[str], fields: list[str], race: str) -> DataPlaneError:
    """`MissingKeysError` for the keys lacking a field, or (none lacks one) the `race` error."""
    missing = await _keys_lacking(client, partition, keys, fields)
    if missing:
        return MissingKeysError(partition, missing, fields)
    return DataPlaneError(f"get on partition {partition!r}: {race}", kind="race")


async def get_rows(
    client: Any, partition: str, keys: list[str], fields: list[str], key_not_found: type[BaseException]
) -> list[Row]:
    """Rows for unique keys, in key order; `MissingKeysError` names the absent keys or, when none is
    absent, those lacking a requested field. `key_not_found` is `TQErrors.key_not_found`."""
    meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
    if meta.size != len(keys):
        # TQ dropped the absent keys; one reverse lookup names them without a per-key scan.
        found = await client.async_kv_retrieve_keys(meta.global_indexes, partition) if meta.size else []
        present = set(found)
        raise MissingKeysError(partition, [k for k in keys if k not in present], fields)
    complete = set(fields) <= set(meta.field_names)
    if complete:
        meta = meta.select_fields(fields)
        complete = meta.is_ready
    if not complete:
        raise await _unreadable(client, partition, keys, fields, "TQ reported the batch incomplete but every key "
                                "is readable on its own; a concurrent write or clear raced this read, retry it")
    try:
        data = await client.async_get_data(meta)
    except key_not_found as e:
        # TQ's documented race: a concurrent clear removed a key between its metadata and its data.
        raise await _unreadable(client, partition, keys, fields, f"a storage unit lost a key the controller still "
                                f"lists ({e}); a concurrent clear raced this read, retry it") from e
    columns = {name: _column(data, name, len(keys)) for name in fields}
    return [{name: columns[name][i] for name in fields} for i in range(len(keys))]


async def list_partition_keys(client: Any, partition: str) -> list[str]:
    """Keys registered in the partition ([] when the partition does not exist)."""
    info = await client.async_kv_list(partition)
    return list(info.get(partition, {}))


async def clear_keys(client: Any, partition: str, keys: list[str]) -> None:
    """Remove keys and their data; absent keys are ignored (clearing is idempotent)."""
    meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=False)
    if meta.size > 0:
        await client.async_clear_samples(meta)


class LoopThread:
    """One asyncio loop on a daemon thread; runs coroutines with a hard deadline."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, make_coro: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """Result of the coroutine, or builtin TimeoutError once timeout_s has passed."""

        async def bounded() -> T:
            return await asyncio.wait_for(make_coro(), timeout_s)

        if self.loop.is_closed():
            raise DataPlaneError("this data plane client is closed", kind="closed")
        future = asyncio.run_coroutine_threadsafe(bounded(), self.loop)
        try:
            return future.result(timeout=timeout_s + _CALLER_GRACE_S)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        """Cancel what is still running, stop the loop and join its thread."""

        async def cancel_pending() -> None:
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(cancel_pending(), self.loop).result(timeout=_LOOP_STOP_TIMEOUT_S)
            except TimeoutError as e:
                raise DataPlaneError(f"data plane client loop {self.thread.name!r} is blocked; could not cancel its "
                                     f"calls within {_LOOP_STOP_TIMEOUT_S} s", kind="client_loop") from e
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=_LOOP_STOP_TIMEOUT_S)
        if self.thread.is_alive():
            raise DataPlaneError(f"data plane client loop thread {self.thread.name!r} did not stop within "
                                 f"{_LOOP_STOP_TIMEOUT_S} s", kind="client_loop")
        self.loop.close()


class DataPlaneClient:
    """Key/row access to the TransferQueue data plane from any process of the Ray job."""

    def __init__(self, cfg: DataPlaneConfig, loop: LoopThread, tq_client: Any, errors: tq_backend.TQErrors) -> None:
        """Use `attach_client(cfg)` (`plane`); this constructor only wires already-built parts."""
        self.cfg = cfg
        self._loop = loop
        self._tq = tq_client
        self._errors = errors
        self._closed = False
        self._close_lock = threading.Lock()

    def _call(self, operation: str, partition: str, make_coro: Callable[[], Awaitable[T]], timeout_s: float | None) -> T:
        if self._closed:
            raise DataPlaneError(f"data plane {operation} on partition {partition!r}: this client is closed", kind="closed")
        if not isinstance(partition, str) or not partition:
            raise DataPlaneBugError(
                f"data plane {operation}: partition must be a non-empty str, got {partition!r} (fix the caller)",
                kind="usage")
        deadline = self.cfg.call_timeout_s if timeout_s is None else timeout_s
        try:
            return self._loop.run(make_coro, deadline)
        except TimeoutError as e:
            raise DataPlaneTimeoutError(operation, partition, deadline) from e
        except (asyncio.CancelledError, concurrent.futures.CancelledError) as e:
            raise DataPlaneError(f"data plane {operation} on partition {partition!r} was cancelled because the "
                                 "client closed", kind="closed") from e
        except DataPlaneError:
            raise
        except Exception as e:
            cause = transport_failure(e, self._errors.transport)
            if cause is None:
                e.add_note(f"raised inside data plane {operation} on partition {partition!r}: not a TransferQueue "
                           "transport failure, so it is not data-plane weather (a bug, or a component's refusal)")
                raise
            raise DataPlaneError(f"data plane {operation} on partition {partition!r} failed in TransferQueue's "
                                 f"transport: {error_name(cause)}: {cause}", kind="transport") from e

    def put(self, partition: str, key: str, fields: Mapping[str, Any], *, timeout_s: float | None = None) -> None:
        """Write one row under key (overwrites an existing key)."""
        self.put_many(partition, [key], [fields], timeout_s=timeout_s)

    def put_many(
        self, partition: str, keys: Sequence[str], rows: Sequence[Mapping[str, Any]], *, timeout_s: float | None = None
    ) -> None:
        """Write rows under keys in one batch (all rows share one schema)."""
        keys, rows = list(keys), [dict(r) for r in rows]
        schema = batch_schema(keys, rows)
        self._call("put", partition, lambda: put_rows(self._tq, partition, keys, rows, schema), timeout_s)

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str], *, timeout_s: float | None = None
    ) -> list[Row]:
        """One row per key (request order) with the selected fields; MissingKeysError if any is absent."""
        check_keys(keys, "get")
        check_fields(fields)
        unique, fields = unique_in_order(keys), list(fields)
        key_not_found = self._errors.key_not_found
        rows = self._call("get", partition, lambda: get_rows(self._tq, partition, unique, fields, key_not_found), timeout_s)
        by_key = dict(zip(unique, rows))
        return [dict(by_key[k]) for k in keys]

    def list_keys(self, partition: str, *, timeout_s: float | None = None) -> list[str]:
        """Keys registered in the partition ([] when it does not exist)."""
        return self._call("list_keys", partition, lambda: list_partition_keys(self._tq, partition), timeout_s)

    def clear(self, partition: str, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        """Remove keys and their data; absent keys are ignored."""
        check_keys(keys, "clear")
        unique = unique_in_order(keys)
        self._call("clear", partition, lambda: clear_keys(self._tq, partition, unique), timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Detach this client (idempotent). The shared controller and storage keep running."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._loop.stop()
        tq_backend.close_client(self._tq)

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------- write-behind staging (the vLLM worker)

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
    def __init__(self, store: BatchStore, partition: str, *, timeout_s: float, max_batch: int = DEFAULT_MAX_BATCH,
                 max_rollouts: int = DEFAULT_MAX_ROLLOUTS, max_written_keys: int = DEFAULT_MAX_WRITTEN_KEYS) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 (token_capture.stage_timeout_s)")
        if max_batch < 1 or max_rollouts < 1 or max_written_keys < 1:
            raise ValueError(f"max_batch={max_batch}, max_rollouts={max_rollouts}, "
                             f"max_written_keys={max_written_keys}: all must be >= 1")
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
                raise DataPlaneBugError(
                    f"the stage writer for partition {self._partition!r} stopped on "
                    f"{error_name(self._fatal)}: {self._fatal}; staging key {key!r} was not queued",
                    kind="stage_writer",
                ) from self._fatal
            if self._closed:
                raise DataPlaneBugError(f"the stage writer for {self._partition!r} is closed; {key!r} not queued",
                                        kind="stage_writer")
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
                self._store.put_many(self._partition, [q.key for q in batch], [q.row for q in batch],
                                     timeout_s=self._timeout_s)
            except DataPlaneError as e:  # recoverable: this batch fails, the next one is tried
                error = f"staging write failed: {error_name(e)}: {e}"
            except BaseException as e:  # a bug: fail this batch and every queued row (finally), stop, surface
                self._fatal = e
                error = f"stage writer crashed: {error_name(e)}: {e}"
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
                    self._lose(item.rollout_id, item.key, f"stage writer crashed: {error_name(self._fatal)}: {self._fatal}")
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
