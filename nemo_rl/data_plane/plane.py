"""The owner side: start the TransferQueue deployment once per Ray job, stop it once.

`start_data_plane(cfg)` (driver, after Ray is up) starts one controller and
`cfg.num_storage_units` storage units (`num_cpus=0`) within `cfg.startup_timeout_s` and returns
the `DataPlane` that owns them; a data plane already running is an error, never silently
shared. `DataPlane.shutdown()` kills exactly its own actors, once, and is the only call that
stops the controller (clients then fail by deadline or an `unavailable` `DataPlaneError`, never hang).
`probes()` gives a rollout-path probe per actor (`tq_controller`, `tq_storage_unit_<i>`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from nemo_rl.data_plane import tq_backend
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.data_plane.errors import DataPlaneError
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
