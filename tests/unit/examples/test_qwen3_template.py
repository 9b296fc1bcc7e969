"""The Qwen3 chat template written here renders token-for-token what `renderers`' qwen3 renderer renders.

Over a fixture set (tools, several tool calls and results, several user turns, thinking turns
before a later user question, text parts, a later system turn), with thinking on and off and
the generation prompt on and off, the ids of the template's text (through the tokenizer folder's
own `apply_chat_template`, as vLLM uses it) equal `render_ids`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from renderers import Qwen3RendererConfig, create_renderer

from examples.families.qwen3_template import QWEN3_CHAT_TEMPLATE
from examples.families.vocab import QWEN3, load_family_tokenizer

CONVERSATIONS = json.loads((Path(__file__).parent / "data" / "qwen3_conversations.json").read_text())
NAMES = [c["name"] for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def tokenizer():
    return load_family_tokenizer(QWEN3)


def _conversation(name: str) -> dict:
    return next(c for c in CONVERSATIONS if c["name"] == name)


def _template_ids(tokenizer, conv: dict, *, add_generation_prompt: bool, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(
        conv["messages"], tools=conv["tools"], add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_tokenizer_folder_carries_the_template(tokenizer):
    assert tokenizer.chat_template == QWEN3_CHAT_TEMPLATE


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("enable_thinking", [True, False], ids=["think", "nothink"])
@pytest.mark.parametrize("name", NAMES)
def test_template_ids_equal_the_renderer_ids(tokenizer, name, enable_thinking, add_generation_prompt):
    conv = _conversation(name)
    renderer = create_renderer(tokenizer, Qwen3RendererConfig(enable_thinking=enable_thinking))
    expected = renderer.render_ids(conv["messages"], tools=conv["tools"], add_generation_prompt=add_generation_prompt)
    got = _template_ids(tokenizer, conv, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    assert got == expected


@pytest.mark.parametrize("name", NAMES)
def test_thinking_is_on_when_the_kwarg_is_absent(tokenizer, name):
    conv = _conversation(name)
    expected = create_renderer(tokenizer, Qwen3RendererConfig()).render_ids(
        conv["messages"], tools=conv["tools"], add_generation_prompt=True
    )
    assert _template_ids(tokenizer, conv, add_generation_prompt=True) == expected


def test_tokenized_apply_chat_template_gives_the_same_ids(tokenizer):
    conv = _conversation("two_tool_calls_two_results_string_arguments")
    ids = tokenizer.apply_chat_template(
        conv["messages"], tools=conv["tools"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    expected = create_renderer(tokenizer, Qwen3RendererConfig()).render_ids(
        conv["messages"], tools=conv["tools"], add_generation_prompt=True
    )
    assert list(ids) == expected


def test_earlier_thinking_is_dropped_and_the_text_is_exact(tokenizer):
    text = tokenizer.apply_chat_template(
        _conversation("thinking_answer_then_user_question")["messages"], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>user\nIs 91 prime?<|im_end|>\n"
        "<|im_start|>assistant\nNo: 91 = 7 × 13.<|im_end|>\n"
        "<|im_start|>user\nIs 97 prime?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_thinking_off_keeps_the_empty_think_block_in_history(tokenizer):
    text = tokenizer.apply_chat_template(
        _conversation("several_user_turns")["messages"][:3], tokenize=False, enable_thinking=False
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n7<|im_end|>\n"
    )


def test_the_documented_limit_a_history_body_opening_with_blank_lines(tokenizer):
    # The renderer encodes "assistant\n" and the body apart; one text cannot, so BPE joins "\n \n".
    conv = {"tools": None, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "\n \nanswer"}, {"role": "user", "content": "q2"},
    ]}
    expected = create_renderer(tokenizer, Qwen3RendererConfig()).render_ids(conv["messages"])
    got = _template_ids(tokenizer, conv, add_generation_prompt=False)
    assert tokenizer.decode(got) == tokenizer.decode(expected)
    assert got != expected
