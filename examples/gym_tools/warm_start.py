"""The tiny model warm-started on Gym's `example_session_state_mgmt` tool schema (a deliberately short SFT).

Contract:
- The build starts from the default tiny model of the same config (`build.ensure_tiny_model`,
  cached and reused, never changed), keeps its tokenizer and template, and runs `sft.train_sft`
  for `FINE_TUNE_STEPS` at `FINE_TUNE_LR` (batch `cfg.sft_batch_size`) on `FINE_TUNE_EXAMPLES`
  synthetic transcripts (`session_counter.counter_conversation`, problems from `cfg.seed`) rendered
  with the environment's own tools. It is a warm start on transcripts, never on the env's reward:
  short on purpose, so the policy calls the tools but still miscopies numbers and RL has room.
- `ensure_counter_tiny_model(cfg, cache_root)` caches it under `<cache_root>/tiny_model/gymcounter-<key>`
  (staged, then renamed into place), keyed by the default key plus this package's sources, the
  environment's tools and the fine-tune settings, so a change of corpus or recipe rebuilds.
  `build_info.json` records `corpus`, `base_model`, `fine_tune` and the first/last SFT loss.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from examples.arith.tiny_model import build
from examples.arith.tiny_model.chat_template import FAMILIES
from examples.arith.tiny_model.config import TinyModelConfig, config_digest
from examples.arith.tiny_model.encoding import encode_transcripts
from examples.arith.tiny_model.sft import deterministic_torch, train_sft
from examples.gym_tools import session_counter

CORPUS_NAME = "gym_session_counter"
FINE_TUNE_EXAMPLES = 512
FINE_TUNE_STEPS = 100
FINE_TUNE_LR = 1e-3
FOLDER_PREFIX = "gymcounter-"


def counter_cache_key(cfg: TinyModelConfig) -> str:
    payload = {
        "default_key": build.cache_key(cfg),
        "corpus": CORPUS_NAME,
        "tools": session_counter.env_tools(),
        "fine_tune": [FINE_TUNE_EXAMPLES, FINE_TUNE_STEPS, FINE_TUNE_LR],
        "sources": {p.name: build.sha256_file(p) for p in (Path(session_counter.__file__), Path(__file__))},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def counter_cache_folder(cfg: TinyModelConfig, cache_root: Path | str | None = None) -> Path:
    root = Path(cache_root) if cache_root is not None else build.default_cache_root()
    return root / "tiny_model" / f"{FOLDER_PREFIX}{counter_cache_key(cfg)[:24]}"


def fine_tune_config(cfg: TinyModelConfig) -> TinyModelConfig:
    return cfg.model_copy(update={"sft_steps": FINE_TUNE_STEPS, "learning_rate": FINE_TUNE_LR})


def _build(
    cfg: TinyModelConfig, out_dir: Path, progress: Callable[[str], None], key: str, cache_root: Path | str | None
) -> Path:
    build._check_out_dir(out_dir)
    start = time.monotonic()
    base = build.ensure_tiny_model(cfg, cache_root, progress)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32)
    problems = session_counter.make_problems(cfg.seed, FINE_TUNE_EXAMPLES)
    conversations = [session_counter.counter_conversation(p) for p in problems]
    family = FAMILIES[cfg.template_family]
    examples = encode_transcripts(tokenizer, conversations, session_counter.env_tools(), family)
    progress(f"encoded {len(examples)} {CORPUS_NAME} transcripts in {time.monotonic() - start:.1f}s")
    tune = fine_tune_config(cfg)
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
        "corpus": CORPUS_NAME,
        "base_model": str(base),
        "fine_tune": {"examples": FINE_TUNE_EXAMPLES, "sft_steps": tune.sft_steps, "learning_rate": tune.learning_rate},
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


def ensure_counter_tiny_model(
    cfg: TinyModelConfig, cache_root: Path | str | None = None, progress: Callable[[str], None] = print
) -> Path:
    """The warm-started model's cache folder, built on first use (staged, then renamed into place)."""
    key = counter_cache_key(cfg)
    folder = counter_cache_folder(cfg, cache_root)
    if folder.exists():
        return build._check_cached(folder, key)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".building-{folder.name}-", dir=folder.parent))
    try:
        _build(cfg, staging, progress, key, cache_root)
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
