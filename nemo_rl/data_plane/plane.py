"""The data plane's set-up: start the TransferQueue deployment once per Ray job, attach once per process.

`start_data_plane(cfg)` (driver, after Ray is up) starts one controller and
`cfg.num_storage_units` storage units (`num_cpus=0`) within `cfg.startup_timeout_s` and returns
the `DataPlane` that owns them; a data plane already running is an error, never silently
shared. `DataPlane.shutdown()` kills exactly its own actors, once, and is the only call that
stops the controller (clients then fail by deadline or an `unavailable` `DataPlaneError`, never hang).
`probes()` gives a rollout-path probe per actor (`tq_controller`, `tq_storage_unit_<i>`).
`attach_client(cfg)` (from a coroutine: `attach_client_async`, which never blocks the event loop)
connects a private `DataPlaneClient` in any process of the job, within `cfg.call_timeout_s`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import ray

from nemo_rl.data.errors import error_name
from nemo_rl.data_plane import tq_backend
from nemo_rl.data_plane.client import DataPlaneClient, LoopThread, transport_failure
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.data_plane.errors import DataPlaneError, DataPlaneTimeoutError
from nemo_rl.distributed.component_watch import Probe, Role, ray_actor_probe


class DataPlane:
    """Handle on the TQ controller and storage-unit actors one `start_data_plane` created."""

    def __init__(self, cfg: DataPlaneConfig, actors: tq_backend.StartedActors, startup_s: float) -> None:
        """Use `start_data_plane(cfg)`; this constructor only records what was started."""
        self.cfg = cfg
        self.startup_s = startup_s
        self._actors = actors
        self._stopped = False
        self._lock = threading.Lock()

    @property
    def controller(self) -> Any:
        """The controller's Ray actor handle."""
        return self._actors.controller

    @property
    def storage_units(self) -> dict[str, Any]:
        """Storage-unit Ray actor handles by name."""
        return dict(self._actors.storage_units)

    def actors(self) -> dict[str, Any]:
        """Every actor by component name: `tq_controller`, then `tq_storage_unit_<i>` in start order."""
        named = {"tq_controller": self._actors.controller}
        for index, handle in enumerate(self._actors.storage_units.values()):
            named[f"tq_storage_unit_{index}"] = handle
        return named

    def probes(self) -> list[Probe]:
        return [ray_actor_probe(name, Role.ROLLOUT_PATH, handle, f"TransferQueue {name.removeprefix('tq_')}")
                for name, handle in self.actors().items()]

    @property
    def stopped(self) -> bool:
        return self._stopped

    def shutdown(self) -> None:
        """Kill the actors this data plane started (idempotent; a no-op once Ray itself is down)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if ray.is_initialized():
            tq_backend.kill_actors(self._actors)


def start_data_plane(cfg: DataPlaneConfig) -> DataPlane:
    """Start the TransferQueue controller and storage units in the current Ray cluster."""
    if not ray.is_initialized():
        raise DataPlaneError(
            "Ray is not initialized; call init_local_ray(...) before start_data_plane", kind="unavailable"
        )
    tq_backend.prepare_process(cfg)
    started = time.monotonic()
    actors = tq_backend.start_actors(cfg)
    return DataPlane(cfg, actors, startup_s=time.monotonic() - started)


# ---------------------------------------------------------------- attach (once per process)


def attach_client(cfg: DataPlaneConfig, *, timeout_s: float | None = None) -> DataPlaneClient:
    """Connect a new private client to the running data plane, within the deadline."""
    deadline = cfg.call_timeout_s if timeout_s is None else timeout_s
    # The first import of transfer_queue (torch, zmq, ...) can take longer than a call deadline
    # in a fresh actor on a loaded host; it cannot hang, so only the network part is bounded.
    tq_backend.prepare_process(cfg)
    started = time.monotonic()
    conf = tq_backend.fetch_published_conf(deadline)
    return _connect(cfg, conf, deadline, started)


async def attach_client_async(cfg: DataPlaneConfig, *, timeout_s: float | None = None) -> DataPlaneClient:
    """`attach_client` from a coroutine: the same client and deadline, without blocking the event loop.

    The controller's config is awaited (no `ray.get` runs: Ray warns about any blocking get in an
    asyncio actor's process), and the blocking steps (TQ's import, the storage handshake) run on
    worker threads.
    """
    deadline = cfg.call_timeout_s if timeout_s is None else timeout_s
    await asyncio.to_thread(tq_backend.prepare_process, cfg)
    started = time.monotonic()
    conf = await tq_backend.fetch_published_conf_async(deadline)
    return await asyncio.to_thread(_connect, cfg, conf, deadline, started)


def _connect(cfg: DataPlaneConfig, conf: Any, deadline: float, started: float) -> DataPlaneClient:
    """The storage handshake of `attach_client` (blocking), within what is left of `deadline` since `started`."""
    errors = tq_backend.tq_errors()
    loop = LoopThread(name="nrl-data-plane-client")

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
            f"attaching a TransferQueue client failed in transport: {error_name(cause)}: {cause}",
            kind="transport",
        ) from e
    return DataPlaneClient(cfg, loop, tq_client, errors)
