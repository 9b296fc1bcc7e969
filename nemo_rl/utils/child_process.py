"""Waiting, with a deadline, on a child process that runs in a session of its own.

`wait_for_group(proc, timeout_s, tag, log_path, error, progress)` returns the child's exit status.
Past `timeout_s` the child's whole process group gets SIGTERM, then SIGKILL after `TERM_GRACE_S`,
and `error` is raised naming the tag, the deadline and the child's log, so a hung child (a
benchmark arm with its Ray cluster, Gym servers and engine) never outlives its deadline quietly.
The child must have been started with `start_new_session=True`: its pid is then its group id, and
the kill reaches its tree and nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

TERM_GRACE_S = 60.0  # a stack tears down in well under this; past it, SIGKILL
KILL_REAP_S = 30.0


def wait_for_group(proc: subprocess.Popen, timeout_s: float, tag: str, log_path: Path,
                   error: type[Exception], progress: Callable[[str], None]) -> int:
    """The exit status of `proc`; past `timeout_s` its group is stopped and `error` raised (see module)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        progress(f"{tag}: no exit within {timeout_s:.0f}s; SIGTERM to its process group, then SIGKILL")
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=KILL_REAP_S)
        raise error(f"{tag} did not finish within --arm-timeout-s={timeout_s}; see {log_path}") from None
