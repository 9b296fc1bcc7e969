"""A fine-tuned variant of the tiny model: the default build of the same config, SFT'd on a corpus
of transcripts, cached in a folder of its own.

Contract:
- `Variant` names the corpus, the cache folder's prefix, the fine-tune (steps, learning rate and
  any other setting in `fine_tune_info`), the tools the transcripts render with, and what else the
  cache key covers (`key_extra`, the `sources` whose bytes it hashes).
- `variant_key(v, cfg)` is the default build's key (`build.cache_key`) plus all of the above, so a
  change of corpus, tools, sources or fine-tune rebuilds; `variant_folder` is
  `<cache_root>/tiny_model/<prefix><key[:24]>`.
- `ensure_variant(v, cfg, conversations, cache_root, progress)` returns the folder, building it on
  first use from the cached default build (never changed; its tokenizer and template are kept):
  staged, then renamed into place; a folder another builder published first is checked and reused.
  `build_info.json` records `corpus`, `base_model`, `fine_tune` and the first/last SFT loss.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from examples.arith.tiny_model import build
from examples.arith.tiny_model.chat_template import FAMILIES
from examples.arith.tiny_model.config import TinyModelConfig, config_digest
from examples.arith.tiny_model.encoding import encode_transcripts
from examples.arith.tiny_model.sft import deterministic_torch, train_sft

Conversations = Callable[[TinyModelConfig], list[list[dict]]]


@dataclass(frozen=True)
class Variant:
    corpus: str
    folder_prefix: str
    sft_steps: int
    learning_rate: float
    tools: list[dict]
    sources: tuple[Path, ...]
    key_extra: Mapping[str, Any] = field(default_factory=dict)
    fine_tune_info: Mapping[str, Any] = field(default_factory=dict)

    def fine_tune(self) -> dict[str, Any]:
        return {**self.fine_tune_info, "sft_steps": self.sft_steps, "learning_rate": self.learning_rate}


def variant_key(v: Variant, cfg: TinyModelConfig) -> str:
    payload = {
        "default_key": build.cache_key(cfg),
        "corpus": v.corpus,
        "tools": v.tools,
        "fine_tune": v.fine_tune(),
        "extra": dict(v.key_extra),
        "sources": {p.name: build.sha256_file(p) for p in v.sources},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def variant_folder(v: Variant, cfg: TinyModelConfig, cache_root: Path | str | None = None) -> Path:
    root = Path(cache_root) if cache_root is not None else build.default_cache_root()
    return root / "tiny_model" / f"{v.folder_prefix}{variant_key(v, cfg)[:24]}"


def _build(v: Variant, cfg: TinyModelConfig, conversations: Conversations, out_dir: Path,
           progress: Callable[[str], None], key: str, cache_root: Path | str | None) -> Path:
    build._check_out_dir(out_dir)
    start = time.monotonic()
    base = build.ensure_tiny_model(cfg, cache_root, progress)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32)
    family = FAMILIES[cfg.template_family]
    examples = encode_transcripts(tokenizer, conversations(cfg), v.tools, family)
    progress(f"encoded {len(examples)} {v.corpus} {family.name} transcripts in {time.monotonic() - start:.1f}s")
    tune = cfg.model_copy(update={"sft_steps": v.sft_steps, "learning_rate": v.learning_rate})
    with deterministic_torch(tune):
        losses = train_sft(model, examples, tune, tokenizer.pad_token_id, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    build._write_config_json(out_dir)
    weights = out_dir / build.WEIGHTS_FILE
    if not weights.is_file():
        raise build.TinyModelBuildError(f"save_pretrained wrote no {build.WEIGHTS_FILE} in {str(out_dir)!r}")
    info = {
        "config": cfg.model_dump(mode="json"),
        "config_digest": config_digest(cfg),
        "corpus": v.corpus,
        "base_model": str(base),
        "fine_tune": v.fine_tune(),
        "cache_key": key,
        "weights_sha256": build.sha256_file(weights),
        "tokenizer_sha256": build.sha256_file(out_dir / "tokenizer.json"),
        "sft_first_loss": losses[0] if losses else None,
        "sft_last_loss": losses[-1] if losses else None,
        "versions": build._library_versions(),
    }
    (out_dir / build.BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    progress(f"saved to {out_dir} in {time.monotonic() - start:.1f}s total")
    return out_dir


def ensure_variant(v: Variant, cfg: TinyModelConfig, conversations: Conversations,
                   cache_root: Path | str | None = None, progress: Callable[[str], None] = print) -> Path:
    key = variant_key(v, cfg)
    folder = variant_folder(v, cfg, cache_root)
    if folder.exists():
        return build._check_cached(folder, key)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".building-{folder.name}-", dir=folder.parent))
    try:
        _build(v, cfg, conversations, staging, progress, key, cache_root)
        try:
            staging.rename(folder)
        except OSError:
            if not folder.exists():
                raise
            return build._check_cached(folder, key)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return folder
