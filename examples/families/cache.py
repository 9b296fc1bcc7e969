"""Build folders named by a content key, shared by the family tokenizers and the tiny family models.

Contract: `ensure_built(folder, key, build)` returns `folder` when it holds a complete build of
`key` (its `build_info.json` names that `cache_key`), else runs `build(staging)` in a temporary
sibling and renames it into place only when complete, so an interrupted build never leaves a half
folder under the final name; when another process wins the rename, its folder is checked and used.
A folder whose build info is unreadable or names another key raises `FamilyBuildError`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

BUILD_INFO_FILE = "build_info.json"


class FamilyBuildError(RuntimeError):
    """A family artefact could not be built, or a cached build is not what it claims to be."""


def check_cached(folder: Path, key: str) -> Path:
    try:
        info = json.loads((folder / BUILD_INFO_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FamilyBuildError(f"cached build {str(folder)!r} has no readable {BUILD_INFO_FILE}; delete it") from e
    if info.get("cache_key") != key:
        raise FamilyBuildError(
            f"cached build {str(folder)!r} has cache_key {info.get('cache_key')!r}, expected {key!r}; delete it"
        )
    return folder


def check_empty(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FamilyBuildError(f"out_dir {str(out_dir)!r} is not empty; pass a new or empty folder")


def ensure_built(folder: Path, key: str, build: Callable[[Path], object]) -> Path:
    if folder.exists():
        return check_cached(folder, key)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".building-{folder.name}-", dir=folder.parent))
    try:
        build(staging)
        try:
            staging.rename(folder)
        except OSError:
            if not folder.exists():
                raise
            # Another process finished the same build first; its folder is equally valid.
            return check_cached(folder, key)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return folder
