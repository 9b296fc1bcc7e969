"""Flavored venvs: the folder is a function of the whole spec; a build is published whole or not at all.

Fake builders (module-level functions, bound with functools.partial) stand in for uv where a
test is about publication, locking or crashes; one test builds a real (small) uv venv to show
that it still works after being renamed into place.
"""

from __future__ import annotations

import errno
import functools
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nemo_rl.utils import venvs
from nemo_rl.utils.venvs import (
    VenvBuildError,
    VenvSpec,
    ensure_venv,
    forced_rebuild,
    is_complete,
    publish,
    running_venv_info,
    spec_hash,
    venv_python,
)

FORK = multiprocessing.get_context("fork")  # children inherit the partial-bound builders as they are


def _spec(tmp_path: Path, reqs: str, name: str = "flavor", local: tuple[Path, ...] = ()) -> VenvSpec:
    req = tmp_path / f"{name}-reqs.txt"
    req.write_text(reqs)
    return VenvSpec(name=name, requirements_file=req, local_packages=local)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(venvs.VENVS_DIR_ENV, str(tmp_path / "venvs"))
    monkeypatch.delenv(venvs.FORCE_ENV, raising=False)
    return tmp_path / "venvs"


def _final(root: Path, spec: VenvSpec) -> Path:
    return root / f"{spec.name}-{spec_hash(spec)[:16]}"


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:  # O_APPEND: lines from several processes never interleave
        f.write(line + "\n")


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# ---- fake builders (module level: a forked child runs them as they are) ----

def good_builder(log: Path, spec: VenvSpec, target: Path, progress, timeout_s: float) -> None:
    """Writes a tiny 'venv' and records one build (pid) in `log`."""
    _append(log, f"build {os.getpid()}")
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "tool").write_text("#!/bin/sh\necho ok\n")
    (target / "content.txt").write_text(f"built for {spec.name}\n")


def failing_builder(spec: VenvSpec, target: Path, progress, timeout_s: float) -> None:
    """Writes half a venv, then fails like a broken install."""
    (target / "bin").mkdir(parents=True)
    (target / "half.txt").write_text("partial")
    raise VenvBuildError("install failed half way (simulated)")


def hanging_builder(started: Path, spec: VenvSpec, target: Path, progress, timeout_s: float) -> None:
    """Writes half a venv, signals `started`, then hangs until killed."""
    (target / "bin").mkdir(parents=True)
    (target / "half.txt").write_text("partial")
    started.write_text(str(os.getpid()))
    time.sleep(120)


def slow_builder(log: Path, started: Path, seconds: float, spec: VenvSpec, target: Path, progress,
                 timeout_s: float) -> None:
    """Records the build, signals `started`, builds for `seconds`, records the end time."""
    _append(log, f"build {os.getpid()}")
    started.write_text(str(os.getpid()))
    (target / "bin").mkdir(parents=True)
    time.sleep(seconds)
    (target / "content.txt").write_text(f"built by {os.getpid()}\n")
    _append(log, f"end {time.time()!r}")


def self_naming_builder(spec: VenvSpec, target: Path, progress, timeout_s: float) -> None:
    """A non-relocatable venv: a console script whose shebang names the build folder."""
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "tool").write_text(f"#!{target}/bin/python\nprint('hi')\n")


def _ensure_in_child(spec: VenvSpec, builder, out: Path) -> None:
    called = time.time()
    path = ensure_venv(spec, builder=builder, progress=functools.partial(_append, out.with_suffix(".progress")))
    out.write_text(f"{path}\n{called!r}\n{time.time()!r}\n")


# ---- spec hashing and configuration ----

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


def test_the_agents_sdk_harness_spec_is_fully_pinned_with_openai_3():
    spec = venvs.harness_spec("openai-agents")
    assert spec.name == "harness-openai-agents" and spec.local_packages == ()
    pins = dict(l.split("==") for l in spec.requirements_file.read_text().splitlines() if l and not l.startswith("#"))
    assert pins["openai-agents"] == "0.24.0" and pins["openai"].startswith("3.")
    assert "torch" not in pins and "vllm" not in pins and "nemo-gym" not in pins  # only what the SDK needs
    assert venvs.venv_folder_name(spec.name, spec_hash(spec, "3.11")) != venvs.venv_folder_name(
        "vllm-cpu", spec_hash(venvs.vllm_spec("cpu"), "3.11"))


def test_an_unknown_harness_names_the_known_ones():
    with pytest.raises(ValueError, match=r"harness='crew' has no spec harness-crew.txt; known harnesses: .*'openai-agents'"):
        venvs.harness_spec("crew")


# ---- the real builder: a uv venv survives the rename into place ----

def test_real_uv_venv_works_after_rename_reuse_force_and_new_spec(tmp_path, root, monkeypatch):
    spec = _spec(tmp_path, "six==1.17.0\ntqdm==4.70.1\n")
    lines: list[str] = []
    first = ensure_venv(spec, progress=lines.append)
    assert first == _final(root, spec)
    building = f"{first.name}.building-{os.getpid()}"
    assert f"[venv] building flavor 'flavor' in {root / building} (first use of this spec; takes ~1-3 min)" in lines
    assert sorted(p.name for p in root.iterdir()) == [f".{first.name}.lock", first.name]  # nothing left aside
    out = subprocess.run([str(venv_python(first)), "-c", "import sys, six; print(six.__version__, sys.prefix)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1.17.0", str(first)]
    # A console script was installed in the build folder; it runs from its final place.
    script = subprocess.run([str(first / "bin" / "tqdm"), "--version"], capture_output=True, text=True, check=True)
    assert script.stdout.strip() == "4.70.1"
    assert venvs.embedded_path_files(first) == []
    assert "relocatable = true" in (first / "pyvenv.cfg").read_text()
    marker = first / venvs.MARKER
    assert marker.read_text() == spec_hash(spec) + "\n"
    stamp = marker.stat().st_mtime_ns

    lines.clear()
    assert ensure_venv(spec, progress=lines.append) == first and lines == []  # reused, nothing printed
    assert marker.stat().st_mtime_ns == stamp

    monkeypatch.setenv(venvs.FORCE_ENV, "flavor")
    ensure_venv(spec, progress=lines.append)
    assert any(l.startswith("[venv] building flavor 'flavor'") for l in lines)
    assert marker.stat().st_mtime_ns != stamp
    assert sorted(p.name for p in root.iterdir()) == [f".{first.name}.lock", first.name]  # the old one is gone
    monkeypatch.delenv(venvs.FORCE_ENV)

    changed = _spec(tmp_path, "six==1.16.0\n")
    assert ensure_venv(changed, progress=lines.append) == _final(root, changed) != first  # a new spec never reuses


# ---- publication is atomic: interrupted builds are never used ----

def test_builder_that_fails_midway_publishes_nothing_and_the_next_call_rebuilds(tmp_path, root):
    spec = _spec(tmp_path, "x==1\n")
    final = _final(root, spec)
    with pytest.raises(VenvBuildError, match="install failed half way"):
        ensure_venv(spec, builder=failing_builder, progress=lambda _: None)
    assert sorted(p.name for p in root.iterdir()) == [f".{final.name}.lock"]  # no final, no leftover

    log = tmp_path / "builds.log"
    assert ensure_venv(spec, builder=functools.partial(good_builder, log), progress=lambda _: None) == final
    assert _lines(log) == [f"build {os.getpid()}"]
    assert sorted(p.name for p in final.iterdir()) == [venvs.MARKER, "bin", "content.txt"]  # no half.txt
    assert is_complete(final, spec_hash(spec))


def test_build_killed_midway_is_never_used_and_is_rebuilt(tmp_path, root):
    spec = _spec(tmp_path, "x==1\n")
    final = _final(root, spec)
    started = tmp_path / "started"
    child = FORK.Process(target=_ensure_in_child,
                         args=(spec, functools.partial(hanging_builder, started), tmp_path / "child.out"))
    child.start()
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline and child.is_alive(), "the child never started building"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert child.exitcode == -signal.SIGKILL
    leftover = root / f"{final.name}.building-{child.pid}"
    assert sorted(p.name for p in root.iterdir()) == [f".{final.name}.lock", leftover.name]
    assert (leftover / "half.txt").read_text() == "partial"  # it died with half a venv written

    log = tmp_path / "builds.log"
    lines: list[str] = []
    assert ensure_venv(spec, builder=functools.partial(good_builder, log), progress=lines.append) == final
    assert lines[0] == f"[venv] removing {leftover.name} (left by a build that did not finish)"
    assert _lines(log) == [f"build {os.getpid()}"]  # the kernel released the dead child's lock
    assert sorted(p.name for p in root.iterdir()) == [f".{final.name}.lock", final.name]
    assert sorted(p.name for p in final.iterdir()) == [venvs.MARKER, "bin", "content.txt"]


def test_incomplete_folder_from_an_in_place_build_is_replaced_whole(tmp_path, root):
    spec = _spec(tmp_path, "x==1\n")
    final = _final(root, spec)
    (final / "bin").mkdir(parents=True)  # what the earlier in-place builder left when it died
    (final / "half.txt").write_text("partial")
    log = tmp_path / "builds.log"
    assert ensure_venv(spec, builder=functools.partial(good_builder, log), progress=lambda _: None) == final
    assert _lines(log) == [f"build {os.getpid()}"]
    assert sorted(p.name for p in final.iterdir()) == [venvs.MARKER, "bin", "content.txt"]
    assert sorted(p.name for p in root.iterdir()) == [f".{final.name}.lock", final.name]


def test_stale_leftovers_of_this_spec_are_removed_and_others_kept(tmp_path, root):
    spec = _spec(tmp_path, "x==1\n")
    final = _final(root, spec)
    for name in (f"{final.name}.building-999999", f"{final.name}.stale-999999", "other-0123456789abcdef.building-1"):
        (root / name).mkdir(parents=True)
    ensure_venv(spec, builder=functools.partial(good_builder, tmp_path / "builds.log"), progress=lambda _: None)
    assert sorted(p.name for p in root.iterdir()) == [
        f".{final.name}.lock", final.name, "other-0123456789abcdef.building-1"]


def test_a_venv_that_names_its_build_folder_is_refused(tmp_path, root):
    spec = _spec(tmp_path, "x==1\n")
    final = _final(root, spec)
    with pytest.raises(VenvBuildError, match=r"names that folder in \['bin/tool'\]; it would break once moved") as e:
        ensure_venv(spec, builder=self_naming_builder, progress=lambda _: None)
    assert f"{final.name}.building-{os.getpid()}" in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == [f".{final.name}.lock"]


# ---- two processes, one build ----

def test_two_processes_building_the_same_spec_run_one_build_and_share_it(tmp_path, root):
    spec = _spec(tmp_path, "x==1\n")
    final = _final(root, spec)
    log, started = tmp_path / "builds.log", tmp_path / "started"
    builder = functools.partial(slow_builder, log, started, 2.0)
    first = FORK.Process(target=_ensure_in_child, args=(spec, builder, tmp_path / "a.out"))
    first.start()
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline and first.is_alive(), "the first process never started building"
        time.sleep(0.02)
    second = FORK.Process(target=_ensure_in_child, args=(spec, builder, tmp_path / "b.out"))
    second.start()
    first.join(60)
    second.join(60)
    assert (first.exitcode, second.exitcode) == (0, 0)

    builds = [l for l in _lines(log) if l.startswith("build ")]
    assert builds == [f"build {first.pid}"]  # exactly one build ran, in the first process
    build_end = float(_lines(log)[-1].split()[1])
    a_path, _, _ = (tmp_path / "a.out").read_text().split()
    b_path, b_called, b_returned = (tmp_path / "b.out").read_text().split()
    assert a_path == b_path == str(final)
    assert float(b_called) < build_end <= float(b_returned)  # the second asked mid-build and waited for it
    assert _lines(tmp_path / "b.progress") == []  # ...then reused the first's venv without building
    assert is_complete(final, spec_hash(spec))
    assert (final / "content.txt").read_text() == f"built by {first.pid}\n"
    assert sorted(p.name for p in root.iterdir()) == [f".{final.name}.lock", final.name]


# ---- publish: the rename step on its own ----

def _complete_dir(path: Path, digest: str, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "content.txt").write_text(content)
    venvs.write_marker(path, digest)
    return path


def test_publish_discards_ours_when_another_process_finished_first(tmp_path):
    final = _complete_dir(tmp_path / "v", "d" * 64, "theirs")
    staging = _complete_dir(tmp_path / "v.building-1", "d" * 64, "ours")
    assert publish(staging, final, "d" * 64, replace_complete=False) is False
    assert (final / "content.txt").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]


def test_publish_replaces_a_complete_venv_only_when_forced_and_an_incomplete_one_always(tmp_path):
    final = _complete_dir(tmp_path / "v", "d" * 64, "old")
    assert publish(_complete_dir(tmp_path / "v.building-1", "d" * 64, "forced"), final, "d" * 64,
                   replace_complete=True) is True
    assert (final / "content.txt").read_text() == "forced"
    (final / venvs.MARKER).unlink()  # now incomplete
    assert publish(_complete_dir(tmp_path / "v.building-2", "d" * 64, "new"), final, "d" * 64,
                   replace_complete=False) is True
    assert (final / "content.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]  # nothing left aside


def test_publish_loses_the_rename_race_to_a_complete_winner(tmp_path, monkeypatch):
    final = tmp_path / "v"
    staging = _complete_dir(tmp_path / "v.building-1", "d" * 64, "ours")
    real_rename = os.rename

    def winner_publishes_first(src, dst):
        # Another process's rename lands between our existence check and ours (an unserialized race).
        if Path(src) == staging and not final.exists():
            _complete_dir(tmp_path / "v.building-2", "d" * 64, "theirs")
            real_rename(tmp_path / "v.building-2", final)
        real_rename(src, dst)

    monkeypatch.setattr(venvs.os, "rename", winner_publishes_first)
    assert publish(staging, final, "d" * 64, replace_complete=False) is False
    assert (final / "content.txt").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v"]


def test_publish_fails_loudly_when_the_rename_race_winner_is_incomplete(tmp_path, monkeypatch):
    final = tmp_path / "v"
    staging = _complete_dir(tmp_path / "v.building-1", "d" * 64, "ours")
    real_rename = os.rename

    def half_winner(src, dst):
        if Path(src) == staging and not final.exists():
            (final / "bin").mkdir(parents=True)
        real_rename(src, dst)

    monkeypatch.setattr(venvs.os, "rename", half_winner)
    with pytest.raises(VenvBuildError, match=r"cannot move the venv build .* \(fix: remove .* and retry\)") as e:
        publish(staging, final, "d" * 64, replace_complete=False)
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno in (errno.ENOTEMPTY, errno.EEXIST)


def test_publish_refuses_a_build_without_its_marker(tmp_path):
    staging = tmp_path / "v.building-1"
    staging.mkdir()
    with pytest.raises(VenvBuildError, match="refusing to publish"):
        publish(staging, tmp_path / "v", "d" * 64, replace_complete=False)
    assert not (tmp_path / "v").exists()


def test_running_venv_info_reads_the_marker_of_the_prefix(tmp_path):
    venv = _complete_dir(tmp_path / "vllm-cpu-0123456789abcdef", "e" * 64, "")
    assert running_venv_info(str(venv)) == {"prefix": str(venv), "folder": venv.name, "spec_hash": "e" * 64}
    (venv / venvs.MARKER).unlink()
    assert running_venv_info(str(venv))["spec_hash"] is None


@pytest.mark.parametrize(
    ("line", "names_gym"),
    [
        ("-e nemo-gym[dev] @ ../../", True),
        ("-e nemo-gym[dev,sandbox] @ ../..", True),
        ("nemo_gym>=0.7", True),
        ("Nemo.Gym", True),
        ("nemo-gym-extras==1.0", False),
        ("my-nemo-gym-plugin", False),
        ("--extra-index-url something", False),
        ("not a requirement ==", False),
    ],
)
def test_a_line_names_nemo_gym_by_its_canonical_name_not_a_substring(line: str, names_gym: bool) -> None:
    assert venvs.requirement_names(line, venvs.GYM_DISTRIBUTION) is names_gym
