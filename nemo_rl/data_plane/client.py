"""`DataPlaneClient`: a synchronous, deadline-bounded handle on the shared data plane, and TQ's kv calls.

Works in any process of the Ray job once the owner ran `start_data_plane` (`attach`, or
`attach_async` from a coroutine, which never blocks the event loop). Promises: every call is
bounded, even if TQ's loop blocks (`DataPlaneTimeoutError`); methods are thread-safe; `get`
returns exactly one row per key in request order or raises `MissingKeysError` (the kv calls
check that every requested key and field came back: TQ silently drops missing keys); a write is
readable by every client once `put` / `put_many` returns; `close()` detaches this client only.
Invariant (weather vs bugs): only what the transport can cause is a `DataPlaneError`
(`transport_failure` walks only the explicit cause chain); an undecodable answer is
`DataPlaneDecodeError`; every other exception from TQ propagates unchanged, with a note naming
the operation and partition. Set-up (TQ's import, attach handshake, types) is `tq_backend`'s.
See docs/design-docs/distributed.md, "The data-plane client".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from nemo_rl.data.calls import Row
from nemo_rl.data_plane import tq_backend
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.data_plane.errors import (
    DataPlaneDecodeError,
    DataPlaneError,
    DataPlaneTimeoutError,
    DataPlaneUsageError,
    MissingKeysError,
)
from nemo_rl.data_plane.fields import Schema, batch_schema, check_fields, check_keys, unique_in_order

T = TypeVar("T")

# Extra time the calling thread waits beyond the in-loop deadline, so the in-loop wait_for (which
# cancels TQ's coroutine and closes its socket) normally fires first.
_CALLER_GRACE_S = 0.5
_LOOP_STOP_TIMEOUT_S = 5.0


# ---------------------------------------------------------------- TQ's kv calls (run on the client's loop)


def transport_failure(error: BaseException, transport: tuple[type[BaseException], ...]) -> BaseException | None:
    """The transport failure (one of `transport`: `TQErrors.transport`) in `error`'s explicit cause chain, or None.

    TQ wraps what fails inside a call in its own `RuntimeError(...) from cause`, so the class of
    the outer exception says nothing; the cause chain does. Implicit context (an exception raised
    while another was handled) is not followed: that is a bug in the handler, not weather.
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
        raise DataPlaneDecodeError(f"TransferQueue returned {len(items)} values for field {name!r}, expected {count} "
                                   "(one per key): the answer does not decode as one row per key")
    return items


async def put_rows(client: Any, partition: str, keys: list[str], rows: list[Row], schema: Schema) -> None:
    """Write rows under keys (overwriting existing keys); returns once the controller has ACKed."""
    meta = await client.async_kv_retrieve_meta(keys=keys, partition_id=partition, create=True)
    if meta.size != len(keys):
        raise DataPlaneDecodeError(f"put on partition {partition!r}: the controller registered {meta.size} of "
                                   f"{len(keys)} keys asked with create=True")
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


async def get_rows(
    client: Any, partition: str, keys: list[str], fields: list[str], key_not_found: type[BaseException]
) -> list[Row]:
    """Rows for unique keys, in key order.

    MissingKeysError names the absent keys or, when none is absent, the keys lacking a requested
    field (registered but never written, or written without it). `key_not_found` is TQ's
    `StorageKeyNotFoundError` (`TQErrors.key_not_found`).
    """
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
        missing = await _keys_lacking(client, partition, keys, fields)
        if not missing:
            raise DataPlaneError(
                f"get on partition {partition!r}: TQ reported the batch incomplete but every key is readable "
                f"on its own; a concurrent write or clear raced this read, retry it",
                kind="race",
            )
        raise MissingKeysError(partition, missing, fields)
    try:
        data = await client.async_get_data(meta)
    except key_not_found as e:
        # TQ's documented race: a concurrent clear removed a key between its metadata and its data.
        missing = await _keys_lacking(client, partition, keys, fields)
        if not missing:
            raise DataPlaneError(
                f"get on partition {partition!r}: a storage unit lost a key the controller still lists ({e}); "
                "a concurrent clear raced this read, retry it",
                kind="race",
            ) from e
        raise MissingKeysError(partition, missing, fields) from e
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


class _LoopThread:
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
                raise DataPlaneError(
                    f"data plane client loop {self.thread.name!r} is blocked; could not cancel its calls "
                    f"within {_LOOP_STOP_TIMEOUT_S} s",
                    kind="client_loop",
                ) from e
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=_LOOP_STOP_TIMEOUT_S)
        if self.thread.is_alive():
            raise DataPlaneError(
                f"data plane client loop thread {self.thread.name!r} did not stop within {_LOOP_STOP_TIMEOUT_S} s",
                kind="client_loop",
            )
        self.loop.close()


class DataPlaneClient:
    """Key/row access to the TransferQueue data plane from any process of the Ray job."""

    def __init__(self, cfg: DataPlaneConfig, loop: _LoopThread, tq_client: Any, errors: tq_backend.TQErrors) -> None:
        """Use `DataPlaneClient.attach(cfg)`; this constructor only wires already-built parts."""
        self.cfg = cfg
        self._loop = loop
        self._tq = tq_client
        self._errors = errors
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def attach(cls, cfg: DataPlaneConfig, *, timeout_s: float | None = None) -> DataPlaneClient:
        """Connect a new private client to the running data plane, within the deadline."""
        deadline = cfg.call_timeout_s if timeout_s is None else timeout_s
        # The first import of transfer_queue (torch, zmq, ...) can take longer than a call deadline
        # in a fresh actor on a loaded host; it cannot hang, so only the network part is bounded.
        tq_backend.prepare_process(cfg)
        started = time.monotonic()
        conf = tq_backend.fetch_published_conf(deadline)
        return cls._connect(cfg, conf, deadline, started)

    @classmethod
    async def attach_async(cls, cfg: DataPlaneConfig, *, timeout_s: float | None = None) -> DataPlaneClient:
        """`attach` from a coroutine: the same client and deadline, without blocking the event loop.

        The controller's config is awaited (no `ray.get` runs: Ray warns about any blocking get in an
        asyncio actor's process), and the blocking steps (TQ's import, the storage handshake) run on
        worker threads.
        """
        deadline = cfg.call_timeout_s if timeout_s is None else timeout_s
        await asyncio.to_thread(tq_backend.prepare_process, cfg)
        started = time.monotonic()
        conf = await tq_backend.fetch_published_conf_async(deadline)
        return await asyncio.to_thread(cls._connect, cfg, conf, deadline, started)

    @classmethod
    def _connect(cls, cfg: DataPlaneConfig, conf: Any, deadline: float, started: float) -> DataPlaneClient:
        """The storage handshake of `attach` (blocking), within what is left of `deadline` since `started`."""
        errors = tq_backend.tq_errors()
        loop = _LoopThread(name="nrl-data-plane-client")

        async def build() -> Any:
            return await asyncio.to_thread(tq_backend.new_client, conf, cfg.client_zmq_io_threads)

        try:
            tq_client = loop.run(build, max(deadline - (time.monotonic() - started), 0.0))
        except TimeoutError as e:
            loop.stop()
            raise DataPlaneTimeoutError("attach", None, deadline, "storage-manager handshake with the controller") from e
        except Exception as e:
            loop.stop()
            cause = transport_failure(e, errors.transport)
            if cause is None:
                e.add_note("raised while attaching a TransferQueue client: not a transport failure, so not retried")
                raise
            raise DataPlaneError(
                f"attaching a TransferQueue client failed in transport: {type(cause).__name__}: {cause}",
                kind="transport",
            ) from e
        return cls(cfg, loop, tq_client, errors)

    def _call(self, operation: str, partition: str, make_coro: Callable[[], Awaitable[T]], timeout_s: float | None) -> T:
        if self._closed:
            raise DataPlaneError(
                f"data plane {operation} on partition {partition!r}: this client is closed", kind="closed"
            )
        if not isinstance(partition, str) or not partition:
            raise DataPlaneUsageError(
                f"data plane {operation}: partition must be a non-empty str, got {partition!r} (fix the caller)"
            )
        deadline = self.cfg.call_timeout_s if timeout_s is None else timeout_s
        try:
            return self._loop.run(make_coro, deadline)
        except TimeoutError as e:
            raise DataPlaneTimeoutError(operation, partition, deadline) from e
        except (asyncio.CancelledError, concurrent.futures.CancelledError) as e:
            raise DataPlaneError(
                f"data plane {operation} on partition {partition!r} was cancelled because the client closed",
                kind="closed",
            ) from e
        except DataPlaneError:
            raise
        except Exception as e:
            cause = transport_failure(e, self._errors.transport)
            if cause is None:
                e.add_note(f"raised inside data plane {operation} on partition {partition!r}: not a TransferQueue "
                           "transport failure, so it is not data-plane weather (a bug, or a component's refusal)")
                raise
            raise DataPlaneError(
                f"data plane {operation} on partition {partition!r} failed in TransferQueue's transport: "
                f"{type(cause).__name__}: {cause}",
                kind="transport",
            ) from e

    def put(self, partition: str, key: str, fields: Mapping[str, Any], *, timeout_s: float | None = None) -> None:
        """Write one row under key (overwrites an existing key)."""
        self.put_many(partition, [key], [fields], timeout_s=timeout_s)

    def put_many(
        self,
        partition: str,
        keys: Sequence[str],
        rows: Sequence[Mapping[str, Any]],
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Write rows under keys in one batch (all rows share one schema)."""
        keys, rows = list(keys), [dict(r) for r in rows]
        schema = batch_schema(keys, rows)
        self._call("put", partition, lambda: put_rows(self._tq, partition, keys, rows, schema), timeout_s)

    def get(
        self,
        partition: str,
        keys: Sequence[str],
        fields: Sequence[str],
        *,
        timeout_s: float | None = None,
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

