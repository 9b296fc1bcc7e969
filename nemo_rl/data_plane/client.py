"""`DataPlaneClient`: a synchronous, deadline-bounded handle on the shared data plane.

Works in any process of the Ray job once the owner ran `start_data_plane` (`attach`, or
`attach_async` from a coroutine, which never blocks the event loop). Promises: every call is
bounded, even if TQ's loop blocks (`DataPlaneTimeoutError`); methods are thread-safe; `get`
returns exactly one row per key in request order or raises `MissingKeysError`; a write is
readable by every client once `put` / `put_many` returns; `close()` detaches this client only.
Invariant (weather vs bugs): only what the transport can cause is a `DataPlaneError`; every
other exception from TQ propagates unchanged, with a note naming the operation and partition.
See docs/design-docs/distributed.md, "The data-plane client".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from nemo_rl.data.calls import Row
from nemo_rl.data_plane import tq_backend
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.data_plane.errors import (
    DataPlaneError,
    DataPlaneTimeoutError,
    DataPlaneUsageError,
)
from nemo_rl.data_plane.fields import batch_schema, check_fields, check_keys, unique_in_order

T = TypeVar("T")

# Extra time the calling thread waits beyond the in-loop deadline, so the in-loop wait_for (which
# cancels TQ's coroutine and closes its socket) normally fires first.
_CALLER_GRACE_S = 0.5
_LOOP_STOP_TIMEOUT_S = 5.0


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

    def __init__(self, cfg: DataPlaneConfig, loop: _LoopThread, tq_client: Any) -> None:
        """Use `DataPlaneClient.attach(cfg)`; this constructor only wires already-built parts."""
        self.cfg = cfg
        self._loop = loop
        self._tq = tq_client
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
            cause = tq_backend.transport_failure(e)
            if cause is None:
                e.add_note("raised while attaching a TransferQueue client: not a transport failure, so not retried")
                raise
            raise DataPlaneError(
                f"attaching a TransferQueue client failed in transport: {type(cause).__name__}: {cause}",
                kind="transport",
            ) from e
        return cls(cfg, loop, tq_client)

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
            cause = tq_backend.transport_failure(e)
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
        self._call("put", partition, lambda: tq_backend.put_rows(self._tq, partition, keys, rows, schema), timeout_s)

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
        rows = self._call("get", partition, lambda: tq_backend.get_rows(self._tq, partition, unique, fields), timeout_s)
        by_key = dict(zip(unique, rows))
        return [dict(by_key[k]) for k in keys]

    def list_keys(self, partition: str, *, timeout_s: float | None = None) -> list[str]:
        """Keys registered in the partition ([] when it does not exist)."""
        return self._call("list_keys", partition, lambda: tq_backend.list_keys(self._tq, partition), timeout_s)

    def clear(self, partition: str, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        """Remove keys and their data; absent keys are ignored."""
        check_keys(keys, "clear")
        unique = unique_in_order(keys)
        self._call("clear", partition, lambda: tq_backend.clear_keys(self._tq, partition, unique), timeout_s)

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

