"""How an example recipe asks for the tiny model: `model.path: null` and an optional `model.tiny:`.

Contract:
- The library's recipe schema (`nemo_rl.algorithms.grpo_config.MasterConfig`) knows no tiny
  model: `model.path` is a local HF model folder, and a run refuses a null one. The example entry
  points load recipes with `load_recipe(path, overrides)`: the same `defaults:` chain and
  Hydra-style overrides, plus the example's own `model.tiny:` block (`TinyModelConfig`; every key
  optional, and `model.tiny.<key>=...` overrides need no `+`). The block is validated as
  `model.tiny` (errors name the key, the value and the fix), taken out, and the rest is
  validated by the library's `validate_master`.
- `resolve_model(recipe, progress)` is the library config ready to run: `model.path` as the
  recipe states it, or for a null path the tiny model built from `model.tiny` into the
  content-keyed cache on first use (`ensure_tiny_model`), its folder set as `model.path`.
  With a path set, `model.tiny` is not used (the recipe trains that folder's model).
- `model.tiny_corpus` picks the warm-start corpus of that build: `arith` (default, the one-call
  task, `ensure_tiny_model`) or `arith_chain` (chained transcripts for `CHAINED_TASK`,
  `tiny_model.chain_model.ensure_chain_tiny_model`, its own cache folder) or `gym_session_counter`
  (Gym's `example_session_state_mgmt` tools, `examples.gym_tools.warm_start`, its own cache folder).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from examples.arith.tiny_model import TinyModelConfig, ensure_tiny_model
from examples.arith.tiny_model.chain_model import CORPUS_NAME as CHAIN_CORPUS
from examples.arith.tiny_model.chain_model import ensure_chain_tiny_model
from examples.gym_tools.warm_start import CORPUS_NAME as COUNTER_CORPUS
from examples.gym_tools.warm_start import ensure_counter_tiny_model
from nemo_rl.algorithms.grpo_config import MasterConfig, ModelConfig, validate_master
from nemo_rl.utils.config import load_config, validate_section

TINY_KEY = "tiny"
TINY_SECTION = f"model.{TINY_KEY}"
CORPUS_KEY = "tiny_corpus"
DEFAULT_CORPUS = "arith"
TinyCorpus = Literal["arith", "arith_chain", "gym_session_counter"]


class ExampleModelConfig(ModelConfig):
    """The library's `model:` section plus the example's `tiny:` block (declares override keys)."""

    tiny: TinyModelConfig = TinyModelConfig()
    tiny_corpus: TinyCorpus = DEFAULT_CORPUS


class ExampleRecipeSchema(MasterConfig):
    """The recipe keys an example entry point accepts (used to check overrides, not to validate)."""

    model: ExampleModelConfig


class _CorpusChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tiny_corpus: TinyCorpus = DEFAULT_CORPUS


@dataclass(frozen=True)
class ExampleRecipe:
    config: MasterConfig  # validated by the library; model.path as the recipe states it
    tiny: TinyModelConfig  # the recipe's model.tiny block (defaults when absent)
    tiny_corpus: TinyCorpus = DEFAULT_CORPUS  # model.tiny_corpus: the warm start's transcripts


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> ExampleRecipe:
    """The recipe at `path` with `overrides`, split into the library config and `model.tiny`."""
    raw = load_config(path, list(overrides), schema=ExampleRecipeSchema)
    model = raw.get("model")
    tiny_block = model.pop(TINY_KEY, None) if isinstance(model, dict) else None
    corpus_block = {CORPUS_KEY: model.pop(CORPUS_KEY)} if isinstance(model, dict) and CORPUS_KEY in model else {}
    corpus = validate_section(_CorpusChoice, corpus_block, "model").tiny_corpus
    tiny = validate_section(TinyModelConfig, tiny_block or {}, TINY_SECTION)
    return ExampleRecipe(config=validate_master(raw), tiny=tiny, tiny_corpus=corpus)


def resolve_model(recipe: ExampleRecipe, progress: Callable[[str], None] = print) -> MasterConfig:
    """The library config with `model.path` set (the tiny model built on first use for a null path)."""
    cfg = recipe.config
    if cfg.model.path is not None:
        return cfg
    if recipe.tiny_corpus == CHAIN_CORPUS:
        folder = ensure_chain_tiny_model(recipe.tiny, progress=progress)
    elif recipe.tiny_corpus == COUNTER_CORPUS:
        folder = ensure_counter_tiny_model(recipe.tiny, progress=progress)
    else:
        folder = ensure_tiny_model(recipe.tiny, progress=progress)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(folder)})})


def load_and_resolve(
    path: str | Path, overrides: Sequence[str] = (), progress: Callable[[str], None] = print
) -> MasterConfig:
    """`resolve_model(load_recipe(path, overrides))`: what an example entry point runs."""
    return resolve_model(load_recipe(path, overrides), progress)
