"""parent_watch: a server started under it dies when its launcher is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments import parent_watch
from nemo_rl.environments.nemo_gym_config import NemoGymError

_LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen(
        [sys.executable, "-m", "nemo_rl.environments.parent_watch", str(os.getpid()),
         "http.server", "0", "--bind", "127.0.0.1"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is not alive
        return f.read().split(") ", 1)[1][0] != "Z"


def _until_listening(pid: int, timeout_s: float) -> None:
    """Return once process `pid` holds a listening TCP socket (fails after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not any(c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections(kind="tcp")):
        assert time.monotonic() < deadline, f"process {pid} listens on no TCP port after {timeout_s} s"
        time.sleep(0.05)


def test_a_server_dies_when_its_launcher_is_sigkilled() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True)
    child_pid = int(launcher.stdout.readline())
    try:
        _until_listening(child_pid, 30.0)  # the child is serving (http.server imported and bound)
        assert _alive(child_pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid), "the server outlived its SIGKILLed launcher"
    finally:
        if _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
        launcher.stdout.close()


def test_a_launcher_already_gone_means_no_server() -> None:
    # The pid given is not our parent (as when the launcher died before prctl took effect).
    done = subprocess.run(
        [sys.executable, "-m", "nemo_rl.environments.parent_watch", "1", "http.server", "0"],
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 1
    assert "launcher 1 is gone before http.server started" in done.stderr


def test_the_server_command_runs_the_module_under_parent_watch() -> None:
    spec = launch.ServerSpec("policy_model", "responses_api_models.vllm_model.app", 1)
    assert launch.server_command("py", spec, 4242) == [
        "py", "-m", "nemo_rl.environments.parent_watch", "4242", "responses_api_models.vllm_model.app"]
    assert launch.server_command("py", spec) == ["py", "-m", "responses_api_models.vllm_model.app"]


def test_a_host_without_pdeathsig_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setattr(parent_watch.sys, "platform", "darwin")
    with pytest.raises(NemoGymError, match=r"^parent_watch needs Linux prctl\(PR_SET_PDEATHSIG\); this is darwin$") as info:
        parent_watch.die_with_parent()
    assert info.value.kind == "platform"
