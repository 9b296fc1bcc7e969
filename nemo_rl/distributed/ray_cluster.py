"""Ray for this driver: a private single-node cluster it owns, or an existing cluster it joins.

Owns `init_local_ray`, `connect_ray`, `start_or_join_ray`, `RayClusterHandle` and
`wait_for_nodes` (also a CLI for `ultra_launch.sh`). Promises: a private cluster is a NEW local
instance with its own short temp dir and every socket on 127.0.0.1; a join goes only to the
address it is told (`"auto"`, `"local"` and `ray://` are refused), is probed and checked for CPUs
and nodes; every actor of the job can import `nemo_rl`. Refuses to start or join while Ray is
already initialized, and fails with `RayClusterError` naming the address and the fix.
Invariant: `shutdown()` is idempotent and only undoes what this process did; nothing here ever
runs `ray stop`.
See docs/design-docs/distributed.md, "The Ray cluster".
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import ray

from nemo_rl.distributed.errors import RayClusterError

# Ray appends "session_<date>_<time>_<usec>_<pid>/sockets/plasma_store" (~70 chars) to the
# temp dir, and the whole socket path must fit the 107-byte AF_UNIX limit.
MAX_TEMP_DIR_CHARS = 36
_TEMP_DIR_PREFIX = "nrl-ray-"
RAY_ADDRESS_ENV = "RAY_ADDRESS"


def repo_root() -> Path:
    """The directory that contains the `nemo_rl` package (what actors need on PYTHONPATH)."""
    return Path(__file__).resolve().parents[2]


def job_runtime_env(root: Path, inherited_pythonpath: str | None) -> dict:
    """The job-level runtime_env: the repo root first on PYTHONPATH, then what was inherited."""
    parts = [str(root)]
    if inherited_pythonpath:
        parts.extend(p for p in inherited_pythonpath.split(os.pathsep) if p and p != str(root))
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(parts)}}


def check_temp_dir(temp_dir: str) -> None:
    """Reject a temp dir that is relative or too long for Ray's Unix-socket paths."""
    if not os.path.isabs(temp_dir):
        raise RayClusterError(f"temp_dir must be an absolute path, got {temp_dir!r}", kind="argument")
    if len(temp_dir) > MAX_TEMP_DIR_CHARS:
        raise RayClusterError(
            f"temp_dir {temp_dir!r} is {len(temp_dir)} chars; Ray socket paths under it would exceed "
            f"the AF_UNIX limit. Use a dir of at most {MAX_TEMP_DIR_CHARS} chars (e.g. under the "
            f"system temp dir with a short name), or set TMPDIR to a short path.",
            kind="argument",
        )


def parse_ray_address(address: str) -> tuple[str, int]:
    """Split a GCS address `host:port` (IPv6 as `[addr]:port`); reject anything else by name."""
    if not isinstance(address, str) or not address.strip():
        raise RayClusterError(
            f"Ray address {address!r} is empty (fix: give the head's GCS address as host:port)",
            kind="argument",
        )
    if address in ("auto", "local") or "://" in address:
        raise RayClusterError(
            f"Ray address {address!r} is not supported: only an explicit GCS host:port is joined, so a "
            "driver never attaches to a cluster it was not told about (fix: give host:port, e.g. "
            "10.0.0.1:6379, or unset RAY_ADDRESS to start a private cluster)",
            kind="argument",
        )
    host, sep, port_text = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise RayClusterError(
            f"Ray address {address!r} is not host:port with a port in 1..65535 (fix: e.g. 10.0.0.1:6379)",
            kind="argument",
        )
    return host, int(port_text)


def ray_address_from_env(environ: Mapping[str, str]) -> str | None:
    """The cluster address a launcher set in `RAY_ADDRESS` (None when unset or empty)."""
    return environ.get(RAY_ADDRESS_ENV) or None


def _gcs_accepts(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass
class RayClusterHandle:
    """The Ray instance this process started (`init_local_ray`) or joined (`connect_ray`)."""

    temp_dir: str | None
    num_cpus: int
    gcs_address: str
    owns_temp_dir: bool
    previous_env: dict[str, str | None]  # what `private_env` replaced, restored on shutdown
    joined: bool = False
    _stopped: bool = field(default=False, repr=False)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def shutdown(self) -> None:
        """Stop the private cluster, or only disconnect from a joined one; safe to call more than once."""
        if self._stopped:
            return
        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if current != self.gcs_address:
                raise RayClusterError(
                    f"this process is now connected to Ray at {current}, not the cluster this handle "
                    f"{'joined' if self.joined else 'started'} ({self.gcs_address}); refusing to shut it down",
                    kind="shutdown",
                )
            # For a joined cluster this only disconnects the driver (its non-detached actors die
            # with it); the cluster keeps running for whoever started it.
            ray.shutdown()
        if not self.joined:
            restore_env(self.previous_env)
            if self.owns_temp_dir and self.temp_dir is not None:
                shutil.rmtree(self.temp_dir)
        self._stopped = True


# Ray gives a new node a hard-coded 30 s to register with its GCS; on a loaded 2-core host that
# startup race is lost now and then although nothing is wrong. It is retried, loudly, this often.
NODE_STARTUP_ATTEMPTS = 3
_NODE_STARTUP_TIMEOUT = "timed out during startup"


def _started_since(before: set[int]) -> list[psutil.Process]:
    """This process's descendants that were not among `before` (the daemons one attempt started)."""
    return [child for child in psutil.Process().children(recursive=True) if child.pid not in before]


def _kill_attempt_leftovers(before: set[int]) -> int:
    """SIGKILL the daemons a failed start attempt left running; the number killed.

    A node that times out during start-up is never registered as Ray's global node, so
    `ray.shutdown()` does not stop the GCS, dashboard and monitors it already spawned (the
    monitors also ignore SIGTERM). Left running they load the machine exactly when start-up is
    already slow, and the next attempt loses the same race. Only this process's own new
    descendants are touched.
    """
    leftovers = _started_since(before)
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue  # it exited on its own: nothing to stop
    psutil.wait_procs(leftovers, timeout=10)
    return len(leftovers)


def _init_with_retry(num_cpus: int, temp_dir: str):
    for attempt in range(1, NODE_STARTUP_ATTEMPTS + 1):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            return ray.init(
                address="local",
                num_cpus=num_cpus,
                _temp_dir=temp_dir,
                include_dashboard=False,
                runtime_env=job_runtime_env(repo_root(), os.environ.get("PYTHONPATH")),
            )
        except Exception as e:  # Ray raises a bare Exception for this race; anything else re-raises
            ray.shutdown()
            killed = _kill_attempt_leftovers(before)
            if _NODE_STARTUP_TIMEOUT not in str(e) or attempt == NODE_STARTUP_ATTEMPTS:
                raise
            print(f"[ray] node startup timed out (attempt {attempt}/{NODE_STARTUP_ATTEMPTS}); stopped the "
                  f"{killed} daemon(s) it left; retrying", flush=True)
    raise AssertionError("unreachable")


def _check_num_cpus(num_cpus: int, name: str) -> None:
    if type(num_cpus) is not int or num_cpus < 1:
        raise RayClusterError(f"{name} must be an int >= 1, got {num_cpus!r}", kind="argument")


def _refuse_if_initialized(what: str) -> None:
    if ray.is_initialized():
        raise RayClusterError(
            f"Ray is already initialized in this process; shut it down (RayClusterHandle.shutdown) "
            f"before {what}",
            kind="already_initialized",
        )


def private_env(temp_dir: str) -> dict[str, str]:
    """What a private cluster sets in this process's environment (its Ray daemons inherit it).

    The loopback binding is not here: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` must be set before
    `ray` is imported (`nemo_rl/__init__.py` does it when no RAY_ADDRESS is given); then Ray
    treats the node as a single machine and binds its GCS, raylet, agents, metrics ports and the
    driver's own servers to 127.0.0.1 (`_node_ip_address="127.0.0.1"` alone is not enough: Ray
    substitutes the host's routable IP again).
    """
    return {"RAY_TMPDIR": temp_dir}


def set_env(values: dict[str, str]) -> dict[str, str | None]:
    """Set `values` in os.environ; return what they replaced (None: unset) for `restore_env`."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    return previous


def restore_env(previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def init_local_ray(num_cpus: int, temp_dir: str | None = None) -> RayClusterHandle:
    """Start a private local Ray instance with `num_cpus` logical CPUs.

    `temp_dir=None` creates a fresh short dir in the system temp dir (removed on shutdown);
    a given `temp_dir` is created if needed and left in place on shutdown.
    """
    _check_num_cpus(num_cpus, "num_cpus")
    _refuse_if_initialized("starting a private cluster")
    owns_temp_dir = temp_dir is None
    if temp_dir is None:
        temp_dir = tempfile.mkdtemp(prefix=_TEMP_DIR_PREFIX)
    check_temp_dir(temp_dir)
    os.makedirs(temp_dir, exist_ok=True)
    previous = set_env(private_env(temp_dir))
    try:
        context = _init_with_retry(num_cpus, temp_dir)
    except Exception as e:
        restore_env(previous)
        if owns_temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise RayClusterError(f"could not start a local Ray instance in {temp_dir!r}: {e}", kind="start") from e
    return RayClusterHandle(
        temp_dir=temp_dir,
        num_cpus=num_cpus,
        gcs_address=context.address_info["gcs_address"],
        owns_temp_dir=owns_temp_dir,
        previous_env=previous,
    )


def alive_node_count() -> int:
    """Alive nodes of the cluster this process is connected to (asks the GCS every call)."""
    return sum(1 for node in ray.nodes() if node["Alive"])


def connect_ray(
    address: str, min_cpus: int, max_nodes: int | None = None, connect_timeout_s: float = 30.0
) -> RayClusterHandle:
    """Join the existing cluster whose GCS is at `address`; the handle's shutdown only disconnects."""
    _check_num_cpus(min_cpus, "min_cpus")
    host, port = parse_ray_address(address)
    _refuse_if_initialized(f"joining the cluster at {address}")
    # Ray's own connect retries for a long while when nothing listens; a dead or wrong address
    # must fail within this deadline instead.
    if not _gcs_accepts(host, port, connect_timeout_s):
        raise RayClusterError(
            f"nothing accepts connections at Ray address {address!r} (TCP probe, {connect_timeout_s:g}s "
            "deadline; fix: start the cluster first, e.g. through ultra_launch.sh, or unset RAY_ADDRESS "
            "to start a private cluster)",
            kind="join",
        )
    try:
        context = ray.init(address=address, runtime_env=job_runtime_env(repo_root(), os.environ.get("PYTHONPATH")))
    except Exception as e:  # ray.init raises ConnectionError, AuthenticationError, RuntimeError...
        raise RayClusterError(
            f"could not join the Ray cluster at {address!r}: {e} (fix: check the address; a cluster "
            "with token auth needs RAY_AUTH_MODE=token and its token, e.g. RAY_AUTH_TOKEN_PATH)",
            kind="join",
        ) from e
    handle = RayClusterHandle(
        temp_dir=None,
        num_cpus=min_cpus,
        gcs_address=context.address_info["gcs_address"],
        owns_temp_dir=False,
        previous_env={},
        joined=True,
    )
    try:
        cpus = ray.cluster_resources().get("CPU", 0.0)
        if cpus < min_cpus:
            raise RayClusterError(
                f"the Ray cluster at {address!r} offers {cpus:g} CPUs but this run needs at least "
                f"{min_cpus} (cluster.num_cpus={min_cpus}; fix: give the nodes more CPUs, or lower "
                "cluster.num_cpus)",
                kind="resources",
            )
        nodes = alive_node_count()
        if max_nodes is not None and nodes > max_nodes:
            raise RayClusterError(
                f"the Ray cluster at {address!r} has {nodes} alive nodes but at most {max_nodes} "
                "is supported here (fix: launch with --nodes 1)",
                kind="resources",
            )
    except BaseException:
        handle.shutdown()
        raise
    return handle


def start_or_join_ray(num_cpus: int, address: str | None, max_nodes: int | None = None) -> RayClusterHandle:
    """A private cluster of `num_cpus` CPUs (`address=None`), or join `address` needing `num_cpus` CPUs."""
    if address is None:
        return init_local_ray(num_cpus=num_cpus)
    return connect_ray(address, min_cpus=num_cpus, max_nodes=max_nodes)


def _process_exited(pid: int) -> bool:
    """True when `pid` is gone or a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, owned by someone else
    try:
        # /proc/<pid>/stat: "pid (comm) state ..."; comm may hold spaces, so split after ')'.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def _check_watched(watch: Mapping[int, str], address: str, alive: int, expected: int) -> None:
    for pid, label in watch.items():
        if _process_exited(pid):
            raise RayClusterError(
                f"{label} (pid {pid}) exited before the Ray cluster at {address} formed: {alive}/{expected} "
                "nodes had joined (fix: read that process's log; a port clash or a bad temp dir are the "
                "usual causes)",
                kind="nodes",
            )


def wait_for_nodes(
    address: str,
    expected: int,
    timeout_s: float,
    watch: Mapping[int, str] | None = None,
    poll_s: float = 1.0,
    progress: Callable[[str], None] = print,
) -> int:
    """Block until `expected` nodes are alive at `address`; return that count.

    Raises `RayClusterError` naming how many nodes joined when `timeout_s` passes first, or when a
    process in `watch` (pid -> label, e.g. the srun that runs a node) exits meanwhile.
    """
    _check_num_cpus(expected, "expected")
    if not timeout_s > 0:
        raise RayClusterError(f"timeout_s must be > 0, got {timeout_s!r}", kind="argument")
    host, port = parse_ray_address(address)
    watch = dict(watch or {})
    deadline = time.monotonic() + timeout_s

    def timed_out(alive: int, why: str) -> RayClusterError:
        return RayClusterError(
            f"only {alive}/{expected} Ray nodes joined the cluster at {address} within {timeout_s:g}s{why} "
            "(fix: read the head and worker logs; raise the wait timeout if the nodes are merely slow)",
            kind="nodes",
        )

    # The head may still be starting: wait for its GCS port before connecting as a driver.
    while not _gcs_accepts(host, port, min(2.0, max(0.1, deadline - time.monotonic()))):
        _check_watched(watch, address, 0, expected)
        if time.monotonic() >= deadline:
            raise timed_out(0, ": nothing accepts connections there yet")
        time.sleep(poll_s)
    _refuse_if_initialized(f"waiting for the nodes of {address}")
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # ray.init raises ConnectionError, AuthenticationError, RuntimeError...
        raise RayClusterError(
            f"could not connect to the Ray cluster at {address} to count its nodes: {e}",
            kind="join",
        ) from e
    try:
        alive = last = 0
        while True:
            alive = alive_node_count()
            if alive != last:
                progress(f"[ray] {alive}/{expected} nodes alive at {address}")
                last = alive
            if alive >= expected:
                return alive
            _check_watched(watch, address, alive, expected)
            if time.monotonic() >= deadline:
                raise timed_out(alive, "")
            time.sleep(poll_s)
    finally:
        ray.shutdown()  # a driver connection only: disconnects, the cluster keeps running


def _parse_watch(items: Sequence[str]) -> dict[int, str]:
    watch: dict[int, str] = {}
    for item in items:
        pid_text, sep, label = item.partition("=")
        if not sep or not pid_text.isdigit() or not label:
            raise RayClusterError(
                f"--watch {item!r} is not PID=LABEL (fix: e.g. --watch 1234='ray head on node1')",
                kind="argument",
            )
        watch[int(pid_text)] = label
    return watch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_rl.distributed.ray_cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait-for-nodes", help="block until N nodes are alive in the cluster at --address")
    wait.add_argument("--address", required=True, help="the head's GCS host:port")
    wait.add_argument("--nodes", type=int, required=True, help="how many nodes must be alive")
    wait.add_argument("--timeout-s", type=float, required=True, help="give up after this many seconds")
    wait.add_argument("--watch", action="append", default=[], metavar="PID=LABEL",
                      help="fail at once when this process exits (repeatable)")
    args = parser.parse_args(argv)
    try:
        alive = wait_for_nodes(args.address, args.nodes, args.timeout_s, _parse_watch(args.watch))
    except RayClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"[ray] cluster ready: {alive} nodes at {args.address}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
