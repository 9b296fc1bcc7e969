"""PolicyCore.save_state / load_state: a restored policy continues bit for bit (weights, AdamW state,
the warmup's step counter, torch RNG), and a checkpoint that does not fit is refused by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_rl.algorithms.grpo import ClippedPGLossFn
from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy import LossConfig, PolicyConfig
from nemo_rl.models.policy.core import (
    OPTIMIZER_FILE,
    POLICY_STATE_FILE,
    WEIGHTS_FILE,
    PolicyCheckpointError,
    PolicyCore,
    PolicyStateInfo,
)

LOSS = ClippedPGLossFn.from_config(LossConfig())
BATCH = TrainBatch(
    token_ids=[[3, 17, 42, 9, 77, 5, 101], [8, 8, 30, 64, 12]],
    token_mask=[[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1]],
    generation_logprobs=[[0.0] * 7, [0.0] * 5],
    advantages=[1.0, -0.5],
)


def _core(model_dir: Path, **overrides) -> PolicyCore:
    # A warmup longer than the run: the lr of step k depends on the restored step counter.
    return PolicyCore(PolicyConfig(model_path=str(model_dir), learning_rate=1e-3, lr_warmup_steps=10, **overrides))


def test_a_restored_policy_continues_bit_for_bit(tiny_model_dir: Path, tmp_path: Path) -> None:
    original = _core(tiny_model_dir)
    fresh_optimizer = original.optimizer_fingerprint()
    original.train_step(BATCH, LOSS)
    assert original.optimizer_fingerprint() != fresh_optimizer
    original.train_step(BATCH, LOSS)
    saved = original.save_state(tmp_path / "ckpt")
    assert saved == PolicyStateInfo(2, original.state_fingerprint(), original.optimizer_fingerprint())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [WEIGHTS_FILE, OPTIMIZER_FILE, POLICY_STATE_FILE]
    after_save_rand = torch.rand(4)
    uninterrupted = original.train_step(BATCH, LOSS)

    restored = _core(tiny_model_dir)  # a new process would build the policy from model_path
    assert restored.state_fingerprint() != saved.policy_fingerprint
    torch.manual_seed(1234)  # whatever the new process's generator did meanwhile
    assert restored.load_state(tmp_path / "ckpt") == saved
    assert torch.equal(torch.rand(4), after_save_rand)  # the torch RNG continues where it was saved
    resumed = restored.train_step(BATCH, LOSS)
    assert resumed == uninterrupted  # same lr (warmup step 3), same loss, same grad norm
    assert resumed["lr"] == pytest.approx(3e-4)
    assert restored.state_fingerprint() == original.state_fingerprint()
    assert restored.optimizer_fingerprint() == original.optimizer_fingerprint()


def test_optimizer_fingerprint_sees_the_step_counter(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = _core(tiny_model_dir)
    core.train_step(BATCH, LOSS)
    core.save_state(tmp_path / "a")
    before = core.optimizer_fingerprint()
    core._steps_taken += 1  # only the warmup's counter differs
    assert core.optimizer_fingerprint() != before


def test_save_state_needs_an_empty_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "old.bin").write_bytes(b"")
    with pytest.raises(PolicyCheckpointError, match=r"already holds \['old.bin'\]"):
        _core(tiny_model_dir).save_state(tmp_path / "x")


def test_load_state_refuses_changed_optimizer_hyperparameters(tiny_model_dir: Path, tmp_path: Path) -> None:
    _core(tiny_model_dir).save_state(tmp_path / "c")
    with pytest.raises(PolicyCheckpointError, match=r"betas=\(0.9, 0.999\).*policy.adam_beta1/adam_beta2 gives \(0.5, 0.999\)"):
        _core(tiny_model_dir, adam_beta1=0.5).load_state(tmp_path / "c")
    with pytest.raises(PolicyCheckpointError, match=r"weight_decay=0.0 .*policy.weight_decay gives 0.1"):
        _core(tiny_model_dir, weight_decay=0.1).load_state(tmp_path / "c")


def test_load_state_refuses_another_model_before_touching_anything(
    tiny_model_dir: Path, make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    _core(tiny_model_dir).save_state(tmp_path / "c")
    tied = _core(make_tiny_model(tmp_path / "tied", tie_word_embeddings=True))
    before = (tied.state_fingerprint(), tied.optimizer_fingerprint())
    tied.save_state(tmp_path / "t")  # tied embeddings save fine (export refuses them, a checkpoint need not)
    with pytest.raises(PolicyCheckpointError, match=r"parameter groups of sizes \[\d+\], this model's optimizer has"):
        tied.load_state(tmp_path / "c")
    assert (tied.state_fingerprint(), tied.optimizer_fingerprint()) == before
    weights = load_file(str(tmp_path / "c" / WEIGHTS_FILE))
    name = sorted(weights)[0]
    save_file({**weights, name: weights[name][:1].clone()}, str(tmp_path / "c" / WEIGHTS_FILE))
    with pytest.raises(PolicyCheckpointError, match=rf"{name} is \(1, \d+\) torch.float32 there"):
        _core(tiny_model_dir).load_state(tmp_path / "c")
    del weights[name]
    save_file(weights, str(tmp_path / "c" / WEIGHTS_FILE))
    with pytest.raises(PolicyCheckpointError, match=rf"missing \['{name}'\], unexpected \[\]"):
        _core(tiny_model_dir).load_state(tmp_path / "c")
    (tmp_path / "c" / OPTIMIZER_FILE).write_bytes(b"not a torch file")
    with pytest.raises(PolicyCheckpointError, match="cannot read the checkpoint"):
        _core(tiny_model_dir).load_state(tmp_path / "c")


def test_load_state_detects_a_damaged_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = _core(tiny_model_dir)
    core.train_step(BATCH, LOSS)
    core.save_state(tmp_path / "c")
    record = json.loads((tmp_path / "c" / POLICY_STATE_FILE).read_text())
    (tmp_path / "c" / POLICY_STATE_FILE).write_text(json.dumps({**record, "steps_taken": 5}))
    with pytest.raises(PolicyCheckpointError, match="is not the state that was saved"):
        _core(tiny_model_dir).load_state(tmp_path / "c")
    (tmp_path / "c" / POLICY_STATE_FILE).unlink()
    with pytest.raises(PolicyCheckpointError, match=f"has no {POLICY_STATE_FILE}"):
        _core(tiny_model_dir).load_state(tmp_path / "c")
