"""TransferQueue's set-up, once per process: the one module that imports `transfer_queue` (TQ 0.1.11).

`prepare_process(cfg)` sets TQ's import-time knobs before importing it (other values already
imported: a `config` `DataPlaneError`); `start_actors` creates the controller and storage units with
`num_cpus=0`, under a deadline; `fetch_published_conf` reads the config the owner published, by a
deadline; each `new_client` is private (never TQ's process-global one); `tq_errors` hands the
per-call path TQ's exception types, so no other module imports TQ. Nothing here runs per call:
the kv calls, their completeness checks and failure classes are `client`'s.
See docs/design-docs/distributed.md, "The TransferQueue backend".
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from typing import Any

import ray

from nemo_rl.data.errors import error_name
from nemo_rl.data_plane.bind import loopback_actor
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.data_plane.errors import DataPlaneError, DataPlaneTimeoutError

# The names and namespace TQ's own `tq.init()` uses to find a running deployment, so a process
# that attaches with plain TQ still finds ours.
CONTROLLER_NAME = "TransferQueueController"
TQ_NAMESPACE = "transfer_queue"
STORAGE_UNIT_NAME = "TransferQueueStorageUnit#{rank}"
STORAGE_BACKEND = "SimpleStorage"
_CONFIG_POLL_INTERVAL_S = 0.2


def tq_env(cfg: DataPlaneConfig) -> dict[str, str]:
    """The TQ environment knobs for one config (for this process and the actors)."""
    return {
        "TQ_NUM_THREADS": str(cfg.tq_num_threads),
        "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": str(cfg.tq_storage_send_recv_timeout_s),
        "TQ_SIMPLE_STORAGE_MAX_ATTEMPTS": str(cfg.tq_storage_max_attempts),
        "TQ_LOGGING_LEVEL": cfg.tq_log_level,
    }


def _imported_knobs() -> dict[str, str]:
    """The knob values the already-imported TQ modules captured at import."""
    client = sys.modules["transfer_queue.client"]
    manager = sys.modules["transfer_queue.storage.managers.simple_storage_manager"]
    return {
        "TQ_NUM_THREADS": str(client.TQ_NUM_THREADS),
        "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT": str(manager.TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT),
        "TQ_SIMPLE_STORAGE_MAX_ATTEMPTS": str(manager.TQ_SIMPLE_STORAGE_MAX_ATTEMPTS),
    }


def prepare_process(cfg: DataPlaneConfig) -> None:
    """Set TQ's env knobs from cfg, then import TQ (once per process)."""
    wanted = tq_env(cfg)
    if "transfer_queue" in sys.modules:
        imported = _imported_knobs()
        conflicts = {k: (imported[k], wanted[k]) for k in imported if imported[k] != wanted[k]}
        if conflicts:
            raise DataPlaneError(
                f"transfer_queue was already imported in this process with knobs {conflicts} "
                f"(imported, requested); TQ reads them once at import. Use one DataPlaneConfig per process.",
                kind="config",
            )
        return
    os.environ.update(wanted)
    import transfer_queue  # noqa: F401  (the import is the point: it freezes the knobs just set)


def _tq_modules() -> Any:
    """TQ's modules, imported after `prepare_process` fixed the knobs."""
    if "transfer_queue" not in sys.modules:
        raise DataPlaneError("call prepare_process(cfg) before using TransferQueue in this process", kind="config")
    import transfer_queue.client as tq_client
    import transfer_queue.controller as tq_controller
    import transfer_queue.sampler as tq_sampler
    import transfer_queue.storage.simple_storage as tq_storage
    import transfer_queue.utils.common as tq_common

    return tq_client, tq_controller, tq_sampler, tq_storage, tq_common


# ---------------------------------------------------------------- owner side (driver)


@dataclass(frozen=True)
class StartedActors:
    """Actors one `start_actors` call created (and only those)."""

    controller: Any
    storage_units: dict[str, Any]


def controller_exists() -> bool:
    """Whether a TQ controller is already registered in this Ray cluster."""
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=TQ_NAMESPACE)
    except ValueError:
        return False
    return True


def _base_conf(cfg: DataPlaneConfig) -> Any:
    from omegaconf import OmegaConf

    conf = OmegaConf.merge(
        OmegaConf.create({}, flags={"allow_objects": True}),
        OmegaConf.load(resources.files("transfer_queue") / "config.yaml"),
    )
    conf.backend.storage_backend = STORAGE_BACKEND
    conf.backend.SimpleStorage.num_data_storage_units = cfg.num_storage_units
    conf.backend.SimpleStorage.total_storage_size = cfg.storage_capacity
    return conf


def kill_actors(actors: StartedActors) -> None:
    """Kill exactly these actors (storage units first, then the controller)."""
    for handle in actors.storage_units.values():
        ray.kill(handle, no_restart=True)
    ray.kill(actors.controller, no_restart=True)


def _create_actors(cfg: DataPlaneConfig, conf: Any, created: dict[str, Any]) -> None:
    """Create the controller and storage units, recording each handle in `created` as it exists."""
    _, tq_controller, tq_sampler, tq_storage, tq_common = _tq_modules()
    runtime_env = {"env_vars": tq_env(cfg)}
    controller_cls, storage_cls = tq_controller.TransferQueueController, tq_storage.SimpleStorageUnit
    if cfg.bind == "loopback":
        controller_cls, storage_cls = loopback_actor(controller_cls), loopback_actor(storage_cls)
    created[CONTROLLER_NAME] = controller_cls.options(
        name=CONTROLLER_NAME, namespace=TQ_NAMESPACE, num_cpus=0, runtime_env=runtime_env
    ).remote(sampler=tq_sampler.SequentialSampler, polling_mode=False)
    storage_conf = dict(conf.backend.SimpleStorage)
    storage_conf["_run_id"] = uuid.uuid4().hex
    strategies = tq_common.get_node_round_robin_scheduling_strategies(cfg.num_storage_units)
    for rank in range(cfg.num_storage_units):
        name = STORAGE_UNIT_NAME.format(rank=rank)
        created[name] = storage_cls.options(
            name=name, namespace=TQ_NAMESPACE, num_cpus=0, runtime_env=runtime_env, scheduling_strategy=strategies[rank]
        ).remote(config=storage_conf)


def _kill_created(created: dict[str, Any]) -> None:
    for handle in created.values():
        ray.kill(handle, no_restart=True)


def start_actors(cfg: DataPlaneConfig) -> StartedActors:
    """Start the controller and storage units; publish the config clients attach with."""
    if controller_exists():
        raise DataPlaneError(
            f"a TransferQueue controller {CONTROLLER_NAME!r} already runs in this Ray cluster; attach a "
            f"DataPlaneClient to it instead of starting a second data plane",
            kind="start",
        )
    deadline = time.monotonic() + cfg.startup_timeout_s
    conf = _base_conf(cfg)
    created: dict[str, Any] = {}
    try:
        _create_actors(cfg, conf, created)
        controller = created[CONTROLLER_NAME]
        units = {name: handle for name, handle in created.items() if name != CONTROLLER_NAME}
        infos = ray.get(
            [controller.get_zmq_server_info.remote()] + [u.get_zmq_server_info.remote() for u in units.values()],
            timeout=max(deadline - time.monotonic(), 0.0),
        )
        conf.controller.zmq_info = infos[0]
        conf.backend.SimpleStorage.zmq_info = dict(zip(units, infos[1:]))
        ray.get(controller.store_config.remote(conf), timeout=max(deadline - time.monotonic(), 0.0))
    except ray.exceptions.GetTimeoutError as e:
        _kill_created(created)
        raise DataPlaneTimeoutError("start", None, cfg.startup_timeout_s, "controller/storage actors not up") from e
    except (ray.exceptions.RayError, ValueError, RuntimeError) as e:
        _kill_created(created)
        raise DataPlaneError(f"TransferQueue actors failed to start: {error_name(e)}: {e}", kind="start") from e
    return StartedActors(controller=controller, storage_units=units)


# ---------------------------------------------------------------- client side (any process)


@dataclass(frozen=True)
class TQErrors:
    """TQ's exception types the per-call path classifies, resolved once per client (after `prepare_process`)."""

    transport: tuple[type[BaseException], ...]  # what the transport raises: weather, not a bug
    key_not_found: type[BaseException]  # a storage unit lost a key the controller still lists


def tq_errors() -> TQErrors:
    """The exception types of this process's TQ (its knobs fixed by `prepare_process` first)."""
    tq_storage = _tq_modules()[3]
    import zmq
    from transfer_queue.storage.managers.simple_storage_manager import StorageUnitTimeout

    return TQErrors(transport=(zmq.ZMQError, StorageUnitTimeout, TimeoutError),
                    key_not_found=tq_storage.StorageKeyNotFoundError)


def _controller() -> Any:
    """The handle of the running TQ controller (a named-actor look-up, no `ray.get`)."""
    if not ray.is_initialized():
        raise DataPlaneError(
            "Ray is not initialized in this process; attach from the driver after init_local_ray, or "
            "from inside a Ray actor of the same job",
            kind="unavailable",
        )
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=TQ_NAMESPACE)
    except ValueError as e:
        raise DataPlaneError(
            f"no TransferQueue controller {CONTROLLER_NAME!r} in namespace {TQ_NAMESPACE!r}: start the data "
            f"plane (start_data_plane) in the driver before attaching clients",
            kind="unavailable",
        ) from e


def _attach_failure(error: BaseException, timeout_s: float) -> Exception:
    """The data-plane error for a failed `get_config` call (no answer in time, or a dead controller)."""
    if isinstance(error, ray.exceptions.RayActorError):
        return DataPlaneError(f"the TransferQueue controller is dead: {error}", kind="unavailable")
    return DataPlaneTimeoutError("attach", None, timeout_s, "controller did not answer get_config")


def _published(conf: Any, deadline: float, timeout_s: float) -> bool:
    """True once the controller's config is published; raises when another poll would pass `deadline`."""
    if conf is not None:
        return True
    if time.monotonic() + _CONFIG_POLL_INTERVAL_S > deadline:
        raise DataPlaneTimeoutError("attach", None, timeout_s, "controller has not published its config")
    return False


def fetch_published_conf(timeout_s: float) -> Any:
    """The config the owner published on the controller (polls until published or deadline)."""
    deadline = time.monotonic() + timeout_s
    controller = _controller()
    while True:
        try:
            conf = ray.get(controller.get_config.remote(), timeout=max(deadline - time.monotonic(), 0.0))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            raise _attach_failure(e, timeout_s) from e
        if _published(conf, deadline, timeout_s):
            return conf
        time.sleep(_CONFIG_POLL_INTERVAL_S)


async def fetch_published_conf_async(timeout_s: float) -> Any:
    """`fetch_published_conf` for a coroutine: the answer is awaited, never fetched with `ray.get`."""
    deadline = time.monotonic() + timeout_s
    controller = await asyncio.to_thread(_controller)  # a GCS look-up: off the event loop
    while True:
        try:
            conf = await asyncio.wait_for(controller.get_config.remote(), max(deadline - time.monotonic(), 0.0))
        except (asyncio.TimeoutError, ray.exceptions.RayActorError) as e:
            raise _attach_failure(e, timeout_s) from e
        if _published(conf, deadline, timeout_s):
            return conf
        await asyncio.sleep(_CONFIG_POLL_INTERVAL_S)


def new_client(conf: Any, io_threads: int) -> Any:
    """A private async TQ client bound to the published deployment (blocking handshake)."""
    tq_client = _tq_modules()[0]
    backend = conf.backend.storage_backend
    client = tq_client.AsyncTransferQueueClient(
        client_id=f"nrl-dp-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        controller_info=conf.controller.zmq_info,
        zmq_io_threads=io_threads,
    )
    client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
    return client


def close_client(client: Any) -> None:
    """Release one private client's sockets and threads; the shared controller is untouched."""
    client.close()
