"""Byte-level BPE tokenizer for the tiny model, trained locally with `tokenizers`.

Contract:
- `train_tokenizer(texts, vocab_size, max_length)` is deterministic for equal inputs and returns
  a `Qwen2Tokenizer` (a `PreTrainedTokenizerFast`) with eos `<|im_end|>`, pad `<|endoftext|>`,
  no bos and the ChatML chat template.
- BPE merges are trained with `tokenizers` under Qwen2's pipeline (NFC normalizer, Qwen2's split,
  byte-level), then the tokenizer is built as `Qwen2Tokenizer(vocab, merges)`: `AutoTokenizer`
  (and so vLLM) loads a `qwen2` model folder through that class, so the tokenizer in memory,
  on disk and as loaded are the same pipeline.
- Byte-level after NFC: every NFC-normalized string encodes and decodes back exactly.
- Qwen2's split puts every digit in its own pre-token, so a number is the same digit tokens in
  the question, the tool call, the tool result and the answer (copying is token-exact).
- `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are special tokens; `<tool_call>`,
  `</tool_call>`, `<tool_response>`, `</tool_response>` are added non-special tokens (kept by
  `skip_special_tokens=True`, as the hermes tool parser needs). Each encodes as one id.
- The total vocabulary never exceeds `vocab_size`.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT_PATTERN

from nemo_rl.models.tiny_model.chat_template import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
)


class TokenizerBuildError(RuntimeError):
    """The trained tokenizer does not meet its contract."""


def _strip_added_tokens(text: str) -> str:
    # Added tokens get fixed ids; keep their pieces out of the merge statistics.
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        text = text.replace(token, "\n")
    return text


def _train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_strip_added_tokens(t) for t in texts], trainer=trainer)
    return tok


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int) -> Qwen2Tokenizer:
    trained = json.loads(_train_bpe(texts, vocab_size).to_str())["model"]
    # Rebuild through Qwen2Tokenizer so the in-memory pipeline is the one every loader rebuilds.
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    _check(tokenizer, vocab_size)
    return tokenizer


def _check(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> None:
    if len(tokenizer) > vocab_size:
        raise TokenizerBuildError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise TokenizerBuildError(f"added token {token!r} encodes as {ids}, expected a single id")
