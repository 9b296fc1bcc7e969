"""A folder every node must share: the driver's marker read back, or an error naming the knob."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.distributed.shared_fs import PROBE_PREFIX, SharedDirError, check_probe, remove_probe, require_dir, write_probe

FIX = ("(fix: on a multi-node cluster set grpo.refit_dir to a folder on a filesystem every node mounts at the same "
       "path, e.g. NFS or Lustre; on one node, check that the folder exists)")


def test_a_probe_written_here_reads_back_and_is_removed(tmp_path: Path) -> None:
    folder = tmp_path / "refit" / "deep"
    probe = write_probe(folder)
    assert probe.folder == str(folder) and probe.marker.startswith(PROBE_PREFIX) and len(probe.token) == 32
    assert (folder / probe.marker).read_text() == probe.token
    check_probe(probe, "grpo.refit_dir", "vLLM worker 0 on node 10.0.0.1")
    remove_probe(probe)
    assert list(folder.iterdir()) == []
    remove_probe(probe)  # idempotent


def test_relative_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs an absolute folder"):
        write_probe(Path("relative/refit"))


def test_a_node_without_the_folder_fails_naming_the_knob(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "refit")
    remove_probe(probe)  # as seen from a node whose mount lacks the file
    with pytest.raises(SharedDirError) as e:
        check_probe(probe, "grpo.refit_dir", "vLLM worker 1 on node 10.0.0.2")
    assert str(e.value) == (
        f"vLLM worker 1 on node 10.0.0.2 cannot see {tmp_path / 'refit' / probe.marker}, which the driver wrote in "
        f"grpo.refit_dir={tmp_path / 'refit'}: that folder is not shared with this node {FIX}"
    )


def test_a_same_named_local_folder_is_told_apart_by_the_token(tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "refit")
    (tmp_path / "refit" / probe.marker).write_text("another node's file")
    with pytest.raises(SharedDirError, match=r"reads another file at .* a different folder of the same name on this node"):
        check_probe(probe, "grpo.refit_dir", "the policy worker on node 10.0.0.3")


def test_require_dir(tmp_path: Path) -> None:
    require_dir(tmp_path, "grpo.refit_dir", "w")
    with pytest.raises(SharedDirError) as e:
        require_dir(tmp_path / "absent", "grpo.refit_dir", "vLLM worker 0 on node 10.0.0.1")
    assert str(e.value) == f"vLLM worker 0 on node 10.0.0.1 cannot see the folder grpo.refit_dir={tmp_path / 'absent'} {FIX}"
    (tmp_path / "file").write_text("x")
    with pytest.raises(SharedDirError, match="cannot see the folder model.path="):
        require_dir(tmp_path / "file", "model.path", "w")
