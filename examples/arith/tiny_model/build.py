"""Build the tiny local policy model into a folder, and a content-keyed cache of builds.

Contract:
- `build_tiny_model(cfg, out_dir, progress)` writes into an empty (or new) `out_dir`: the model
  (`config.json`, `generation_config.json`, `model.safetensors`), the tokenizer (with its chat
  template) and `build_info.json` (config, config digest, cache key, sha256 of the weights and
  of `tokenizer.json`, first/last SFT loss, library versions). Everything is built locally;
  nothing is downloaded. Equal configs give byte-identical weights and tokenizer files on the
  same software stack.
- `ensure_tiny_model(cfg, cache_root)` returns `<cache_root>/tiny_model/<key>` and builds it
  when missing. The key (`cache_key`) covers the config, the source files that shape the
  artefact (the task spec and this package's builder modules) and the Python / torch /
  transformers / tokenizers versions, so no edit to any of them ever reuses a stale build.
  Builds go to a temporary sibling folder that is renamed into place only when complete, so an
  interrupted build never leaves a half model under the final name. The cache root is
  `cache_root`, else env `NRL_CACHE_DIR`, else `<repo>/.cache`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import GenerationConfig
from transformers.utils.chat_template_utils import render_jinja_template

from examples.arith import task as arith_task
from examples.arith.tiny_model import chat_template, config, corpus, encoding, sft
from examples.arith.tiny_model import tokenizer as tokenizer_module
from examples.arith.tiny_model.chat_template import FAMILIES, TemplateFamily
from examples.arith.tiny_model.config import TinyModelConfig, config_digest
from examples.arith.tiny_model.corpus import TASK_TOOLS, english_text, task_conversation
from examples.arith.tiny_model.encoding import encode_transcripts
from examples.arith.tiny_model.sft import deterministic_torch, init_model, train_sft
from examples.arith.tiny_model.tokenizer import train_tokenizer

CACHE_ENV = "NRL_CACHE_DIR"
WEIGHTS_FILE = "model.safetensors"
BUILD_INFO_FILE = "build_info.json"
_REPO_ROOT = Path(__file__).resolve().parents[3]


class TinyModelBuildError(RuntimeError):
    """The tiny model could not be built or a cached build is not what it claims to be."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _library_versions() -> dict[str, str]:
    # Python's version too: the tokenizer corpus is standard-library docstrings.
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _source_files() -> list[Path]:
    modules = (arith_task, chat_template, config, corpus, encoding, sft, tokenizer_module)
    return [Path(m.__file__) for m in modules] + [Path(__file__)]


def cache_key(cfg: TinyModelConfig) -> str:
    """sha256 over the config, the builder's source files and the library versions."""
    payload = {
        "config_digest": config_digest(cfg),
        "sources": {p.name: sha256_file(p) for p in _source_files()},
        "versions": _library_versions(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _render_text(messages: list[dict], family: TemplateFamily) -> str:
    rendered, _ = render_jinja_template(conversations=[messages], tools=TASK_TOOLS, chat_template=family.chat_template)
    return rendered[0]


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise TinyModelBuildError(f"out_dir {str(out_dir)!r} is not empty; pass a new or empty folder")


def _write_config_json(out_dir: Path) -> None:
    # Older readers look for `torch_dtype`; transformers 5 writes only `dtype`. Both say float32.
    path = out_dir / "config.json"
    data = json.loads(path.read_text())
    data["torch_dtype"] = data["dtype"]
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_tiny_model(
    cfg: TinyModelConfig, out_dir: Path | str, progress: Callable[[str], None] = print
) -> Path:
    return _build(cfg, Path(out_dir), progress, cache_key(cfg))


def _build(cfg: TinyModelConfig, out_dir: Path, progress: Callable[[str], None], key: str) -> Path:
    # `key` is taken before any work, so build_info names the sources the build started from.
    _check_out_dir(out_dir)
    start = time.monotonic()
    family = FAMILIES[cfg.template_family]
    problems = arith_task.make_problems(cfg.seed, max(cfg.sft_examples, cfg.tokenizer_transcripts))
    texts = [_render_text(task_conversation(p), family) for p in problems[: cfg.tokenizer_transcripts]]
    tokenizer = train_tokenizer(
        texts + english_text(cfg.english_modules), cfg.vocab_size, cfg.max_position_embeddings, family
    )
    progress(f"tokenizer: {len(tokenizer)} tokens in {time.monotonic() - start:.1f}s")

    conversations = [task_conversation(p) for p in problems[: cfg.sft_examples]]
    examples = encode_transcripts(tokenizer, conversations, TASK_TOOLS, family)
    progress(f"encoded {len(examples)} {family.name} transcripts in {time.monotonic() - start:.1f}s")
    eos_id = tokenizer.convert_tokens_to_ids(family.eos_token)
    with deterministic_torch(cfg):
        model = init_model(cfg, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id)
        progress(f"model: {sum(p.numel() for p in model.parameters())} parameters; sft on {len(examples)} transcripts")
        sft_start = time.monotonic()
        losses = train_sft(model, examples, cfg, tokenizer.pad_token_id, progress)
    progress(f"sft: {cfg.sft_steps} steps in {time.monotonic() - sft_start:.1f}s")

    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _write_config_json(out_dir)
    weights = out_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise TinyModelBuildError(f"save_pretrained wrote no {WEIGHTS_FILE} in {str(out_dir)!r}")
    info = {
        "config": cfg.model_dump(mode="json"),
        "config_digest": config_digest(cfg),
        "cache_key": key,
        "weights_sha256": sha256_file(weights),
        "tokenizer_sha256": sha256_file(out_dir / "tokenizer.json"),
        "sft_first_loss": losses[0] if losses else None,
        "sft_last_loss": losses[-1] if losses else None,
        "versions": _library_versions(),
    }
    (out_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    progress(f"saved to {out_dir} in {time.monotonic() - start:.1f}s total")
    return out_dir


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else _REPO_ROOT / ".cache"


def read_build_info(folder: Path) -> dict:
    path = folder / BUILD_INFO_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TinyModelBuildError(
            f"cached tiny model {str(folder)!r} has no readable {BUILD_INFO_FILE}; delete the folder to rebuild"
        ) from e


def _check_cached(folder: Path, key: str) -> Path:
    info = read_build_info(folder)
    if info.get("cache_key") != key:
        raise TinyModelBuildError(
            f"cached tiny model {str(folder)!r} has cache_key {info.get('cache_key')!r}, "
            f"expected {key!r}; delete the folder to rebuild"
        )
    return folder


def _folder_for(key: str, cache_root: Path | str | None) -> Path:
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / "tiny_model" / key[:24]


def cache_folder(cfg: TinyModelConfig, cache_root: Path | str | None = None) -> Path:
    """Where `ensure_tiny_model` keeps the build of `cfg` (the folder may not exist yet)."""
    return _folder_for(cache_key(cfg), cache_root)


def ensure_tiny_model(
    cfg: TinyModelConfig, cache_root: Path | str | None = None, progress: Callable[[str], None] = print
) -> Path:
    key = cache_key(cfg)
    folder = _folder_for(key, cache_root)
    parent = folder.parent
    if folder.exists():
        return _check_cached(folder, key)
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".building-{folder.name}-", dir=parent))
    try:
        _build(cfg, staging, progress, key)
        try:
            staging.rename(folder)
        except OSError:
            if not folder.exists():
                raise
            # Another process finished the same build first; its folder is equally valid.
            return _check_cached(folder, key)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return folder
