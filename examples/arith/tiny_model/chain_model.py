"""The tiny model's chained-task variant: the default tiny model fine-tuned on chained transcripts.

Contract:
- `chain_conversation(chain)` is the intended transcript of the chained task (`examples.arith.chain`):
  system, user prompt, then per call an assistant calculator call with `chain.expressions()[i]`
  and the tool turn `chain_tool_output(...)`, then `final_answer_text(answer)`.
- `ensure_chain_tiny_model(cfg, cache_root)` is `tiny_model.variant`'s build and cache (folder
  `<cache_root>/tiny_model/chain-<key>`): the default build fine-tuned for `FINE_TUNE_STEPS` at
  `FINE_TUNE_LR` on `cfg.sft_examples` `CORPUS_SPEC` chains drawn from `cfg.seed`, keyed also by
  this module, the chained task's source and `CORPUS_SPEC`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from examples.arith import chain as arith_chain
from examples.arith.task import TOOL_NAME, final_answer_text
from examples.arith.tiny_model.config import TinyModelConfig
from examples.arith.tiny_model.corpus import TASK_TOOLS, tool_call_arguments
from examples.arith.tiny_model.variant import Variant, ensure_variant, variant_folder, variant_key

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


def variant() -> Variant:
    """This variant as `tiny_model.variant` builds it (read at call time: tests shorten the fine-tune)."""
    return Variant(
        corpus=CORPUS_NAME, folder_prefix=FOLDER_PREFIX, sft_steps=FINE_TUNE_STEPS, learning_rate=FINE_TUNE_LR,
        tools=TASK_TOOLS, sources=(Path(arith_chain.__file__), Path(__file__)),
        key_extra={"corpus_spec": [CORPUS_SPEC.min_calls, CORPUS_SPEC.max_calls, CORPUS_SPEC.decay]},
    )


def chain_conversations(cfg: TinyModelConfig) -> list[list[dict]]:
    return [chain_conversation(c) for c in arith_chain.make_chains(cfg.seed, cfg.sft_examples, CORPUS_SPEC)]


def chain_cache_key(cfg: TinyModelConfig) -> str:
    return variant_key(variant(), cfg)


def chain_cache_folder(cfg: TinyModelConfig, cache_root: Path | str | None = None) -> Path:
    return variant_folder(variant(), cfg, cache_root)


def ensure_chain_tiny_model(
    cfg: TinyModelConfig, cache_root: Path | str | None = None, progress: Callable[[str], None] = print
) -> Path:
    """The chained variant's cache folder, built on first use."""
    return ensure_variant(variant(), cfg, chain_conversations, cache_root, progress)
