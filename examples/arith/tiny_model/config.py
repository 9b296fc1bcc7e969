"""Configuration of the tiny local policy model; the only home of its defaults.

Contract:
- `TinyModelConfig` fully determines the built artefact (tokenizer, chat template, weights):
  two builds from equal configs on the same software stack produce byte-identical files.
- `config_digest(cfg)` is a stable hex digest of the config fields (the build cache combines it
  with a digest of the builder's sources and library versions, see `build.cache_key`).
- `template_family` picks the chat-template family (`chatml`: `<|im_start|>`/`<|im_end|>` turns,
  hermes `<tool_call>` blocks; `llama3`: header turns ending `<|eot_id|>`, JSON tool calls): it
  changes the special tokens, the template and so the rendered SFT corpus, and (as a config
  field) the cache key.
- There is deliberately no `tie_word_embeddings` knob: the model is always untied, because
  vLLM's CPU backend keeps a packed copy of `lm_head` that a refit of a tied model leaves stale.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field, model_validator

from examples.arith.tiny_model.chat_template import TemplateFamilyName

# Local English text for the tokenizer: docstrings parsed from the source files of these
# pure-Python standard-library modules (about 0.45 MB, enough to fill a 4096-token vocabulary).
DEFAULT_ENGLISH_MODULES: tuple[str, ...] = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "doctest", "email.message", "enum", "filecmp", "fnmatch", "fractions", "functools", "getopt",
    "gettext", "glob", "graphlib", "hashlib", "heapq", "html", "http.client", "inspect",
    "ipaddress", "json", "locale", "logging", "mailbox", "mimetypes", "numbers", "operator",
    "optparse", "pathlib", "pickle", "pprint", "pydoc", "queue", "random", "re", "reprlib", "sched",
    "secrets", "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket",
    "statistics", "string", "struct", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "traceback", "types", "typing", "unittest", "urllib.parse", "uuid",
    "warnings", "weakref", "zipfile",
)


class TinyModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 1234
    template_family: TemplateFamilyName = "chatml"

    # Tokenizer.
    vocab_size: int = Field(default=4096, ge=512)
    tokenizer_transcripts: int = Field(default=2000, ge=1)
    english_modules: tuple[str, ...] = DEFAULT_ENGLISH_MODULES

    # Architecture (Qwen2ForCausalLM, float32).
    hidden_size: int = Field(default=256, ge=8)
    num_layers: int = Field(default=4, ge=1)
    num_heads: int = Field(default=4, ge=1)
    num_kv_heads: int = Field(default=2, ge=1)
    intermediate_size: int = Field(default=704, ge=8)
    # 8192 covers Gym's example_multi_step prompts (~4.6k tokens): one tiny model (one build, one
    # cache entry) serves every CPU recipe; generation.vllm.max_model_len bounds what is served.
    max_position_embeddings: int = Field(default=8192, ge=256)
    rope_theta: float = 10000.0
    init_std: float = Field(default=0.02, gt=0.0)

    # Supervised warm start on synthetic task transcripts.
    sft_examples: int = Field(default=2048, ge=1)
    sft_steps: int = Field(default=300, ge=0)
    sft_batch_size: int = Field(default=8, ge=1)
    # Above ~2e-3 attention saturates onto fixed prompt tokens and the copy never forms.
    learning_rate: float = Field(default=1e-3, gt=0.0)
    warmup_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    grad_clip: float = Field(default=1.0, gt=0.0)
    num_threads: int = Field(default=2, ge=1)
    log_every: int = Field(default=50, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "pick num_heads dividing hidden_size"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}; "
                "pick num_kv_heads dividing num_heads"
            )
        return self


def config_digest(cfg: TinyModelConfig) -> str:
    """Stable sha256 over the config fields."""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()
