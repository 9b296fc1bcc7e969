"""GRPO checkpoints without the stack: the step is the dataloader position, choosing what to resume,
refusing a recipe that would continue with other prompts, cutting logs back to the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.arith.gym_task import TASK as ARITH_TASK
from nemo_rl.algorithms.grpo_checkpoint import (
    TRAINER_STATE_FILE,
    TrainerState,
    batch_digest,
    check_prompt_position,
    check_resumable,
    prepare_checkpointing,
    prompt_records,
    read_trainer_state,
    write_trainer_state,
)
from nemo_rl.algorithms.grpo_single_controller import resumable_logs
from nemo_rl.environments.datasets import task_pool
from nemo_rl.environments.gym_client import PromptDataset, TaskPromptSource
from nemo_rl.environments.task import RowSampling
from nemo_rl.utils.checkpoint import (
    CheckpointError,
    CheckpointingConfig,
    capture_rng_states,
    commit_checkpoint,
)

SAMPLING = RowSampling(temperature=1.0, top_p=1.0, max_output_tokens=48)
RNG = capture_rng_states()
DIGEST = "ab" * 32


def _sources(seed: int):
    rows = [{"id": i, "responses_create_params": {"input": f"q{i}"}} for i in range(7)]
    return {
        "arith": lambda: TaskPromptSource(ARITH_TASK, seed, SAMPLING),
        "arith_pool": lambda: task_pool(ARITH_TASK, seed, 5, SAMPLING),
        "dataset": lambda: PromptDataset(rows, seed, SAMPLING),
    }


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 4), total=st.integers(2, 9), data=st.data())
def test_the_step_is_the_dataloader_position(seed: int, n: int, total: int, data: st.DataObject) -> None:
    """A run killed after step k and resumed with a NEW source instance (a new process) dispatches
    exactly the prompts an uninterrupted run dispatches: the sources are pure in (seed, step)."""
    k = data.draw(st.integers(1, total - 1), label="k")
    for name, make in _sources(seed).items():
        uninterrupted = [make().batch(s, n) for s in range(1, total + 1)]
        first, resumed = make(), make()
        both = [first.batch(s, n) for s in range(1, k + 1)] + [resumed.batch(s, n) for s in range(k + 1, total + 1)]
        assert both == uninterrupted, name
        # What the loop logs (dispatched_prompts.jsonl) and what a checkpoint records agree with it.
        logged = [r["digest"] for s, rows in enumerate(both, start=1) for r in prompt_records(s, rows)]
        assert logged == [batch_digest([row]) for rows in uninterrupted for row in rows]


def test_a_dataset_walks_every_row_once_per_epoch_across_a_resume() -> None:
    rows = [{"id": i, "responses_create_params": {"input": f"q{i}"}} for i in range(6)]
    before = PromptDataset(rows, 9, SAMPLING)
    after = PromptDataset(rows, 9, SAMPLING)  # the resumed process
    walked = [r["id"] for s in (1, 2) for r in before.batch(s, 2)] + [r["id"] for s in (3, 4, 5, 6) for r in after.batch(s, 2)]
    assert sorted(walked[:6]) == list(range(6)) and sorted(walked[6:]) == list(range(6))  # none dropped, none repeated


def test_batch_digest_is_order_and_content_sensitive() -> None:
    a, b = {"x": 1, "y": [1, 2]}, {"x": 2}
    assert batch_digest([a, b]) == batch_digest([{"y": [1, 2], "x": 1}, b])  # key order is not content
    assert batch_digest([a, b]) != batch_digest([b, a])
    assert batch_digest([a]) != batch_digest([{"x": 1, "y": [2, 1]}])
    assert prompt_records(3, [a, b]) == [{"step": 3, "group": 0, "digest": batch_digest([a])},
                                         {"step": 3, "group": 1, "digest": batch_digest([b])}]


def _state(step: int = 2, **changes) -> TrainerState:
    fields = dict(step=step, weight_version=step, masked_streak=0, seed=42, num_prompts_per_step=2,
                  prompt_batch_digest=batch_digest(TaskPromptSource(ARITH_TASK, 42, SAMPLING).batch(step, 2)),
                  policy_fingerprint=DIGEST, optimizer_fingerprint=DIGEST, policy_steps_taken=step,
                  engine_probe=(0.0, -1.5), rng=RNG)
    return TrainerState(**{**fields, **changes})


def test_trainer_state_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="step"):
        _state(step=0)
    with pytest.raises(ValueError, match="policy_fingerprint"):
        _state(policy_fingerprint="nope")
    with pytest.raises(ValueError, match="engine_probe"):
        _state(engine_probe=())


def test_check_resumable_names_the_changed_field() -> None:
    check_resumable(_state(), seed=42, num_prompts_per_step=2)
    with pytest.raises(CheckpointError, match=r"grpo.seed=7 but .* written with grpo.seed=42; .*fix: set grpo.seed=42") as raised:
        check_resumable(_state(), seed=7, num_prompts_per_step=2)
    assert raised.value.kind == "mismatch"
    with pytest.raises(CheckpointError, match=r"grpo.num_prompts_per_step=4 .* grpo.num_prompts_per_step=2") as raised:
        check_resumable(_state(), seed=42, num_prompts_per_step=4)
    assert raised.value.kind == "mismatch"


def test_check_prompt_position_refuses_other_prompts() -> None:
    check_prompt_position(_state(), TaskPromptSource(ARITH_TASK, 42, SAMPLING).batch(2, 2))
    with pytest.raises(CheckpointError, match="gives step 2 other prompts") as raised:
        check_prompt_position(_state(), TaskPromptSource(ARITH_TASK, 42, SAMPLING).batch(3, 2))
    assert raised.value.kind == "mismatch"
    hotter = RowSampling(temperature=0.5, top_p=1.0, max_output_tokens=48)
    with pytest.raises(CheckpointError, match="gives step 2 other prompts") as raised:
        check_prompt_position(_state(), TaskPromptSource(ARITH_TASK, 42, hotter).batch(2, 2))
    assert raised.value.kind == "mismatch"


def _commit(root: Path, step: int) -> Path:
    def write(folder: Path) -> None:
        (folder / "policy").mkdir()
        (folder / "policy" / "weights").write_bytes(b"w")
        write_trainer_state(folder, _state(step))

    return commit_checkpoint(root, step, write)


def _cfg(root: Path, **kw) -> CheckpointingConfig:
    return CheckpointingConfig(checkpoint_dir=str(root), **kw)


def test_prepare_without_a_checkpoint_dir_does_nothing() -> None:
    assert prepare_checkpointing(CheckpointingConfig(), [], progress=pytest.fail) is None


def test_resume_latest_without_a_checkpoint_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"checkpointing.resume='latest' but checkpointing.checkpoint_dir=.*"
                                              r"holds no complete checkpoint \(the folder does not exist\)") as raised:
        prepare_checkpointing(_cfg(tmp_path / "missing", resume="latest"), [])
    assert raised.value.kind == "no_checkpoint"
    (tmp_path / "step_3.tmp-1").mkdir()  # only a killed writer's leftover
    with pytest.raises(CheckpointError, match="no step_<k> folder with its marker") as raised:
        prepare_checkpointing(_cfg(tmp_path, resume="latest"), [], progress=lambda _: None)
    assert raised.value.kind == "no_checkpoint"
    assert not (tmp_path / "step_3.tmp-1").exists()


def test_a_fresh_run_refuses_a_folder_with_checkpoints(tmp_path: Path) -> None:
    _commit(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints of steps \[1\].*checkpointing.resume=latest") as raised:
        prepare_checkpointing(_cfg(tmp_path, enabled=True), [])
    assert raised.value.kind == "dir_not_empty"
    assert prepare_checkpointing(_cfg(tmp_path / "new", enabled=True), []) is None


def test_resume_picks_the_newest_complete_one_and_cuts_the_logs(tmp_path: Path) -> None:
    root, logs = tmp_path / "ckpt", tmp_path / "logs"
    _commit(root, 1)
    _commit(root, 2)
    (root / "step_3.tmp-999").mkdir()  # step 3 was being written when the run was killed
    (root / "step_3.tmp-999" / TRAINER_STATE_FILE).write_text(_state(3).model_dump_json())
    logs.mkdir()
    metrics, dispatched = resumable_logs(logs)[0], resumable_logs(logs)[2]
    metrics.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    dispatched.write_text("".join(json.dumps({"step": s, "group": g}) + "\n" for s in (1, 2, 3) for g in (0, 1)))
    said: list[str] = []
    point = prepare_checkpointing(_cfg(root, resume="latest", enabled=True), resumable_logs(logs), said.append)
    assert point is not None and point.step == 2 and point.folder == root / "step_2"
    assert point.state == _state(2)
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    assert [json.loads(line)["step"] for line in dispatched.read_text().splitlines()] == [1, 1, 2, 2]
    assert said == [
        f"[checkpoint] removed half-written checkpoints of a killed run from {root}: ['step_3.tmp-999']",
        f"[checkpoint] {metrics}: dropped 1 record(s) after step 2 (those steps are redone)",
        f"[checkpoint] {dispatched}: dropped 2 record(s) after step 2 (those steps are redone)",
    ]


def test_resume_refuses_a_damaged_newest_checkpoint(tmp_path: Path) -> None:
    _commit(tmp_path, 1)
    newest = _commit(tmp_path, 2)
    (newest / "policy" / "weights").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"step_2: policy/weights is 0 bytes") as raised:
        prepare_checkpointing(_cfg(tmp_path, resume="latest"), [])
    assert raised.value.kind == "corrupt"
    (newest / "policy" / "weights").write_bytes(b"w")
    (newest / TRAINER_STATE_FILE).write_text("{}")
    with pytest.raises(CheckpointError, match="not a valid TrainerState") as raised:
        read_trainer_state(newest)
    assert raised.value.kind == "corrupt"
