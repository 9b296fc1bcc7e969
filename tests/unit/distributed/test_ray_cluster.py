"""Ray for the driver: a private instance (short temp dir, nemo_rl importable in actors), or an
existing cluster joined by address whose handle only disconnects; the launcher's node wait."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from nemo_rl.distributed.ray_cluster import (
    MAX_TEMP_DIR_CHARS,
    RayClusterError,
    _kill_attempt_leftovers,
    _process_exited,
    check_temp_dir,
    connect_ray,
    init_local_ray,
    job_runtime_env,
    parse_ray_address,
    ray_address_from_env,
    repo_root,
    start_or_join_ray,
    wait_for_nodes,
)
from nemo_rl.distributed.ray_cluster import main as ray_cluster_main


def test_repo_root_holds_the_package() -> None:
    assert (repo_root() / "nemo_rl" / "distributed" / "ray_cluster.py").is_file()


def test_job_runtime_env_puts_repo_root_first_once() -> None:
    root = Path("/repo")
    assert job_runtime_env(root, None) == {"env_vars": {"PYTHONPATH": "/repo"}}
    inherited = os.pathsep.join(["/a", "/repo", "", "/b"])
    assert job_runtime_env(root, inherited) == {"env_vars": {"PYTHONPATH": os.pathsep.join(["/repo", "/a", "/b"])}}


def test_temp_dir_must_be_absolute_and_short() -> None:
    check_temp_dir("/t/" + "x" * (MAX_TEMP_DIR_CHARS - 3))
    with pytest.raises(RayClusterError, match="must be an absolute path") as e:
        check_temp_dir("relative/dir")
    assert e.value.kind == "argument"
    too_long = "/t/" + "x" * MAX_TEMP_DIR_CHARS
    with pytest.raises(RayClusterError, match=f"is {len(too_long)} chars"):
        check_temp_dir(too_long)


def test_num_cpus_must_be_a_positive_int() -> None:
    with pytest.raises(RayClusterError, match="num_cpus must be an int >= 1, got 0") as e:
        init_local_ray(0)
    assert e.value.kind == "argument"


@ray.remote(num_cpus=0)
def _actor_environment() -> tuple[str, str]:
    import nemo_rl

    return os.environ["PYTHONPATH"].split(os.pathsep)[0], nemo_rl.__file__


def test_private_cluster_lifecycle() -> None:
    previous = os.environ.get("RAY_TMPDIR")
    handle = init_local_ray(num_cpus=2)
    try:
        assert len(handle.temp_dir) <= MAX_TEMP_DIR_CHARS
        assert os.path.dirname(handle.temp_dir) == tempfile.gettempdir()
        assert os.environ["RAY_TMPDIR"] == handle.temp_dir
        assert ray.cluster_resources()["CPU"] == 2.0
        first_path, package_file = ray.get(_actor_environment.remote(), timeout=120)
        assert first_path == str(repo_root())
        assert package_file == str(repo_root() / "nemo_rl" / "__init__.py")
        with pytest.raises(RayClusterError, match="already initialized") as e:
            init_local_ray(num_cpus=1)
        assert e.value.kind == "already_initialized"
    finally:
        handle.shutdown()
    assert not ray.is_initialized()
    assert handle.stopped
    assert not os.path.exists(handle.temp_dir)
    assert os.environ.get("RAY_TMPDIR") == previous
    handle.shutdown()


# ---- joining an existing cluster (what ultra_launch.sh sets up) ----


def test_parse_ray_address_accepts_only_an_explicit_host_port() -> None:
    assert parse_ray_address("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert parse_ray_address("node-1.cluster:1234") == ("node-1.cluster", 1234)
    assert parse_ray_address("[::1]:6379") == ("::1", 6379)
    for bad, message in [
        ("", "is empty"),
        ("auto", "only an explicit GCS host:port is joined"),
        ("local", "only an explicit GCS host:port is joined"),
        ("ray://10.0.0.1:10001", "only an explicit GCS host:port is joined"),
        ("10.0.0.1", "is not host:port"),
        ("10.0.0.1:0", "is not host:port"),
        ("10.0.0.1:65536", "is not host:port"),
        (":6379", "is not host:port"),
    ]:
        with pytest.raises(RayClusterError, match=message):
            parse_ray_address(bad)


def test_ray_address_from_env_reads_ray_address_only_when_non_empty() -> None:
    assert ray_address_from_env({}) is None
    assert ray_address_from_env({"RAY_ADDRESS": ""}) is None
    assert ray_address_from_env({"RAY_ADDRESS": "127.0.0.1:6379", "OTHER": "x"}) == "127.0.0.1:6379"


def test_start_or_join_starts_private_without_an_address_and_joins_with_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import nemo_rl.distributed.ray_cluster as module

    calls = []
    monkeypatch.setattr(module, "init_local_ray", lambda **kw: calls.append(("private", kw)) or "private")
    monkeypatch.setattr(module, "connect_ray", lambda address, **kw: calls.append(("join", address, kw)) or "joined")
    assert start_or_join_ray(3, None, max_nodes=1) == "private"
    assert start_or_join_ray(3, "10.0.0.1:6379", max_nodes=1) == "joined"
    assert calls == [("private", {"num_cpus": 3}), ("join", "10.0.0.1:6379", {"min_cpus": 3, "max_nodes": 1})]


SLACK_S = 8.0  # process start-up and scheduling on a loaded, shared machine


def test_connect_fails_fast_and_by_name_when_nothing_listens(refusing_port: int) -> None:
    port, connect_timeout_s = refusing_port, 2.0
    t0 = time.monotonic()
    with pytest.raises(RayClusterError, match=rf"nothing accepts connections at Ray address '127\.0\.0\.1:{port}'") as e:
        connect_ray(f"127.0.0.1:{port}", min_cpus=1, connect_timeout_s=connect_timeout_s)
    assert e.value.kind == "join"
    assert time.monotonic() - t0 < connect_timeout_s + SLACK_S
    assert not ray.is_initialized()


def test_wait_for_nodes_names_how_many_joined_when_nothing_listens(refusing_port: int) -> None:
    port = refusing_port
    with pytest.raises(RayClusterError, match=rf"only 0/2 Ray nodes joined the cluster at 127\.0\.0\.1:{port} within 1s: nothing accepts") as e:
        wait_for_nodes(f"127.0.0.1:{port}", expected=2, timeout_s=1.0, poll_s=0.2)
    assert e.value.kind == "nodes"


def test_wait_for_nodes_fails_at_once_when_a_watched_process_exits(refusing_port: int) -> None:
    done = subprocess.Popen(["true"])
    done.wait()  # reaped: gone from the process table
    port, poll_s = refusing_port, 0.2
    t0 = time.monotonic()
    with pytest.raises(RayClusterError, match=rf"ray head on n1 \(pid {done.pid}\) exited before the Ray cluster at 127\.0\.0\.1:{port} formed: 0/1"):
        wait_for_nodes(f"127.0.0.1:{port}", expected=1, timeout_s=60.0, watch={done.pid: "ray head on n1"}, poll_s=poll_s)
    assert time.monotonic() - t0 < poll_s + SLACK_S  # at its first poll, not at the 60 s deadline


def test_a_zombie_counts_as_exited() -> None:
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while _process_exited(child.pid) is False and time.monotonic() < deadline:
        time.sleep(0.05)  # exited but not reaped: a zombie
    assert _process_exited(child.pid)
    child.wait()
    assert _process_exited(child.pid)
    assert not _process_exited(os.getpid())


def test_wait_cli_reports_errors_on_stderr_with_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["wait-for-nodes", "--address", "127.0.0.1:1", "--nodes", "1", "--timeout-s", "1"]
    assert ray_cluster_main([*argv, "--watch", "x=head"]) == 1
    assert capsys.readouterr().err == "error: --watch 'x=head' is not PID=LABEL (fix: e.g. --watch 1234='ray head on node1')\n"
    assert ray_cluster_main(argv) == 1
    assert capsys.readouterr().err.startswith("error: only 0/1 Ray nodes joined the cluster at 127.0.0.1:1 within 1s")


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port held bound but not listening for the test: connecting to it is refused, and
    nothing else can take it meanwhile (a port closed again after picking could be)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `ray start --head --block` in its own short temp dir (as ultra_launch.sh starts it),
    stopped by SIGTERM to its PID, never by `ray stop`. Token auth is off here: turning it on in
    this process would leak into every later test's Ray (the Slurm test covers the token path)."""
    temp_dir = tempfile.mkdtemp(prefix="nrl-h")
    check_temp_dir(temp_dir)
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    ray_bin = Path(sys.executable).parent / "ray"
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--disable-usage-stats", "--include-dashboard=false",
         "--node-ip-address=127.0.0.1", f"--port={port}", f"--ray-client-server-port={_free_port()}",
         f"--dashboard-agent-listen-port={_free_port()}", "--num-cpus=1", f"--temp-dir={temp_dir}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        yield f"127.0.0.1:{port}", head
    finally:
        head.terminate()  # `ray start --block` stops the processes it started on SIGTERM
        head.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _mentions(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        leftovers = _mentions(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftovers, leftovers


def _mentions(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # exited while we looked
    return pids


@ray.remote(num_cpus=0)
def _where() -> str:
    import nemo_rl

    return nemo_rl.__file__


def test_wait_then_join_an_existing_cluster_and_only_disconnect(ray_head) -> None:
    address, head = ray_head
    assert wait_for_nodes(address, expected=1, timeout_s=180, watch={head.pid: "ray head"}, progress=lambda _: None) == 1
    assert not ray.is_initialized()  # the waiter disconnected
    with pytest.raises(RayClusterError, match=rf"only 1/2 Ray nodes joined the cluster at {re.escape(address)} within 2s \("):
        wait_for_nodes(address, expected=2, timeout_s=2, poll_s=0.5, progress=lambda _: None)

    handle = connect_ray(address, min_cpus=1, max_nodes=1)
    try:
        assert handle.joined and handle.temp_dir is None and not handle.owns_temp_dir
        assert ray.cluster_resources()["CPU"] == 1.0
        # The job runtime_env reaches actors of a joined cluster too.
        assert ray.get(_where.remote(), timeout=120) == str(repo_root() / "nemo_rl" / "__init__.py")
        with pytest.raises(RayClusterError, match="already initialized"):
            connect_ray(address, min_cpus=1)
    finally:
        handle.shutdown()
    handle.shutdown()
    assert handle.stopped and not ray.is_initialized()
    # Disconnecting left the cluster running: its head is alive and it can be joined again.
    assert head.poll() is None
    again = start_or_join_ray(1, address)
    again.shutdown()
    assert head.poll() is None


def test_join_refuses_a_cluster_too_small_and_disconnects(ray_head) -> None:
    address, head = ray_head
    with pytest.raises(RayClusterError, match=rf"offers 1 CPUs but this run needs at least 4 \(cluster.num_cpus=4") as e:
        connect_ray(address, min_cpus=4)
    assert e.value.kind == "resources"
    assert not ray.is_initialized()
    assert head.poll() is None


_IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"


def _child_ignoring_sigterm() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _IGNORES_SIGTERM], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"  # its SIGTERM handler is installed
    return proc


def test_a_failed_start_attempt_leaves_no_daemon_and_spares_what_ran_before() -> None:
    # A timed-out node start leaves its GCS and monitors running (they ignore SIGTERM); the retry
    # must stop exactly those, never a process this driver had started before the attempt.
    import psutil

    earlier = _child_ignoring_sigterm()
    try:
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        leftover = _child_ignoring_sigterm()
        assert _kill_attempt_leftovers(before) == 1
        assert not psutil.pid_exists(leftover.pid)  # killed and reaped, though it ignores SIGTERM
        assert earlier.poll() is None
        assert _kill_attempt_leftovers(before) == 0
    finally:
        earlier.kill()
        earlier.wait(timeout=10)
