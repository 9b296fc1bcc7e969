"""Flavored venvs: the folder is a function of the whole spec; builds are complete or redone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nemo_rl.utils import venvs
from nemo_rl.utils.venvs import VenvSpec, ensure_venv, forced_rebuild, spec_hash, venv_python


def _spec(tmp_path: Path, reqs: str, name: str = "flavor", local: tuple[Path, ...] = ()) -> VenvSpec:
    req = tmp_path / f"{name}-reqs.txt"
    req.write_text(reqs)
    return VenvSpec(name=name, requirements_file=req, local_packages=local)


def test_hash_covers_pins_python_local_sources_and_name(tmp_path):
    a = spec_hash(_spec(tmp_path, "six==1.17.0\n"), python_version="3.11.7")
    assert a == spec_hash(_spec(tmp_path, "six==1.17.0\n"), python_version="3.11.7")
    assert a != spec_hash(_spec(tmp_path, "six==1.16.0\n"), python_version="3.11.7")
    assert a != spec_hash(_spec(tmp_path, "six==1.17.0\n"), python_version="3.12.1")
    assert a != spec_hash(_spec(tmp_path, "six==1.17.0\n", name="other"), python_version="3.11.7")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "setup.py").write_text("v1")
    with_local = spec_hash(_spec(tmp_path, "six==1.17.0\n", local=(pkg,)), python_version="3.11.7")
    (pkg / "setup.py").write_text("v2")
    assert with_local != spec_hash(_spec(tmp_path, "six==1.17.0\n", local=(pkg,)), python_version="3.11.7")


@pytest.mark.parametrize(
    "value, expected",
    [(None, False), ("", False), ("vllm-cpu", True), ("a, vllm-cpu ,b", True), ("vllm-gpu", False), ("*", True)],
)
def test_forced_rebuild_list(value, expected):
    assert forced_rebuild("vllm-cpu", value) is expected


def test_bad_spec_fields_are_named(tmp_path):
    with pytest.raises(ValueError, match="VenvSpec.name='bad name'"):
        VenvSpec(name="bad name", requirements_file=tmp_path / "x")
    with pytest.raises(ValueError, match="requirements_file"):
        VenvSpec(name="ok", requirements_file=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="generation.vllm.flavor='tpu'"):
        venvs.vllm_spec("tpu")


def test_shipped_vllm_specs_are_fully_pinned():
    for flavor in ("cpu", "gpu"):
        lines = [l for l in venvs.vllm_spec(flavor).requirements_file.read_text().splitlines() if l and not l.startswith("#")]
        assert lines and all("==" in l for l in lines), flavor
        if flavor == "cpu":
            assert not any(l.split("==")[0] in ("torchvision", "torchaudio", "torchcodec", "triton") for l in lines)


def test_build_reuse_force_and_incomplete_rebuild(tmp_path, monkeypatch):
    monkeypatch.setenv(venvs.VENVS_DIR_ENV, str(tmp_path / "venvs"))
    monkeypatch.delenv(venvs.FORCE_ENV, raising=False)
    spec = _spec(tmp_path, "six==1.17.0\n")
    lines: list[str] = []
    first = ensure_venv(spec, progress=lines.append)
    assert first.name == f"flavor-{spec_hash(spec)[:16]}"
    assert any("building flavor 'flavor'" in l for l in lines)
    out = os.popen(f"{venv_python(first)} -c 'import six; print(six.__version__)'").read().strip()
    assert out == "1.17.0"
    marker = first / venvs.MARKER
    stamp = marker.stat().st_mtime_ns

    lines.clear()
    assert ensure_venv(spec, progress=lines.append) == first and lines == []  # reused, nothing printed
    assert marker.stat().st_mtime_ns == stamp

    monkeypatch.setenv(venvs.FORCE_ENV, "flavor")
    ensure_venv(spec, progress=lines.append)
    assert any("building" in l for l in lines)
    monkeypatch.delenv(venvs.FORCE_ENV)

    marker.unlink()  # a build that died half way
    lines.clear()
    ensure_venv(spec, progress=lines.append)
    assert any("building" in l for l in lines) and marker.is_file()

    changed = _spec(tmp_path, "six==1.16.0\n")
    assert ensure_venv(changed, progress=lines.append) != first  # a new spec never reuses the old venv
