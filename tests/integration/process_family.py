"""Find, snapshot and kill the process family of a driver run by a test (by PID, never by name).

A driver started by a test carries `TAG_VAR=<uuid>` in its environment; everything it starts
inherits it (its Ray cluster, the Gym servers in their own sessions, the vLLM worker and its
engine core). A (pid, start time) pair names one process, since pids are reused.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
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
