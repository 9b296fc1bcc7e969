"""A tiny Qwen3-architecture policy on the real Qwen3 vocabulary, with the family's chat template.

Contract:
- `Qwen3TinyConfig` is the only home of the tiny sizes; `vocab_size` is Qwen3's padded embedding
  (151,936 rows, above the 151,669 tokens), weights are float32 and untied (vLLM's CPU refit
  leaves a tied model's packed `lm_head` stale).
- `build_qwen3_tiny_model(cfg, out_dir)` writes a model folder: `config.json` (`qwen3`),
  `generation_config.json` (eos `<|im_end|>` and `<|endoftext|>`, pad `<|endoftext|>`),
  `model.safetensors` (seeded random init: this slice does no warm start), the Qwen3 family
  tokenizer with `examples.families.qwen3_template`'s chat template, and `build_info.json`.
  Equal configs give byte-identical weights on the same software stack.
- `ensure_qwen3_tiny_model(cfg, cache_root)` returns `<cache_root>/families/qwen3-tiny/<key>`,
  building it when missing; the key covers the config, the tokenizer's own cache key, this module
  and the torch / transformers versions. Builds are renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import transformers
from pydantic import BaseModel, ConfigDict, Field
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from examples.arith.tiny_model.build import default_cache_root, sha256_file
from examples.families import vocab
from examples.families.cache import BUILD_INFO_FILE, FamilyBuildError, check_empty, ensure_built
from examples.families.vocab import QWEN3, load_family_tokenizer

WEIGHTS_FILE = "model.safetensors"
QWEN3_PADDED_VOCAB = 151936


class Qwen3TinyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 1234
    vocab_size: int = Field(default=QWEN3_PADDED_VOCAB, ge=151669)
    hidden_size: int = Field(default=128, ge=8)
    num_layers: int = Field(default=2, ge=1)
    num_heads: int = Field(default=2, ge=1)
    num_kv_heads: int = Field(default=1, ge=1)
    head_dim: int = Field(default=64, ge=8)  # a size vLLM's CPU attention serves
    intermediate_size: int = Field(default=256, ge=8)
    max_position_embeddings: int = Field(default=4096, ge=256)
    rope_theta: float = 1_000_000.0
    init_std: float = 0.02


def qwen3_config(cfg: Qwen3TinyConfig, eos_token_id: int, pad_token_id: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
        attn_implementation="sdpa",
    )


def cache_key(cfg: Qwen3TinyConfig) -> str:
    """sha256 over the config, the tokenizer's cache key, this module and the library versions."""
    payload = {
        "config": cfg.model_dump(mode="json"),
        "tokenizer": vocab.cache_key(QWEN3),
        "source": sha256_file(Path(__file__)),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_qwen3_tiny_model(cfg: Qwen3TinyConfig, out_dir: Path | str, cache_root: Path | str | None = None) -> Path:
    return _build(cfg, Path(out_dir), cache_key(cfg), cache_root)


def _build(cfg: Qwen3TinyConfig, out_dir: Path, key: str, cache_root: Path | str | None) -> Path:
    check_empty(out_dir)
    tokenizer = load_family_tokenizer(QWEN3, cache_root)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(qwen3_config(cfg, eos_ids[0], tokenizer.pad_token_id)).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / WEIGHTS_FILE).is_file():
        raise FamilyBuildError(f"save_pretrained wrote no {WEIGHTS_FILE} in {str(out_dir)!r}")
    info = {
        "config": cfg.model_dump(mode="json"),
        "cache_key": key,
        "tokenizer_cache_key": vocab.cache_key(QWEN3),
        "weights_sha256": sha256_file(out_dir / WEIGHTS_FILE),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out_dir


def ensure_qwen3_tiny_model(cfg: Qwen3TinyConfig, cache_root: Path | str | None = None) -> Path:
    key = cache_key(cfg)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    folder = root / "families" / "qwen3-tiny" / key[:24]
    return ensure_built(folder, key, lambda staging: _build(cfg, staging, key, cache_root))
