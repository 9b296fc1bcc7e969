"""Fixtures: a tiny randomly initialised Qwen2ForCausalLM saved into a temp folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 128


def build_tiny_qwen2(out_dir: Path, tie_word_embeddings: bool = False, seed: int = 0) -> Path:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture
def make_tiny_model() -> Callable[..., Path]:
    """The builder itself, for tests that need a tied or differently seeded variant."""
    return build_tiny_qwen2
