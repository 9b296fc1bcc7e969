"""The tiny model's chained-task variant: the default tiny model fine-tuned on chained transcripts.

Contract:
- `chain_conversation(chain)` is the intended transcript of the chained task (`examples.arith.chain`):
  system, user prompt, then per call an assistant calculator call with `chain.expressions()[i]`
  and the tool turn `chain_tool_output(...)`, then `final_answer_text(answer)`.
- The build starts from the default build of the same config (`build.ensure_tiny_model`, cached
  and reused, never changed), keeps its tokenizer and template, and runs `sft.train_sft` for
  `FINE_TUNE_STEPS` at `FINE_TUNE_LR` on `cfg.sft_examples` `CORPUS_SPEC` chains drawn from `cfg.seed`.
- `ensure_chain_tiny_model(cfg, cache_root)` caches it under `<cache_root>/tiny_model/chain-<key>`
  (staged, then renamed into place), keyed by the default key (config, builder sources, versions)
  plus this module, the chained task's source and the fine-tune settings; `build_info.json` also
  records `corpus`, `base_model` and `fine_tune`.
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

from examples.arith import chain as arith_chain
from examples.arith.task import TOOL_NAME, final_answer_text
from examples.arith.tiny_model import build
from examples.arith.tiny_model.chat_template import FAMILIES
from examples.arith.tiny_model.config import TinyModelConfig, config_digest
from examples.arith.tiny_model.corpus import TASK_TOOLS, tool_call_arguments
from examples.arith.tiny_model.encoding import encode_transcripts
from examples.arith.tiny_model.sft import deterministic_torch, train_sft

CORPUS_NAME = "arith_chain"
# Fewer long chains than uniform (SFT pads a batch to its longest transcript), more than the task's 0.75.
CORPUS_SPEC = arith_chain.ChainSpec(min_calls=1, max_calls=12, decay=0.85)
FINE_TUNE_STEPS = 80
FINE_TUNE_LR = 5e-4
FOLDER_PREFIX = "chain-"


def chain_conversation(chain: arith_chain.Chain) -> list[dict]:
    messages: list[dict] = [
        {"role": "system", "content": arith_chain.CHAIN_SYSTEM_PROMPT},
        {"role": "user", "content": arith_chain.chain_prompt(chain)},
    ]
    for i, expression in enumerate(chain.expressions()):
        call_id = f"call_{i}"
        function = {"name": TOOL_NAME, "arguments": tool_call_arguments(expression)}
        messages.append(
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": function}]}
        )
        text, _ = arith_chain.chain_tool_output(expression, chain, i)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    messages.append({"role": "assistant", "content": final_answer_text(chain.answer)})
    return messages


def chain_cache_key(cfg: TinyModelConfig) -> str:
    sources = [Path(arith_chain.__file__), Path(__file__)]
    payload = {
        "default_key": build.cache_key(cfg),
        "corpus": CORPUS_NAME,
        "corpus_spec": [CORPUS_SPEC.min_calls, CORPUS_SPEC.max_calls, CORPUS_SPEC.decay],
        "fine_tune": [FINE_TUNE_STEPS, FINE_TUNE_LR],
        "sources": {p.name: build.sha256_file(p) for p in sources},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def chain_cache_folder(cfg: TinyModelConfig, cache_root: Path | str | None = None) -> Path:
    root = Path(cache_root) if cache_root is not None else build.default_cache_root()
    return root / "tiny_model" / f"{FOLDER_PREFIX}{chain_cache_key(cfg)[:24]}"


def fine_tune_config(cfg: TinyModelConfig) -> TinyModelConfig:
    """`cfg` with the fine-tune's steps and learning rate (a copy of the base model's warm start otherwise)."""
    return cfg.model_copy(update={"sft_steps": FINE_TUNE_STEPS, "learning_rate": FINE_TUNE_LR})


def _build(
    cfg: TinyModelConfig, out_dir: Path, progress: Callable[[str], None], key: str, cache_root: Path | str | None
) -> Path:
    build._check_out_dir(out_dir)
    start = time.monotonic()
    base = build.ensure_tiny_model(cfg, cache_root, progress)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = Qwen2ForCausalLM.from_pretrained(base, dtype=torch.float32)
    chains = arith_chain.make_chains(cfg.seed, cfg.sft_examples, CORPUS_SPEC)
    family = FAMILIES[cfg.template_family]
    examples = encode_transcripts(tokenizer, [chain_conversation(c) for c in chains], TASK_TOOLS, family)
    progress(f"encoded {len(examples)} chained {family.name} transcripts in {time.monotonic() - start:.1f}s")
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
        "fine_tune": {"sft_steps": tune.sft_steps, "learning_rate": tune.learning_rate},
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


def ensure_chain_tiny_model(
    cfg: TinyModelConfig, cache_root: Path | str | None = None, progress: Callable[[str], None] = print
) -> Path:
    """The chained variant's cache folder, built on first use (staged, then renamed into place)."""
    key = chain_cache_key(cfg)
    folder = chain_cache_folder(cfg, cache_root)
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
