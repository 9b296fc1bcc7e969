"""`state_io` over a PolicyCore: the refit export reloads to identical logits, fingerprints follow the
weights, and save_state / load_state restore a policy that continues bit for bit (weights, AdamW
state, the warmup's step counter, torch RNG); a checkpoint that does not fit is refused by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen2ForCausalLM

from nemo_rl.algorithms.grpo import ClippedPGLossFn
from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy import LossConfig, PolicyConfig, PolicyWorkerHandle, state_io
from nemo_rl.models.policy.errors import PolicyStateError
from nemo_rl.models.policy.state_io import (
    OPTIMIZER_FILE,
    POLICY_STATE_FILE,
    WEIGHTS_FILE,
    PolicyStateInfo,
    export_weights,
    load_state,
    optimizer_fingerprint,
    save_state,
    state_fingerprint,
)
from nemo_rl.models.policy.worker import PolicyCore

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


# The export tests pin the refit of an on-policy step (weight 1, placeholder generation logprobs).
STEP_LOSS = ClippedPGLossFn.from_config(LossConfig(behaviour_logprobs="recomputed"))
SEQ = [3, 17, 42, 9, 77, 5, 101, 64, 12]
MASK = [0] * 4 + [1] * 5


def _plain_core(model_dir: Path, **overrides) -> PolicyCore:
    return PolicyCore(PolicyConfig(model_path=str(model_dir), **overrides))


def test_the_core_and_state_io_answer_every_call_of_the_worker_handle(tiny_model_dir: Path) -> None:
    """In one process the handle's calls are the core's train step and `state_io`'s functions."""
    calls = {name for name in vars(PolicyWorkerHandle) if not name.startswith("_")}
    assert calls == {"get_logprobs", "train_step", "export_weights", "state_fingerprint"}
    core = _plain_core(tiny_model_dir)
    assert {name for name in calls if callable(getattr(core, name, None))} == {"train_step"}
    assert {name for name in calls if callable(getattr(state_io, name, None))} == {
        "get_logprobs", "export_weights", "state_fingerprint"
    }


def test_export_round_trips_to_identical_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = _plain_core(tiny_model_dir, learning_rate=1e-3)
    core.train_step(TrainBatch(token_ids=[SEQ], token_mask=[MASK], generation_logprobs=[[0.0] * len(SEQ)], advantages=[1.0]), STEP_LOSS)
    out = export_weights(core, tmp_path / "export")
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "model.safetensors"]
    # HF parameter names, exactly those of the checkpoint the policy was loaded from.
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == load_file(str(tiny_model_dir / "model.safetensors")).keys()
    fresh = Qwen2ForCausalLM(AutoConfig.from_pretrained(out))
    fresh.load_state_dict(exported, strict=True)
    fresh.eval()
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, core.model(input_ids=ids).logits)
    # Re-export into the same folder overwrites; a foreign shard there is refused.
    export_weights(core, out)
    (out / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(PolicyStateError, match="model-00001-of-00002.safetensors") as excinfo:
        export_weights(core, out)
    assert excinfo.value.kind == "export"


def test_tied_model_export_is_refused_for_the_cpu_engine(tmp_path: Path, make_tiny_model: Callable[..., Path]) -> None:
    core = _plain_core(make_tiny_model(tmp_path / "tied", tie_word_embeddings=True))  # engine_flavor defaults to cpu
    with pytest.raises(PolicyStateError, match=r"stale lm_head on the CPU engine .*tie_word_embeddings=false") as excinfo:
        export_weights(core, tmp_path / "export")
    assert excinfo.value.kind == "export"
    assert not (tmp_path / "export").exists()


def test_tied_model_exports_for_the_gpu_engine_with_a_fresh_lm_head(
    tmp_path: Path, make_tiny_model: Callable[..., Path]
) -> None:
    core = _plain_core(make_tiny_model(tmp_path / "tied", tie_word_embeddings=True), engine_flavor="gpu", learning_rate=1e-2)
    batch = TrainBatch(token_ids=[SEQ], token_mask=[MASK], generation_logprobs=[[0.0] * len(SEQ)], advantages=[1.0])
    core.train_step(batch, STEP_LOSS)  # the tied matrix moves: an export of the old lm_head would be stale
    out = export_weights(core, tmp_path / "export")
    saved = load_file(str(out / "model.safetensors"))
    embed = core.model.get_input_embeddings().weight.detach()
    assert torch.equal(saved["model.embed_tokens.weight"], embed)
    if "lm_head.weight" in saved:  # both names, one value: a loader that skips the tied name reads the same
        assert torch.equal(saved["lm_head.weight"], embed)
    fresh = Qwen2ForCausalLM.from_pretrained(out)
    assert fresh.config.tie_word_embeddings and torch.equal(fresh.lm_head.weight, embed)
    ids = torch.tensor([SEQ])
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, core.model(input_ids=ids).logits)


def test_fingerprint_is_a_function_of_the_weights(
    tiny_model_dir: Path, tmp_path: Path, make_tiny_model: Callable[..., Path]
) -> None:
    a, b = _plain_core(tiny_model_dir), _plain_core(tiny_model_dir)
    assert state_fingerprint(a) == state_fingerprint(b)
    c = _plain_core(make_tiny_model(tmp_path / "other", seed=1))
    assert state_fingerprint(c) != state_fingerprint(a)


def test_a_restored_policy_continues_bit_for_bit(tiny_model_dir: Path, tmp_path: Path) -> None:
    original = _core(tiny_model_dir)
    fresh_optimizer = optimizer_fingerprint(original)
    original.train_step(BATCH, LOSS)
    assert optimizer_fingerprint(original) != fresh_optimizer
    original.train_step(BATCH, LOSS)
    saved = save_state(original, tmp_path / "ckpt")
    assert saved == PolicyStateInfo(2, state_fingerprint(original), optimizer_fingerprint(original))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [WEIGHTS_FILE, OPTIMIZER_FILE, POLICY_STATE_FILE]
    after_save_rand = torch.rand(4)
    uninterrupted = original.train_step(BATCH, LOSS)

    restored = _core(tiny_model_dir)  # a new process would build the policy from model_path
    assert state_fingerprint(restored) != saved.policy_fingerprint
    torch.manual_seed(1234)  # whatever the new process's generator did meanwhile
    assert load_state(restored, tmp_path / "ckpt") == saved
    assert torch.equal(torch.rand(4), after_save_rand)  # the torch RNG continues where it was saved
    resumed = restored.train_step(BATCH, LOSS)
    assert resumed == uninterrupted  # same lr (warmup step 3), same loss, same grad norm
    assert resumed["lr"] == pytest.approx(3e-4)
    assert state_fingerprint(restored) == state_fingerprint(original)
    assert optimizer_fingerprint(restored) == optimizer_fingerprint(original)


def test_optimizer_fingerprint_sees_the_step_counter(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = _core(tiny_model_dir)
    core.train_step(BATCH, LOSS)
    save_state(core, tmp_path / "a")
    before = optimizer_fingerprint(core)
    core._steps_taken += 1  # only the warmup's counter differs
    assert optimizer_fingerprint(core) != before


def test_save_state_needs_an_empty_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "old.bin").write_bytes(b"")
    with pytest.raises(PolicyStateError, match=r"already holds \['old.bin'\]") as excinfo:
        save_state(_core(tiny_model_dir), tmp_path / "x")
    assert excinfo.value.kind == "checkpoint"


def test_load_state_refuses_changed_optimizer_hyperparameters(tiny_model_dir: Path, tmp_path: Path) -> None:
    save_state(_core(tiny_model_dir), tmp_path / "c")
    with pytest.raises(PolicyStateError, match=r"betas=\(0.9, 0.999\).*policy.adam_beta1/adam_beta2 gives \(0.5, 0.999\)") as excinfo:
        load_state(_core(tiny_model_dir, adam_beta1=0.5), tmp_path / "c")
    assert excinfo.value.kind == "checkpoint"
    with pytest.raises(PolicyStateError, match=r"weight_decay=0.0 .*policy.weight_decay gives 0.1") as excinfo:
        load_state(_core(tiny_model_dir, weight_decay=0.1), tmp_path / "c")
    assert excinfo.value.kind == "checkpoint"


def test_load_state_refuses_another_model_before_touching_anything(
    tiny_model_dir: Path, make_tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    save_state(_core(tiny_model_dir), tmp_path / "c")
    tied = _core(make_tiny_model(tmp_path / "tied", tie_word_embeddings=True))
    before = (state_fingerprint(tied), optimizer_fingerprint(tied))
    save_state(tied, tmp_path / "t")  # tied embeddings save fine (export refuses them, a checkpoint need not)
    with pytest.raises(PolicyStateError, match=r"parameter groups of sizes \[\d+\], this model's optimizer has") as excinfo:
        load_state(tied, tmp_path / "c")
    assert excinfo.value.kind == "checkpoint"
    assert (state_fingerprint(tied), optimizer_fingerprint(tied)) == before
    weights = load_file(str(tmp_path / "c" / WEIGHTS_FILE))
    name = sorted(weights)[0]
    save_file({**weights, name: weights[name][:1].clone()}, str(tmp_path / "c" / WEIGHTS_FILE))
    with pytest.raises(PolicyStateError, match=rf"{name} is \(1, \d+\) torch.float32 there") as excinfo:
        load_state(_core(tiny_model_dir), tmp_path / "c")
    assert excinfo.value.kind == "checkpoint"
    del weights[name]
    save_file(weights, str(tmp_path / "c" / WEIGHTS_FILE))
    with pytest.raises(PolicyStateError, match=rf"missing \['{name}'\], unexpected \[\]") as excinfo:
        load_state(_core(tiny_model_dir), tmp_path / "c")
    assert excinfo.value.kind == "checkpoint"
    (tmp_path / "c" / OPTIMIZER_FILE).write_bytes(b"not a torch file")
    with pytest.raises(PolicyStateError, match="cannot read the checkpoint") as excinfo:
        load_state(_core(tiny_model_dir), tmp_path / "c")
    assert excinfo.value.kind == "checkpoint"


def test_load_state_detects_a_damaged_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    core = _core(tiny_model_dir)
    core.train_step(BATCH, LOSS)
    save_state(core, tmp_path / "c")
    record = json.loads((tmp_path / "c" / POLICY_STATE_FILE).read_text())
    (tmp_path / "c" / POLICY_STATE_FILE).write_text(json.dumps({**record, "steps_taken": 5}))
    with pytest.raises(PolicyStateError, match="is not the state that was saved") as excinfo:
        load_state(_core(tiny_model_dir), tmp_path / "c")
    assert excinfo.value.kind == "checkpoint"
    (tmp_path / "c" / POLICY_STATE_FILE).unlink()
    with pytest.raises(PolicyStateError, match=f"has no {POLICY_STATE_FILE}") as excinfo:
        load_state(_core(tiny_model_dir), tmp_path / "c")
    assert excinfo.value.kind == "checkpoint"
