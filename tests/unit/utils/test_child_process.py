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


def _pump_of(proc: subprocess.Popen, lines: list[str]):
    def pump() -> None:
        assert proc.stdout is not None
        lines.extend(proc.stdout)
    return pump


def test_a_child_that_exits_0_in_time_is_waited_for_with_its_output_read():
    proc = subprocess.Popen([sys.executable, "-c", "print('one'); print('two')"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    said: list[str] = []
    wait_for_group(proc, 30.0, "arm", Path("log"), _ArmError, said.append, _pump_of(proc, lines))
    assert (proc.returncode, lines, said) == (0, ["one\n", "two\n"], [])


def test_a_non_zero_exit_is_the_callers_error_naming_the_status_and_the_log():
    with pytest.raises(_ArmError, match=r"^async_r1 exited with status 3; see arm\.log$"):
        wait_for_group(_spawn("raise SystemExit(3)"), 30.0, "async_r1", Path("arm.log"), _ArmError, print, lambda: None)


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
        wait_for_group(proc, 0.5, "sync_r0", tmp_path / "sync.log", _ArmError, said.append, lambda: None)
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
