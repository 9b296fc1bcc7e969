"""The tiny Qwen3-architecture model folder: real vocabulary, padded embedding, the family template, cache."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from examples.families.cache import FamilyBuildError
from examples.families.qwen3_model import (
    QWEN3_PADDED_VOCAB,
    Qwen3TinyConfig,
    build_qwen3_tiny_model,
    cache_key,
    ensure_qwen3_tiny_model,
)
from examples.families.qwen3_template import QWEN3_CHAT_TEMPLATE
from examples.families.vocab import QWEN3, ensure_family_tokenizer


@pytest.fixture(scope="module")
def model_dir():
    return ensure_qwen3_tiny_model(Qwen3TinyConfig())


def test_config_is_qwen3_with_the_padded_vocabulary(model_dir):
    config = AutoConfig.from_pretrained(str(model_dir))
    assert (config.model_type, config.architectures) == ("qwen3", ["Qwen3ForCausalLM"])
    assert config.vocab_size == QWEN3_PADDED_VOCAB == 151936
    assert (config.eos_token_id, config.pad_token_id, config.tie_word_embeddings) == (151645, 151643, False)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == ([151645, 151643], 151643)


def test_folder_carries_the_family_tokenizer_and_template(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.chat_template == QWEN3_CHAT_TEMPLATE
    family = ensure_family_tokenizer(QWEN3)
    assert (model_dir / "tokenizer.json").read_bytes() == (family / "tokenizer.json").read_bytes()
    assert tokenizer.convert_tokens_to_ids(["<|im_end|>", "<tool_call>", "<think>"]) == [151645, 151657, 151667]


def test_model_runs_over_the_whole_vocabulary(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 872, 198, 151668, 151935]])).logits
    assert logits.shape == (1, 5, 151936)
    assert torch.isfinite(logits).all()


def test_cache_reuses_and_checks_the_build(model_dir):
    assert ensure_qwen3_tiny_model(Qwen3TinyConfig()) == model_dir
    assert model_dir.name == cache_key(Qwen3TinyConfig())[:24]
    assert cache_key(Qwen3TinyConfig(seed=1)) != cache_key(Qwen3TinyConfig())


def test_equal_configs_build_byte_identical_folders(tmp_path, model_dir):
    again = build_qwen3_tiny_model(Qwen3TinyConfig(), tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    info = json.loads((again / "build_info.json").read_text())
    assert info == json.loads((model_dir / "build_info.json").read_text())
    assert info["parameters"] == 2 * 151936 * 128 + 2 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256 + 2 * 128 + 2 * 64) + 128


def test_a_cached_folder_of_another_key_is_refused(tmp_path, model_dir):
    cfg = Qwen3TinyConfig()
    folder = tmp_path / "families" / "qwen3-tiny" / cache_key(cfg)[:24]
    folder.mkdir(parents=True)
    (folder / "build_info.json").write_text(json.dumps({"cache_key": "stale"}))
    with pytest.raises(FamilyBuildError, match="cache_key 'stale'"):
        ensure_qwen3_tiny_model(cfg, tmp_path)


def test_config_refuses_a_vocabulary_smaller_than_the_tokenizer():
    with pytest.raises(ValueError, match="151669"):
        Qwen3TinyConfig(vocab_size=151668)
