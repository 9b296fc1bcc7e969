"""Checkpoint directories: the `checkpointing` recipe section, atomic commit, choosing what to load.

A complete checkpoint is a folder named exactly `step_<k>` holding the `CHECKPOINT_COMPLETE`
marker; anything else of ours is a leftover, never loaded, removed by `remove_leftovers`.
`commit_checkpoint` writes into `step_<k>.tmp-<pid>`, fsyncs, writes the marker and renames:
the rename is the commit point, and an existing `step_<k>` is never overwritten. Refuses a
damaged checkpoint (a `CheckpointError` of kind `corrupt` naming the file), never falling back to an older
one. The choosing functions are pure over names and marker presence (`scan` is the one reader);
RNG states and JSONL log cuts (`truncate_jsonl_after`) let a resumed run continue exactly once.
Layout and contract: docs/design-docs/token-capture-reliability.md, "Checkpoint directories".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_rl.data.errors import FatalError, Kinded

MARKER_FILE = "CHECKPOINT_COMPLETE"
_STEP_RE = re.compile(r"step_([1-9][0-9]*)")
_TMP_RE = re.compile(r"step_([1-9][0-9]*)\.tmp-([0-9]+)")


CheckpointKind = Literal[
    "no_checkpoint", "dir_not_empty", "corrupt", "mismatch", "not_a_folder", "exists", "incomplete", "unreadable_log"
]
"""What is wrong: `checkpointing.resume=latest` but the checkpoint_dir holds no complete
checkpoint; a run that does not resume was pointed at a checkpoint_dir that already holds
checkpoints; a complete-looking checkpoint disagrees with its marker (a file missing or of another
size, an unreadable marker or trainer state); a checkpoint does not fit the recipe it is resumed
with (seed, batch shape, prompts, optimizer...); the checkpoint_dir is not a folder; `step_<k>`
already exists (never overwritten); a folder without its marker was asked for; a JSONL log line
cannot be aligned with the checkpoint."""


class CheckpointError(Kinded, FatalError, RuntimeError):
    """A checkpoint cannot be written, found or loaded; the message names the path and the fix."""

    KINDS = typing.get_args(CheckpointKind)
    kind: CheckpointKind

    def __init__(self, message: str, *, kind: CheckpointKind) -> None:
        super().__init__(message, kind=kind)


class CheckpointingConfig(BaseModel):
    """The `checkpointing` recipe section (the only home of its defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="Write a checkpoint every save_period steps and after the last step.")
    save_period: int = Field(10, ge=1, description="Steps between checkpoints (the last step is always saved).")
    checkpoint_dir: str | None = Field(
        None, min_length=1, description="Folder of step_<k> checkpoints; required when enabled or resuming."
    )
    resume: Literal["latest"] | None = Field(
        None, description="'latest': continue from the newest complete checkpoint in checkpoint_dir (none there: an error)."
    )
    keep_last: int | None = Field(
        None, ge=1, description="Keep only this many newest complete checkpoints (null: keep all)."
    )

    @model_validator(mode="after")
    def _dir_when_used(self) -> CheckpointingConfig:
        if self.checkpoint_dir is None and (self.enabled or self.resume is not None):
            which = "checkpointing.enabled=true" if self.enabled else f"checkpointing.resume={self.resume!r}"
            raise ValueError(
                f"checkpointing.checkpoint_dir is unset but {which} needs it "
                "(fix: set checkpointing.checkpoint_dir=<folder>)"
            )
        return self


# ---------------------------------------------------------------------------------------------
# Pure: names, completeness, what to load, what to delete, when to save


class EntryKind(Enum):
    STEP = "step"  # step_<k>
    TMP = "tmp"  # step_<k>.tmp-<pid>
    OTHER = "other"  # not a name this module writes


@dataclass(frozen=True)
class ParsedEntry:
    kind: EntryKind
    step: int | None = None

    def __post_init__(self) -> None:
        if (self.kind is EntryKind.OTHER) != (self.step is None):
            raise ValueError(f"{self.kind} entry with step={self.step!r}: only OTHER entries have no step")


@dataclass(frozen=True)
class DirEntry:
    """One name in a checkpoint_dir and whether it holds the marker file."""

    name: str
    has_marker: bool


def step_dir_name(step: int) -> str:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step={step!r}: checkpoints are taken after a step, and steps are ints >= 1")
    return f"step_{step}"


def tmp_dir_name(step: int, pid: int) -> str:
    return f"{step_dir_name(step)}.tmp-{pid}"


def parse_entry(name: str) -> ParsedEntry:
    """What a name in a checkpoint_dir is (canonical decimals only: `step_01` is not ours)."""
    if m := _STEP_RE.fullmatch(name):
        return ParsedEntry(EntryKind.STEP, int(m.group(1)))
    if m := _TMP_RE.fullmatch(name):
        return ParsedEntry(EntryKind.TMP, int(m.group(1)))
    return ParsedEntry(EntryKind.OTHER)


def complete_steps(entries: Iterable[DirEntry]) -> list[int]:
    """Steps of the complete checkpoints (name `step_<k>` and marker present), ascending."""
    steps = []
    for entry in entries:
        parsed = parse_entry(entry.name)
        if parsed.kind is EntryKind.STEP and entry.has_marker:
            steps.append(parsed.step)
    return sorted(steps)


def latest_complete_step(entries: Iterable[DirEntry]) -> int | None:
    """The newest complete checkpoint's step; None when there is none."""
    steps = complete_steps(entries)
    return steps[-1] if steps else None


def leftover_names(entries: Iterable[DirEntry]) -> list[str]:
    """Our names that are not complete checkpoints (tmp folders, step folders without a marker), sorted."""
    out = []
    for entry in entries:
        kind = parse_entry(entry.name).kind
        if kind is EntryKind.TMP or (kind is EntryKind.STEP and not entry.has_marker):
            out.append(entry.name)
    return sorted(out)


def steps_to_prune(steps: Sequence[int], keep_last: int | None) -> list[int]:
    """The complete steps to delete so that only the newest `keep_last` remain (None: none), ascending."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1 (null keeps every checkpoint)")
    ordered = sorted(set(steps))
    return ordered[: max(0, len(ordered) - keep_last)]


def should_save(step: int, save_period: int, last_step: int) -> bool:
    """Save after every `save_period`-th step, and after the last step of the run."""
    if save_period < 1 or step < 1 or step > last_step:
        raise ValueError(f"should_save(step={step}, save_period={save_period}, last_step={last_step}): "
                         "need 1 <= step <= last_step and save_period >= 1")
    return step % save_period == 0 or step == last_step


# ---------------------------------------------------------------------------------------------
# The folder


def scan(root: Path) -> list[DirEntry]:
    """The entries of `root` (none when it does not exist yet)."""
    if not root.exists():
        return []
    if not root.is_dir():
        raise CheckpointError(
            f"checkpointing.checkpoint_dir={str(root)!r} is not a folder (fix: point it at a folder)",
            kind="not_a_folder",
        )
    return [DirEntry(p.name, (p / MARKER_FILE).is_file()) for p in root.iterdir()]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def remove_leftovers(root: Path) -> list[str]:
    """Delete half-written checkpoints (see `leftover_names`); returns the names removed."""
    names = leftover_names(scan(root))
    for name in names:
        _remove(root / name)
    if names:
        _fsync_dir(root)
    return names


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files_below(folder: Path) -> dict[str, int]:
    """Relative path -> size of every regular file below `folder` (the marker excluded)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MARKER_FILE:
            out[path.relative_to(folder).as_posix()] = path.stat().st_size
    return out


def _fsync_tree(folder: Path) -> None:
    # The files may have been written by another process (the policy actor): fsync from here too,
    # so the marker is never durable before the data it vouches for.
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_file():
            _fsync_file(path)
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(folder)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit_checkpoint(root: Path, step: int, write: Callable[[Path], None], pid: int | None = None) -> Path:
    """Write checkpoint `step` atomically through `write(tmp_folder)`; returns `root/step_<k>`."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    if final.exists():
        raise CheckpointError(
            f"{final} already exists; a checkpoint is never overwritten (fix: resume from it with "
            "checkpointing.resume=latest, or use another checkpointing.checkpoint_dir)",
            kind="exists",
        )
    tmp = root / tmp_dir_name(step, os.getpid() if pid is None else pid)
    if tmp.exists():
        _remove(tmp)
    tmp.mkdir()
    write(tmp)
    _fsync_tree(tmp)
    marker = {"step": step, "files": _files_below(tmp)}
    _write_durably(tmp / MARKER_FILE, json.dumps(marker, sort_keys=True, indent=1) + "\n")
    _fsync_dir(tmp)
    os.rename(tmp, final)  # the commit point
    _fsync_dir(root)
    return final


def open_checkpoint(root: Path, step: int) -> Path:
    """`root/step_<k>` after checking it against its marker (a `corrupt` `CheckpointError` otherwise)."""
    folder = root / step_dir_name(step)
    marker_path = folder / MARKER_FILE
    if not marker_path.is_file():
        raise CheckpointError(
            f"{folder} is not a complete checkpoint (no {MARKER_FILE}); it is never loaded",
            kind="incomplete",
        )
    try:
        marker = json.loads(marker_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{marker_path}: not valid JSON ({e.msg}) (fix: delete {folder})", kind="corrupt") from e
    if not isinstance(marker, dict) or marker.get("step") != step or not isinstance(marker.get("files"), dict):
        raise CheckpointError(
            f"{marker_path} does not describe step {step}: {marker!r} (fix: delete {folder})", kind="corrupt"
        )
    found = _files_below(folder)
    for rel, size in sorted(marker["files"].items()):
        if found.get(rel) != size:
            have = "missing" if rel not in found else f"{found[rel]} bytes"
            raise CheckpointError(
                f"{folder}: {rel} is {have} but the marker recorded {size} bytes (fix: delete {folder} "
                "to resume from the checkpoint before it)",
                kind="corrupt",
            )
    return folder


def prune_checkpoints(root: Path, keep_last: int | None, pid: int | None = None) -> list[int]:
    """Delete the oldest complete checkpoints beyond `keep_last`; returns their steps."""
    doomed = steps_to_prune(complete_steps(scan(root)), keep_last)
    for step in doomed:
        # Renamed out of the complete namespace first: a crash mid-delete leaves a leftover.
        tmp = root / tmp_dir_name(step, os.getpid() if pid is None else pid)
        if tmp.exists():
            _remove(tmp)
        os.rename(root / step_dir_name(step), tmp)
        _fsync_dir(root)
        shutil.rmtree(tmp)
    return doomed


# ---------------------------------------------------------------------------------------------
# RNG states of this process


class NumpyRngState(BaseModel):
    """numpy's legacy global generator (`np.random.get_state()`), JSON-safe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bit_generator: Literal["MT19937"]
    key: tuple[int, ...] = Field(min_length=624, max_length=624)
    pos: int = Field(ge=0, le=624)
    has_gauss: int = Field(ge=0, le=1)
    cached_gaussian: float


class RngStates(BaseModel):
    """Python's, numpy's and torch's (CPU) global RNG states of one process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: tuple[int, tuple[int, ...], float | None]
    numpy: NumpyRngState
    torch_cpu: str = Field(min_length=2, pattern=r"^([0-9a-f]{2})+$", description="torch.get_rng_state() bytes, hex")


def capture_rng_states() -> RngStates:
    # numpy and torch are imported here, not at module load: the pure functions above are used by
    # fast unit tests and by config validation, which should not pay torch's import.
    import random

    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state()
    return RngStates(
        python=(version, tuple(internal), gauss),
        numpy=NumpyRngState(bit_generator=name, key=tuple(int(x) for x in key), pos=int(pos),
                            has_gauss=int(has_gauss), cached_gaussian=float(cached)),
        torch_cpu=torch.get_rng_state().numpy().tobytes().hex(),
    )


def restore_rng_states(states: RngStates) -> None:
    import random

    import numpy as np
    import torch

    random.setstate((states.python[0], tuple(states.python[1]), states.python[2]))
    n = states.numpy
    np.random.set_state((n.bit_generator, np.array(n.key, dtype=np.uint32), n.pos, n.has_gauss, n.cached_gaussian))
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(states.torch_cpu), dtype=torch.uint8).clone())


# ---------------------------------------------------------------------------------------------
# Logs of a resumed run


def records_through(text: str, step: int, where: str) -> tuple[str, int]:
    """(the lines of JSONL `text` whose `step` <= `step`, how many lines were dropped).

    The last line may be torn (no trailing newline, not valid JSON: its writer was killed
    mid-write); it is dropped and counted. Any other unreadable line is a `CheckpointError`
    naming `where` and the 1-based line.
    """
    lines = text.splitlines(keepends=True)
    kept: list[str] = []
    dropped = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not line.endswith("\n"):
                dropped += 1
                continue
            raise CheckpointError(
                f"{where}:{number}: not valid JSON ({e.msg}); cannot align it with the checkpoint",
                kind="unreadable_log",
            ) from e
        record_step = record.get("step") if isinstance(record, dict) else None
        if isinstance(record_step, bool) or not isinstance(record_step, int):
            raise CheckpointError(
                f"{where}:{number}: a record without an integer `step`: {line.strip()[:200]}",
                kind="unreadable_log",
            )
        if record_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
        else:
            dropped += 1
    return "".join(kept), dropped


def truncate_jsonl_after(path: Path, step: int) -> int:
    """Drop the records of `path` after `step` (atomically); returns how many were dropped."""
    if not path.exists():
        return 0
    kept, dropped = records_through(path.read_text(encoding="utf-8"), step, str(path))
    if dropped:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        _write_durably(tmp, kept)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    return dropped
