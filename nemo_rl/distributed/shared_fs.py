"""Folders that several nodes must see: prove it at start-up, fail by name when they do not.

Paths handed between actors (the refit folder `grpo.refit_dir`, the model folder `model.path`)
are plain filesystem paths; on several nodes they must be on a filesystem every node mounts at
the same path, and nothing here copies files. `write_probe` (driver) writes a marker with a
fresh random token; `check_probe` (any actor) reads it back; `require_dir` checks a folder is
visible. Every failure is a `SharedDirError` naming the folder, the knob that sets it, the
reader and the fix (a same-named local folder on another node is caught by the token).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from nemo_rl.data.errors import FatalError

PROBE_PREFIX = ".nrl-shared-probe-"


class SharedDirError(FatalError, RuntimeError):
    """A folder that must be shared by every node is not visible (or not the same) where it is read."""


@dataclass(frozen=True)
class SharedDirProbe:
    folder: str  # absolute
    marker: str  # file name inside `folder`
    token: str


def _fix(knob: str) -> str:
    return (
        f"(fix: on a multi-node cluster set {knob} to a folder on a filesystem every node mounts at the same "
        "path, e.g. NFS or Lustre; on one node, check that the folder exists)"
    )


def write_probe(folder: Path) -> SharedDirProbe:
    """Create `folder` (absolute) and a marker file with a fresh token in it."""
    if not folder.is_absolute():
        raise ValueError(f"write_probe needs an absolute folder (relative paths differ per process), got {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    marker = f"{PROBE_PREFIX}{token[:12]}"
    (folder / marker).write_text(token)
    return SharedDirProbe(folder=str(folder), marker=marker, token=token)


def check_probe(probe: SharedDirProbe, knob: str, where: str) -> None:
    """Raise `SharedDirError` unless this process reads the driver's marker with its token."""
    path = Path(probe.folder) / probe.marker
    try:
        found = path.read_text()
    except FileNotFoundError as e:
        raise SharedDirError(
            f"{where} cannot see {path}, which the driver wrote in {knob}={probe.folder}: that folder is not "
            f"shared with this node {_fix(knob)}"
        ) from e
    if found != probe.token:
        raise SharedDirError(
            f"{where} reads another file at {path} than the driver wrote in {knob}={probe.folder}: a different "
            f"folder of the same name on this node {_fix(knob)}"
        )


def remove_probe(probe: SharedDirProbe) -> None:
    (Path(probe.folder) / probe.marker).unlink(missing_ok=True)


def require_dir(path: Path, knob: str, where: str) -> None:
    """Raise `SharedDirError` unless `path` is a folder this process can see."""
    if not path.is_dir():
        raise SharedDirError(f"{where} cannot see the folder {knob}={path} {_fix(knob)}")
