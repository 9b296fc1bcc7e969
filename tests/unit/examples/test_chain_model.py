"""The tiny model's chained variant: its transcripts, its own cache folder, a small real fine-tune of a small base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.arith.chain import Chain, chain_tool_output
from examples.arith.tiny_model import TinyModelConfig, cache_folder
from examples.arith.tiny_model import build, chain_model
from examples.arith.tiny_model.build import read_build_info
from examples.arith.tiny_model.chain_model import (
    CORPUS_NAME,
    FINE_TUNE_LR,
    chain_cache_folder,
    chain_cache_key,
    chain_conversation,
    ensure_chain_tiny_model,
)

SMALL = TinyModelConfig(
    vocab_size=512, tokenizer_transcripts=32, english_modules=("json",), hidden_size=32, num_layers=2,
    num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=1024, sft_examples=8,
    sft_steps=2, sft_batch_size=4, log_every=1,
)


def test_a_chained_transcript_calls_once_per_link_then_answers() -> None:
    chain = Chain(start=7, links=(("+", 2), ("*", 3)))
    messages = chain_conversation(chain)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    calls = [json.loads(m["tool_calls"][0]["function"]["arguments"])["expression"] for m in messages if m.get("tool_calls")]
    assert calls == ["7 + 2", "9 * 3"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["9 (next: * 3)", "27 (done)"]
    assert chain_tool_output("9 * 3", chain, 1)[0] == "27 (done)"
    assert messages[-1]["content"] == "The answer is 27."


def test_the_chained_variant_has_its_own_cache_folder(tmp_path: Path) -> None:
    cfg = TinyModelConfig()
    assert chain_cache_folder(cfg, tmp_path).name == "chain-" + chain_cache_key(cfg)[:24]
    assert chain_cache_folder(cfg, tmp_path).parent == cache_folder(cfg, tmp_path).parent
    assert chain_cache_folder(cfg, tmp_path) != cache_folder(cfg, tmp_path)
    assert chain_cache_key(SMALL) != chain_cache_key(cfg)


def test_a_small_chained_build_fine_tunes_the_cached_default_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chain_model, "FINE_TUNE_STEPS", 2)  # the unit lane's budget; the key follows it
    small = SMALL
    folder = ensure_chain_tiny_model(small, cache_root=tmp_path, progress=lambda _: None)
    assert folder == chain_cache_folder(small, tmp_path)
    info = read_build_info(folder)
    base = cache_folder(small, tmp_path)
    assert (info["corpus"], info["cache_key"], info["base_model"]) == (CORPUS_NAME, chain_cache_key(small), str(base))
    assert info["fine_tune"] == {"sft_steps": 2, "learning_rate": FINE_TUNE_LR}
    assert build.sha256_file(folder / "tokenizer.json") == build.sha256_file(base / "tokenizer.json")
    assert build.sha256_file(folder / "model.safetensors") != build.sha256_file(base / "model.safetensors")
    assert ensure_chain_tiny_model(small, cache_root=tmp_path, progress=pytest.fail) == folder  # no rebuild
