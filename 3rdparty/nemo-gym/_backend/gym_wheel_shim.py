"""PEP 517 backend that re-emits the released nemo-gym 0.7.0 wheel for Python >=3.11.

Contract: the wheel produced is byte-for-byte Gym's released code; only the METADATA lines
`Requires-Python` and `Requires-Dist` change (taken from this folder's pyproject.toml) and
RECORD is rewritten to match. The source wheel is verified against a pinned sha256 before
anything is emitted; a mismatch is a hard error. Only the standard library and pip are used.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

WHEEL_NAME = "nemo_gym-0.7.0-py3-none-any.whl"
WHEEL_SHA256 = "cce78fc3fd048f36b4c465fe8e9fe3cc5e7afb6f6e287bfe831f156988508a70"
DIST_INFO = "nemo_gym-0.7.0.dist-info"
HERE = Path(__file__).resolve().parent.parent


class GymWheelError(RuntimeError):
    """The released wheel could not be fetched or failed its hash check."""


def _project_table() -> dict:
    with open(HERE / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fetch_wheel(workdir: Path) -> Path:
    local = os.environ.get("NRL_NEMO_GYM_WHEEL")
    if local:
        path = Path(local)
        if not path.is_file():
            raise GymWheelError(f"NRL_NEMO_GYM_WHEEL={local!r} is not a file; unset it or point it at {WHEEL_NAME}")
    else:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--ignore-requires-python",
               "--only-binary", ":all:", "--disable-pip-version-check", "-d", str(workdir), "nemo-gym==0.7.0"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise GymWheelError(f"pip download of nemo-gym==0.7.0 failed:\n{proc.stdout}\n{proc.stderr}")
        path = workdir / WHEEL_NAME
    digest = _sha256(path)
    if digest != WHEEL_SHA256:
        raise GymWheelError(f"{path} has sha256 {digest}, expected {WHEEL_SHA256}; refusing to build")
    return path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _rewrite_metadata(text: str, project: dict) -> str:
    out: list[str] = []
    header, _, body = text.partition("\n\n")
    for line in header.splitlines():
        if line.startswith(("Requires-Dist:", "Provides-Extra:")):
            continue
        if line.startswith("Requires-Python:"):
            out.append(f"Requires-Python: {project['requires-python']}")
            out.extend(f"Requires-Dist: {dep}" for dep in project["dependencies"])
            continue
        out.append(line)
    return "\n".join(out) + "\n\n" + body


def _rewrite_wheel(src: Path, dst: Path) -> None:
    project = _project_table()
    record_name = f"{DIST_INFO}/RECORD"
    rows: list[list[str]] = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename == record_name:
                continue
            data = zin.read(info.filename)
            if info.filename == f"{DIST_INFO}/METADATA":
                data = _rewrite_metadata(data.decode("utf-8"), project).encode("utf-8")
            zout.writestr(info, data)
            rows.append([info.filename, _record_hash(data), str(len(data))])
        rows.append([record_name, "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        zout.writestr(record_name, buf.getvalue())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with tempfile.TemporaryDirectory() as tmp:
        src = _fetch_wheel(Path(tmp))
        _rewrite_wheel(src, Path(wheel_directory) / WHEEL_NAME)
    return WHEEL_NAME


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_sdist(sdist_directory, config_settings=None):
    raise GymWheelError("nemo-gym build glue builds wheels only (no Gym source is stored here)")
