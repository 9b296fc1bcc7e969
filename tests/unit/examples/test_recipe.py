"""The example's `model.tiny` block: read by the example loader, unknown to the library's schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.arith import recipe as example_recipe
from examples.arith.recipe import load_recipe, resolve_model
from examples.arith.tiny_model import TinyModelConfig
from nemo_rl.algorithms.grpo_config import load_master_config, model_path
from nemo_rl.utils.config import ConfigError

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
TINY = CONFIGS / "grpo_capture_tiny_cpu.yaml"
LLAMA = CONFIGS / "grpo_capture_tiny_llama_cpu.yaml"


def test_the_tiny_block_is_split_from_the_library_config() -> None:
    plain = load_recipe(TINY)
    assert plain.tiny == TinyModelConfig() and plain.config.model.path is None
    llama = load_recipe(LLAMA)
    assert llama.tiny.template_family == "llama3"
    assert llama.config == load_master_config(
        TINY, ["logger.log_dir=logs/grpo_capture_tiny_llama_cpu", "generation.tool_call_parser=llama3_json"])


def test_tiny_overrides_need_no_plus_and_bad_values_name_the_key() -> None:
    assert load_recipe(TINY, ["model.tiny.sft_steps=5"]).tiny.sft_steps == 5
    with pytest.raises(ConfigError, match=r"model\.tiny\.vocab_size=10: .*>= 512"):
        load_recipe(TINY, ["model.tiny.vocab_size=10"])
    with pytest.raises(ConfigError, match=r"unknown key model\.tiny\.no_such"):
        load_recipe(TINY, ["+model.tiny.no_such=1"])


def test_the_library_schema_has_no_tiny_model() -> None:
    with pytest.raises(ConfigError, match=r"unknown key model\.tiny"):
        load_master_config(LLAMA)
    with pytest.raises(ConfigError, match=r"cannot override model\.tiny\.sft_steps"):
        load_master_config(TINY, ["model.tiny.sft_steps=5"])


def test_a_null_path_gets_the_tiny_model_and_a_set_path_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[TinyModelConfig] = []

    def fake_ensure(cfg: TinyModelConfig, progress=print) -> Path:
        built.append(cfg)
        return Path("/cache/tiny_model/abc")

    monkeypatch.setattr(example_recipe, "ensure_tiny_model", fake_ensure)
    cfg = resolve_model(load_recipe(LLAMA), progress=lambda _: None)
    assert cfg.model.path == "/cache/tiny_model/abc" and built == [load_recipe(LLAMA).tiny]
    assert model_path(cfg.model) == Path("/cache/tiny_model/abc")
    own = resolve_model(load_recipe(TINY, ["model.path=/models/mine"]))
    assert own.model.path == "/models/mine" and len(built) == 1


def test_a_run_refuses_a_null_model_path() -> None:
    with pytest.raises(ConfigError, match=r"model\.path is null: a run needs a local HF model folder"):
        model_path(load_recipe(TINY).config.model)


def test_the_tiny_corpus_picks_the_chained_build(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[str, TinyModelConfig]] = []
    monkeypatch.setattr(example_recipe, "ensure_tiny_model", lambda cfg, progress=print: built.append(("arith", cfg)) or Path("/c/a"))
    monkeypatch.setattr(
        example_recipe, "ensure_chain_tiny_model", lambda cfg, progress=print: built.append(("chain", cfg)) or Path("/c/b"))
    monkeypatch.setattr(
        example_recipe, "ensure_counter_tiny_model", lambda cfg, progress=print: built.append(("counter", cfg)) or Path("/c/c"))
    assert load_recipe(TINY).tiny_corpus == "arith"
    assert resolve_model(load_recipe(TINY), progress=lambda _: None).model.path == "/c/a"
    chained = load_recipe(TINY, ["model.tiny_corpus=arith_chain", "model.tiny.sft_steps=5"])
    assert resolve_model(chained, progress=lambda _: None).model.path == "/c/b"
    counter = load_recipe(TINY, ["model.tiny_corpus=gym_session_counter"])
    assert resolve_model(counter, progress=lambda _: None).model.path == "/c/c"
    assert built == [("arith", TinyModelConfig()), ("chain", TinyModelConfig(sft_steps=5)), ("counter", TinyModelConfig())]
    with pytest.raises(ConfigError, match=r"model\.tiny_corpus='chains': Input should be 'arith', 'arith_chain' or 'gym_session_counter'"):
        load_recipe(TINY, ["model.tiny_corpus=chains"])
    with pytest.raises(ConfigError, match=r"unknown key model\.tiny_corpus"):
        load_master_config(TINY, ["+model.tiny_corpus=arith_chain"])
