"""Byte-level BPE tokenizer for the tiny model, trained locally with `tokenizers`.

Contract:
- `train_tokenizer(texts, vocab_size, max_length, family)` is deterministic for equal inputs and
  returns a `Qwen2Tokenizer` (a `PreTrainedTokenizerFast`) with the family's eos, pad, special and
  tool tokens and chat template, and no bos (default family ChatML: eos `<|im_end|>`, pad
  `<|endoftext|>`).
- BPE merges are trained with `tokenizers` under Qwen2's pipeline (NFC normalizer, Qwen2's split,
  byte-level), then the tokenizer is built as `Qwen2Tokenizer(vocab, merges)`: `AutoTokenizer`
  (and so vLLM) loads a `qwen2` model folder through that class, so the tokenizer in memory,
  on disk and as loaded are the same pipeline.
- Byte-level after NFC: every NFC-normalized string encodes and decodes back exactly.
- Qwen2's split puts every digit in its own pre-token, so a number is the same digit tokens in
  the question, the tool call, the tool result and the answer (copying is token-exact).
- The family's special tokens (ChatML: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`) are
  special; its tool tokens (ChatML: `<tool_call>`, `</tool_call>`, `<tool_response>`,
  `</tool_response>`) are added non-special tokens (kept by `skip_special_tokens=True`, as the
  hermes tool parser needs). Each encodes as one id.
- The total vocabulary never exceeds `vocab_size`.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT_PATTERN

from examples.arith.tiny_model.chat_template import CHATML, TemplateFamily


class TokenizerBuildError(RuntimeError):
    """The trained tokenizer does not meet its contract."""


def _strip_added_tokens(text: str, family: TemplateFamily) -> str:
    # Added tokens get fixed ids; keep their pieces out of the merge statistics.
    for token in family.special_tokens + family.tool_tokens:
        text = text.replace(token, "\n")
    return text


def _train_bpe(texts: list[str], vocab_size: int, family: TemplateFamily) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(family.tool_tokens),
        min_frequency=2,
        special_tokens=list(family.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_strip_added_tokens(t, family) for t in texts], trainer=trainer)
    return tok


def train_tokenizer(
    texts: list[str], vocab_size: int, max_length: int, family: TemplateFamily = CHATML
) -> Qwen2Tokenizer:
    trained = json.loads(_train_bpe(texts, vocab_size, family).to_str())["model"]
    # Rebuild through Qwen2Tokenizer so the in-memory pipeline is the one every loader rebuilds.
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        chat_template=family.chat_template,
    )
    specials = [AddedToken(t, special=True, normalized=False) for t in family.special_tokens]
    tokenizer.add_tokens(specials, special_tokens=True)
    if family.tool_tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.tool_tokens])
    _check(tokenizer, vocab_size, family)
    return tokenizer


def _check(tokenizer: PreTrainedTokenizerFast, vocab_size: int, family: TemplateFamily) -> None:
    if len(tokenizer) > vocab_size:
        raise TokenizerBuildError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    for token in family.special_tokens + family.tool_tokens:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise TokenizerBuildError(f"added token {token!r} encodes as {ids}, expected a single id")
