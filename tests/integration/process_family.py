"""Find, snapshot and kill the process family of a driver run by a test (by PID, never by name).

A driver started by a test carries `TAG_VAR=<uuid>` in its environment; everything it starts
inherits it (its Ray cluster, the Gym servers in their own sessions, the vLLM worker and its
engine core). A (pid, start time) pair names one process, since pids are reused.
`run_then_sigkill` (a pre-emption: SIGKILL the driver once a condition holds, then whatever it
left, checked gone) and `left_after_exit` are what the kill-and-resume tests share.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

TAG_VAR = "NRL_TEST_PROCESS_TAG"


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}  # gone, a zombie (no environ), or not ours
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _tagged(tag: str) -> set[int]:
    """Live processes that inherited `TAG_VAR=tag` (the driver and everything it started)."""
    return {int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and _environ(int(p.name)).get(TAG_VAR) == tag and _alive(int(p.name))}


def _descendants(root: int) -> set[int]:
    children: dict[int, set[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int(Path(p, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, set()).add(int(p.name))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (with the pid, it names one process: pids are reused)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _snapshot(pids: set[int]) -> dict[int, int]:
    return {pid: t for pid in pids if (t := _start_time(pid)) is not None}


def _still_there(family: dict[int, int]) -> list[int]:
    return sorted(pid for pid, t in family.items() if _alive(pid) and _start_time(pid) == t)


FATE_SHARING_S = 30.0  # what shares a killed driver's fate (Ray's workers, their children) goes within this
SURVIVOR_GRACE_S = 2.0  # before the processes still there are reported as having outlived the driver


def _until_gone(family: dict[int, int], deadline_s: float = FATE_SHARING_S) -> None:
    """Return once no process of `family` is left, or at `deadline_s` (the caller names what is left)."""
    end = time.monotonic() + deadline_s
    while _still_there(family) and time.monotonic() < end:
        time.sleep(0.2)


def _kill_leftovers(family: dict[int, int], deadline_s: float = 60.0) -> None:
    """SIGKILL every process of `family` that is still the same process, wait until all are gone."""
    for pid in _still_there(family):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + deadline_s
    while _still_there(family):
        if time.monotonic() > end:
            pytest.fail(f"processes {_still_there(family)} survived SIGKILL for {deadline_s}s")
        time.sleep(0.2)


def _mentioning(text: str) -> list[str]:
    """Live processes whose command line names `text` (Ray's own processes name their temp dir)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and _alive(int(p.name)):
            try:
                cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            if text in cmdline:
                found.append(f"{p.name}: {cmdline[:160]}")
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return "<gone>"


def _ray_temp_dirs(pids: set[int]) -> set[str]:
    """The private Ray temp dirs (RAY_TMPDIR) these processes ran under, made by init_local_ray."""
    prefix = os.path.join(tempfile.gettempdir(), "nrl-ray-")
    return {d for pid in pids if (d := _environ(pid).get("RAY_TMPDIR", "")).startswith(prefix)}


@dataclass(frozen=True)
class KilledRun:
    """What `run_then_sigkill` did: seconds from start to kill, the processes that outlived the driver."""

    seconds: float
    family_size: int
    survivors: dict[int, str]  # pid -> command line; killed by PID after the driver


def run_then_sigkill(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], out: Path,
                     ready: Callable[[], bool], deadline_s: float) -> KilledRun:
    """Start `argv` (output to `out`, `env` carrying TAG_VAR); once `ready()` holds, SIGKILL the driver,
    then every process of its family still there, by PID; check none is left and remove its private
    Ray dir. Fails the test if the run exits or `deadline_s` passes before `ready()`."""
    tag = env[TAG_VAR]
    family: dict[int, int] = {}
    ray_dirs: set[str] = set()
    t0 = time.monotonic()
    with out.open("wb") as sink:
        proc = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=sink, stderr=subprocess.STDOUT)
    try:
        end = t0 + deadline_s
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"the run exited ({proc.returncode}) before the kill point:\n{out.read_text()[-6000:]}")
            if time.monotonic() > end:
                pytest.fail(f"no kill point within {deadline_s:g}s:\n{out.read_text()[-6000:]}")
            time.sleep(0.2)
        family = _snapshot(_descendants(proc.pid) | _tagged(tag))
        ray_dirs = _ray_temp_dirs(set(family))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        family.update(_snapshot(_tagged(tag)))  # anything started between the snapshot and the kill
        family.pop(proc.pid, None)
        # What dies with the driver (Ray's fate-sharing) goes; what is left after a short grace is
        # reported (`survivors`, informational) and killed by PID.
        _until_gone(family, SURVIVOR_GRACE_S)
        survivors = {pid: _command(pid) for pid in _still_there(family)}
        _kill_leftovers(family)
        for d in ray_dirs:
            shutil.rmtree(d, ignore_errors=True)  # the killed driver's private Ray dir; no one else uses it
    seconds = time.monotonic() - t0
    assert len(ray_dirs) == 1, ray_dirs
    assert _tagged(tag) == set(), "a process of the killed run is still alive"
    assert _mentioning(next(iter(ray_dirs))) == [], "a Ray process of the killed run's cluster is still alive"
    return KilledRun(seconds=seconds, family_size=len(family), survivors=survivors)


def left_after_exit(tag: str, linger_s: float) -> dict[int, str]:
    """Processes tagged `tag` still alive `linger_s` after their run exited (Ray stops its daemons
    asynchronously: on a loaded host one may still be exiting when the driver returns)."""
    end = time.monotonic() + linger_s
    while _tagged(tag) and time.monotonic() < end:
        time.sleep(0.5)
    return {pid: _command(pid) for pid in _tagged(tag)}
