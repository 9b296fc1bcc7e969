"""The tiny model warm-started on Gym's `example_session_state_mgmt` tool schema (a deliberately short SFT).

Contract:
- `ensure_counter_tiny_model(cfg, cache_root)` is `tiny_model.variant`'s build and cache (folder
  `<cache_root>/tiny_model/gymcounter-<key>`): the default tiny model fine-tuned for
  `FINE_TUNE_STEPS` at `FINE_TUNE_LR` (batch `cfg.sft_batch_size`) on `FINE_TUNE_EXAMPLES`
  synthetic transcripts (`session_counter.counter_conversation`, problems from `cfg.seed`) rendered
  with the environment's own tools, keyed also by this package's sources and those tools.
- It is a warm start on transcripts, never on the env's reward: short on purpose, so the policy
  calls the tools but still miscopies numbers and RL has room.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from examples.arith.tiny_model.config import TinyModelConfig
from examples.arith.tiny_model.variant import Variant, ensure_variant, variant_folder, variant_key
from examples.gym_tools import session_counter

CORPUS_NAME = "gym_session_counter"
FINE_TUNE_EXAMPLES = 512
FINE_TUNE_STEPS = 100
FINE_TUNE_LR = 1e-3
FOLDER_PREFIX = "gymcounter-"


def variant() -> Variant:
    """This warm start as `tiny_model.variant` builds it (read at call time: tests change the fine-tune)."""
    return Variant(
        corpus=CORPUS_NAME, folder_prefix=FOLDER_PREFIX, sft_steps=FINE_TUNE_STEPS, learning_rate=FINE_TUNE_LR,
        tools=session_counter.env_tools(), sources=(Path(session_counter.__file__), Path(__file__)),
        fine_tune_info={"examples": FINE_TUNE_EXAMPLES},
    )


def counter_conversations(cfg: TinyModelConfig) -> list[list[dict]]:
    problems = session_counter.make_problems(cfg.seed, FINE_TUNE_EXAMPLES)
    return [session_counter.counter_conversation(p) for p in problems]


def counter_cache_key(cfg: TinyModelConfig) -> str:
    return variant_key(variant(), cfg)


def counter_cache_folder(cfg: TinyModelConfig, cache_root: Path | str | None = None) -> Path:
    return variant_folder(variant(), cfg, cache_root)


def ensure_counter_tiny_model(
    cfg: TinyModelConfig, cache_root: Path | str | None = None, progress: Callable[[str], None] = print
) -> Path:
    """The warm-started model's cache folder, built on first use."""
    return ensure_variant(variant(), cfg, counter_conversations, cache_root, progress)
