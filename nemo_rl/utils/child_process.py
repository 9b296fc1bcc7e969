"""Waiting, with a deadline, on a child process that runs in a session of its own.

`wait_for_group(proc, timeout_s, tag, log_path, error, progress, pump)` runs `pump` (the reader of
the child's pipes) on a daemon thread and returns the child's exit status; it also checks it:
a non-zero status is `error`, naming the tag, the status and the log.
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
import threading
from collections.abc import Callable
from pathlib import Path

TERM_GRACE_S = 60.0  # a stack tears down in well under this; past it, SIGKILL
KILL_REAP_S = 30.0
PUMP_JOIN_S = 10.0  # the pipes close when the group dies; a reader still stuck is left (daemon)


def wait_for_group(proc: subprocess.Popen, timeout_s: float, tag: str, log_path: Path,
                   error: type[Exception], progress: Callable[[str], None], pump: Callable[[], None]) -> None:
    """`proc` exited 0 within `timeout_s` while `pump` read its output; else `error` (see the module)."""
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = _wait_or_stop(proc, timeout_s, tag, log_path, error, progress)
    finally:
        reader.join(timeout=PUMP_JOIN_S)
    if code != 0:
        raise error(f"{tag} exited with status {code}; see {log_path}")


def _wait_or_stop(proc: subprocess.Popen, timeout_s: float, tag: str, log_path: Path,
                  error: type[Exception], progress: Callable[[str], None]) -> int:
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
