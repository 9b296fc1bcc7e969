"""wait_for_group: a child's exit status in time; past the deadline its whole group is gone and the error names it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_rl.utils import child_process
from nemo_rl.utils.child_process import wait_for_group


class _ArmError(RuntimeError):
    pass


def _spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_child_that_exits_in_time_gives_its_status_and_no_progress_line():
    said: list[str] = []
    assert wait_for_group(_spawn("raise SystemExit(3)"), 30.0, "arm", Path("log"), _ArmError, said.append) == 3
    assert said == []


def test_a_hung_child_and_its_grandchild_are_stopped_and_named(monkeypatch, tmp_path):
    monkeypatch.setattr(child_process, "TERM_GRACE_S", 5.0)
    pid_file = tmp_path / "grandchild"
    # The grandchild stays in the group and ignores nothing; the child waits on it forever.
    proc = _spawn("import subprocess, sys, time; "
                  f"g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                  f"open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(600)")
    deadline = time.monotonic() + 30.0
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the grandchild never started"
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    said: list[str] = []
    with pytest.raises(_ArmError) as info:
        wait_for_group(proc, 0.5, "sync_r0", tmp_path / "sync.log", _ArmError, said.append)
    assert str(info.value) == f"sync_r0 did not finish within --arm-timeout-s=0.5; see {tmp_path / 'sync.log'}"
    assert said == ["sync_r0: no exit within 0s; SIGTERM to its process group, then SIGKILL"]
    assert proc.returncode is not None
    for _ in range(100):  # not ours to reap: gone, or a zombie until whoever adopted it reaps it
        if not _running(grandchild):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} outlived its group's kill")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
