"""Checkpoint folders: names, completeness, atomic commit, pruning, RNG states, log truncation, config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.algorithms.grpo_config import load_master_config
from nemo_rl.utils.checkpoint import (
    MARKER_FILE,
    CheckpointError,
    CheckpointingConfig,
    DirEntry,
    EntryKind,
    RngStates,
    capture_rng_states,
    commit_checkpoint,
    complete_steps,
    latest_complete_step,
    leftover_names,
    open_checkpoint,
    parse_entry,
    prune_checkpoints,
    records_through,
    remove_leftovers,
    restore_rng_states,
    scan,
    should_save,
    step_dir_name,
    steps_to_prune,
    tmp_dir_name,
    truncate_jsonl_after,
)
from nemo_rl.utils.config import ConfigError

RECIPE = Path(__file__).resolve().parents[3] / "examples/configs/grpo_capture_tiny_cpu.yaml"


# --- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind", "step"),
    [
        ("step_1", EntryKind.STEP, 1),
        ("step_120", EntryKind.STEP, 120),
        ("step_7.tmp-4242", EntryKind.TMP, 7),
        ("step_0", EntryKind.OTHER, None),  # checkpoints are taken after a step: no step 0
        ("step_01", EntryKind.OTHER, None),  # not a name we write
        ("step_3.tmp-", EntryKind.OTHER, None),
        ("step_3.tmp-12x", EntryKind.OTHER, None),
        ("step_3/", EntryKind.OTHER, None),
        ("README.md", EntryKind.OTHER, None),
        ("latest", EntryKind.OTHER, None),
    ],
)
def test_parse_entry(name: str, kind: EntryKind, step: int | None) -> None:
    parsed = parse_entry(name)
    assert (parsed.kind, parsed.step) == (kind, step)


def test_names_round_trip_and_reject_non_steps() -> None:
    assert step_dir_name(12) == "step_12"
    assert tmp_dir_name(12, 99) == "step_12.tmp-99"
    assert parse_entry(tmp_dir_name(12, 99)).step == 12
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="steps are ints >= 1"):
            step_dir_name(bad)


_names = st.one_of(
    st.integers(1, 60).map(lambda k: f"step_{k}"),
    st.tuples(st.integers(1, 60), st.integers(1, 99999)).map(lambda t: f"step_{t[0]}.tmp-{t[1]}"),
    st.sampled_from(["step_0", "step_07", "notes.txt", "latest", "step_x"]),
)
_entries = st.lists(st.tuples(_names, st.booleans()), max_size=25, unique_by=lambda t: t[0]).map(
    lambda pairs: [DirEntry(name, marker) for name, marker in pairs]
)


@settings(max_examples=300, deadline=None)
@given(_entries)
def test_latest_complete_is_the_newest_marked_step_folder(entries: list[DirEntry]) -> None:
    expected = sorted(int(e.name[5:]) for e in entries
                      if e.has_marker and e.name.startswith("step_") and e.name[5:].isdigit() and e.name[5] != "0")
    assert complete_steps(entries) == expected
    assert latest_complete_step(entries) == (expected[-1] if expected else None)


@settings(max_examples=300, deadline=None)
@given(_entries)
def test_leftovers_are_exactly_our_incomplete_names(entries: list[DirEntry]) -> None:
    leftovers = set(leftover_names(entries))
    complete = {step_dir_name(k) for k in complete_steps(entries)}
    ours = {e.name for e in entries if parse_entry(e.name).kind is not EntryKind.OTHER}
    assert leftovers.isdisjoint(complete)  # a complete checkpoint is never deleted as a leftover
    assert leftovers | complete == ours  # every name of ours is one or the other
    assert all(".tmp-" in n or not dict((e.name, e.has_marker) for e in entries)[n] for n in leftovers)


def test_a_marked_tmp_folder_is_never_complete() -> None:
    entries = [DirEntry("step_9.tmp-1", True), DirEntry("step_2", True), DirEntry("step_5", False)]
    assert latest_complete_step(entries) == 2
    assert leftover_names(entries) == ["step_5", "step_9.tmp-1"]
    assert latest_complete_step([]) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 500), max_size=30), st.one_of(st.none(), st.integers(1, 40)))
def test_steps_to_prune_keeps_the_newest(steps: list[int], keep_last: int | None) -> None:
    doomed = steps_to_prune(steps, keep_last)
    distinct = sorted(set(steps))
    kept = [s for s in distinct if s not in doomed]
    if keep_last is None:
        assert doomed == []
    else:
        assert kept == distinct[-keep_last:] if distinct else kept == []
        assert doomed == distinct[: len(distinct) - len(kept)]


def test_steps_to_prune_rejects_zero() -> None:
    with pytest.raises(ValueError, match="keep_last=0"):
        steps_to_prune([1, 2], 0)


@pytest.mark.parametrize(
    ("step", "period", "last", "expected"),
    [(1, 1, 3, True), (2, 2, 5, True), (3, 2, 5, False), (5, 2, 5, True), (4, 10, 4, True), (9, 10, 20, False)],
)
def test_should_save(step: int, period: int, last: int, expected: bool) -> None:
    assert should_save(step, period, last) is expected


def test_should_save_rejects_steps_outside_the_run() -> None:
    with pytest.raises(ValueError, match="need 1 <= step <= last_step"):
        should_save(4, 1, 3)


# --- the folder -----------------------------------------------------------------------------------


def _write_payload(folder: Path) -> None:
    (folder / "policy").mkdir()
    (folder / "policy" / "w.bin").write_bytes(b"\x00\x01" * 100)
    (folder / "state.json").write_text('{"a": 1}\n')


def test_commit_writes_marker_and_renames_into_place(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    seen: list[Path] = []

    def write(folder: Path) -> None:
        seen.append(folder)
        assert folder.name == tmp_dir_name(3, 77)  # written under the tmp name ...
        assert not (root / "step_3").exists()  # ... and not visible as step_3 yet
        _write_payload(folder)

    path = commit_checkpoint(root, 3, write, pid=77)
    assert path == root / "step_3" and not seen[0].exists()
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker == {"step": 3, "files": {"policy/w.bin": 200, "state.json": 9}}
    assert sorted(e.name for e in scan(root)) == ["step_3"]
    assert open_checkpoint(root, 3) == path


def test_commit_never_overwrites(tmp_path: Path) -> None:
    commit_checkpoint(tmp_path, 1, _write_payload)
    with pytest.raises(CheckpointError, match="already exists; a checkpoint is never overwritten") as raised:
        commit_checkpoint(tmp_path, 1, _write_payload)
    assert raised.value.kind == "exists"


def test_a_writer_killed_midway_leaves_a_leftover_that_is_never_loaded(tmp_path: Path) -> None:
    commit_checkpoint(tmp_path, 1, _write_payload)

    def dies(folder: Path) -> None:
        _write_payload(folder)
        raise KeyboardInterrupt  # stands in for SIGKILL: nothing after write() runs

    with pytest.raises(KeyboardInterrupt):
        commit_checkpoint(tmp_path, 2, dies, pid=5)
    assert (tmp_path / "step_2.tmp-5" / "state.json").exists()
    assert latest_complete_step(scan(tmp_path)) == 1
    (tmp_path / "step_4").mkdir()  # a step folder without its marker (e.g. a copy that was cut short)
    (tmp_path / "unrelated").mkdir()
    assert remove_leftovers(tmp_path) == ["step_2.tmp-5", "step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "unrelated"]


def test_open_checkpoint_refuses_a_damaged_one(tmp_path: Path) -> None:
    path = commit_checkpoint(tmp_path, 2, _write_payload)
    (path / "policy" / "w.bin").write_bytes(b"\x00")
    with pytest.raises(CheckpointError, match=r"policy/w.bin is 1 bytes but the marker recorded 200 bytes") as raised:
        open_checkpoint(tmp_path, 2)
    assert raised.value.kind == "corrupt"
    (path / "policy" / "w.bin").unlink()
    with pytest.raises(CheckpointError, match=r"policy/w.bin is missing") as raised:
        open_checkpoint(tmp_path, 2)
    assert raised.value.kind == "corrupt"
    (path / MARKER_FILE).write_text('{"step": 3, "files": {}}')
    with pytest.raises(CheckpointError, match="does not describe step 2") as raised:
        open_checkpoint(tmp_path, 2)
    assert raised.value.kind == "corrupt"
    (path / MARKER_FILE).unlink()
    with pytest.raises(CheckpointError, match="is not a complete checkpoint") as raised:
        open_checkpoint(tmp_path, 2)
    assert raised.value.kind == "incomplete"


def test_prune_keeps_the_newest_and_leaves_no_partial_folder(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        commit_checkpoint(tmp_path, step, _write_payload)
    assert prune_checkpoints(tmp_path, 2) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    assert prune_checkpoints(tmp_path, None) == []
    assert prune_checkpoints(tmp_path, 2) == []


def test_scan_of_a_missing_folder_is_empty_and_of_a_file_is_an_error(tmp_path: Path) -> None:
    assert scan(tmp_path / "nope") == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="is not a folder") as raised:
        scan(tmp_path / "f")
    assert raised.value.kind == "not_a_folder"


# --- RNG states -----------------------------------------------------------------------------------


def _draws() -> tuple:
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()),
            torch.rand(3).tolist())


def test_rng_states_restore_every_generator_through_json() -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.randn()
    states = capture_rng_states()
    first = _draws()
    restore_rng_states(RngStates.model_validate_json(states.model_dump_json()))
    assert _draws() == first
    assert _draws() != first  # the generators did move on


def test_rng_states_reject_a_short_numpy_key() -> None:
    data = json.loads(capture_rng_states().model_dump_json())
    data["numpy"]["key"] = data["numpy"]["key"][:10]
    with pytest.raises(ValueError, match="key"):
        RngStates.model_validate(data)


# --- logs of a resumed run -------------------------------------------------------------------------


def _jsonl(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "x": i}) + "\n" for i, s in enumerate(steps))


def test_records_through_drops_later_steps_and_a_torn_tail() -> None:
    kept, dropped = records_through(_jsonl(1, 1, 2, 3, 3) + '{"step": 4, "x', 2, "m.jsonl")
    assert kept == _jsonl(1, 1, 2) and dropped == 3
    assert records_through(_jsonl(1, 2), 2, "m.jsonl") == (_jsonl(1, 2), 0)


def test_records_through_names_a_bad_line() -> None:
    with pytest.raises(CheckpointError, match=r"m.jsonl:2: not valid JSON") as raised:
        records_through(_jsonl(1) + "garbage\n" + _jsonl(2), 5, "m.jsonl")
    assert raised.value.kind == "unreadable_log"
    with pytest.raises(CheckpointError, match=r"m.jsonl:1: a record without an integer `step`") as raised:
        records_through('{"x": 1}\n', 5, "m.jsonl")
    assert raised.value.kind == "unreadable_log"


def test_truncate_jsonl_after(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert truncate_jsonl_after(path, 3) == 0 and not path.exists()
    path.write_text(_jsonl(1, 2, 3, 4))
    assert truncate_jsonl_after(path, 2) == 2
    assert path.read_text() == _jsonl(1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no tmp file left


# --- config ----------------------------------------------------------------------------------------


def test_config_defaults_and_overrides_without_plus() -> None:
    assert CheckpointingConfig() == CheckpointingConfig(
        enabled=False, save_period=10, checkpoint_dir=None, resume=None, keep_last=None)
    cfg = load_master_config(RECIPE, ["logger.log_dir=/tmp/l", "checkpointing.enabled=true", "checkpointing.save_period=1",
                                      "checkpointing.checkpoint_dir=/tmp/c", "checkpointing.resume=latest",
                                      "checkpointing.keep_last=2"])
    assert cfg.checkpointing == CheckpointingConfig(
        enabled=True, save_period=1, checkpoint_dir="/tmp/c", resume="latest", keep_last=2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["checkpointing.enabled=true"], r"checkpointing.checkpoint_dir is unset but checkpointing.enabled=true needs it"),
        (["checkpointing.resume=latest"], r"checkpointing.checkpoint_dir is unset but checkpointing.resume='latest'"),
        (["checkpointing.resume=first", "checkpointing.checkpoint_dir=/c"], r"checkpointing.resume='first'"),
        (["checkpointing.save_period=0"], r"checkpointing.save_period=0: .* >= 1"),
        (["checkpointing.keep_last=0"], r"checkpointing.keep_last=0: .* >= 1"),
        (["+checkpointing.every=3"], r"unknown key checkpointing.every"),
    ],
)
def test_config_errors_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_master_config(RECIPE, ["logger.log_dir=/tmp/l", *overrides])
