"""Where TransferQueue's sockets listen (`DataPlaneConfig.bind`).

TQ 0.1.11 has no bind option: its controller and storage units bind their ZeroMQ sockets (and
their metrics exporter) to `ray.util.get_node_ip_address()`, read once in their constructor,
which is the node's routable IP. For `bind="loopback"`, `tq_backend` starts `loopback_actor(cls)`
instead of TQ's actor class: a subclass whose constructor first makes that lookup answer
127.0.0.1 in the actor's own process (`bind_tq_to_loopback`), then runs TQ's constructor
unchanged. Ray's own addressing does not use that lookup (the actor's core worker is connected
before the constructor runs), and no other process is touched. (A runtime_env
`worker_process_setup_hook` would be the natural place, but Ray 2.60 runs it for the job's
runtime_env only, not per actor.)
"""

from __future__ import annotations

from typing import Any

LOOPBACK_IP = "127.0.0.1"


def _loopback_ip(*_args: object, **_kwargs: object) -> str:
    return LOOPBACK_IP


def bind_tq_to_loopback() -> None:
    """In this (TQ actor) process, `ray.util.get_node_ip_address()` answers the loopback address."""
    import ray.util

    ray.util.get_node_ip_address = _loopback_ip


def loopback_actor(actor_cls: Any) -> Any:
    """A Ray actor class equal to TQ's `actor_cls` except that it binds to 127.0.0.1."""
    import ray

    original = actor_cls.__ray_metadata__.modified_class.__ray_actor_class__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bind_tq_to_loopback()
        original.__init__(self, *args, **kwargs)

    # Same class name, so Ray's process titles and TQ's logs read as before.
    loopback = type(original.__name__, (original,), {"__init__": __init__, "__module__": __name__})
    return ray.remote(loopback)
