"""`renderers`' token-in bridge and parser on real Qwen3, Qwen3.5 and DeepSeek-V4 ids (our family tokenizers).

Expectations are derived without the bridge: from the full render of the extended conversation
(our Qwen3 chat template's text for qwen3, the renderer's `render_ids` for the others), which is a
token prefix extension wherever the template keeps history. The sampled completion is given a
non-canonical tokenization (one token split in two) so "keeps the sampled ids" can fail.
"""

from __future__ import annotations

import pytest
from renderers import (
    DeepSeekV4RendererConfig, Qwen3RendererConfig, Qwen35RendererConfig, ToolCallParseStatus, create_renderer,
)

from examples.families.vocab import DEEPSEEK_V4, QWEN3, QWEN3_5, load_family_tokenizer

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SYSTEM = {"role": "system", "content": "Use the calculator tool, then state the answer."}
QUESTION = {"role": "user", "content": "What is 14 + 11 * 4?"}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "58"}
FOLLOW_UP = {"role": "user", "content": "And 14 * 11 + 4?"}

# Published ids of the markup the bridge emits, per family vocabulary.
IDS = {
    "qwen3": {"im_start": 151644, "im_end": 151645, "tool_response": 151665, "tool_response_end": 151666,
              "think": 151667, "think_end": 151668},
    "qwen3.5": {"im_start": 248045, "im_end": 248046, "tool_response": 248066, "tool_response_end": 248067,
                "think": 248068, "think_end": 248069},
}
CASES = [("qwen3", True), ("qwen3", False), ("qwen3.5", True), ("qwen3.5", False)]
CASE_IDS = ["qwen3-think", "qwen3-nothink", "qwen3.5-think", "qwen3.5-nothink"]


@pytest.fixture(scope="module")
def tokenizers():
    return {"qwen3": load_family_tokenizer(QWEN3), "qwen3.5": load_family_tokenizer(QWEN3_5)}


def _renderer(tokenizer, family: str, thinking: bool):
    config = Qwen3RendererConfig if family == "qwen3" else Qwen35RendererConfig
    return create_renderer(tokenizer, config(enable_thinking=thinking))


def _full_render(tokenizer, family: str, thinking: bool, messages: list[dict], tools) -> list[int]:
    """The whole conversation, rendered without the bridge (the expectation's source)."""
    if family == "qwen3":
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return _renderer(tokenizer, family, thinking).render_ids(messages, tools=tools, add_generation_prompt=True)


def _tool_call_turn(thinking: bool) -> dict:
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "14 + 11 * 4"}}}
    ]}
    # Under thinking off the prompt prefilled an empty think block: the model sampled no reasoning.
    return {**turn, "reasoning_content": "Use the calculator for the product first."} if thinking else turn


def _drift(tokenizer, ids: list[int]) -> list[int]:
    """`ids` with the first splittable word token sampled as two tokens (same text, other ids)."""
    for pos, token_id in enumerate(ids):
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in tokenizer.all_special_ids or len(piece) < 3 or not piece.isalpha():
            continue
        left, right = tokenizer.convert_tokens_to_ids(piece[:1]), tokenizer.convert_tokens_to_ids(piece[1:])
        if left is not None and right is not None:
            return ids[:pos] + [left, right] + ids[pos + 1:]
    raise AssertionError("no splittable word token in the completion")


def _sampled_turn(full: list[int], prompt: list[int], im_end: int) -> tuple[list[int], int]:
    """The assistant turn as the engine returned it (through `<|im_end|>`), and where it ends in `full`."""
    assert full[: len(prompt)] == prompt, "the extended render must keep the served prompt"
    end = full.index(im_end, len(prompt)) + 1
    return full[len(prompt):end], end


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _opener(tokenizer, family: str, thinking: bool) -> list[int]:
    ids = IDS[family]
    opener = [ids["im_start"], *_text_ids(tokenizer, "assistant\n")]
    if not thinking:
        return opener + [ids["think"], *_text_ids(tokenizer, "\n\n"), ids["think_end"], *_text_ids(tokenizer, "\n\n")]
    # Qwen3.5 opens the thinking block in the generation prompt; Qwen3 leaves it to the model.
    return opener + ([ids["think"], *_text_ids(tokenizer, "\n")] if family == "qwen3.5" else [])


@pytest.mark.parametrize(("family", "thinking"), CASES, ids=CASE_IDS)
def test_tool_loop_bridges_keeping_the_sampled_ids(tokenizers, family, thinking):
    tokenizer, ids = tokenizers[family], IDS[family]
    renderer = _renderer(tokenizer, family, thinking)
    prompt = renderer.render_ids([SYSTEM, QUESTION], tools=[CALCULATOR], add_generation_prompt=True)
    full = _full_render(tokenizer, family, thinking, [SYSTEM, QUESTION, _tool_call_turn(thinking), TOOL_RESULT], [CALCULATOR])
    canonical, end = _sampled_turn(full, prompt, ids["im_end"])
    sampled = _drift(tokenizer, canonical)
    assert sampled != canonical and tokenizer.decode(sampled) == tokenizer.decode(canonical)

    bridged = renderer.bridge_to_next_turn(prompt, sampled, [TOOL_RESULT], tools=[CALCULATOR])

    assert bridged is not None
    tail = [
        *_text_ids(tokenizer, "\n"), ids["im_start"], *_text_ids(tokenizer, "user\n"), ids["tool_response"],
        *_text_ids(tokenizer, "\n58\n"), ids["tool_response_end"], ids["im_end"], *_text_ids(tokenizer, "\n"),
        *_opener(tokenizer, family, thinking),
    ]
    assert full[end:] == tail
    assert bridged.token_ids == prompt + sampled + tail


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_user_follow_up_after_a_thinking_answer_has_no_exact_bridge(tokenizers, family):
    tokenizer, ids = tokenizers[family], IDS[family]
    renderer = _renderer(tokenizer, family, True)
    answer = {"role": "assistant", "reasoning_content": "11 * 4 = 44; 14 + 44 = 58.", "content": "58"}
    prompt = renderer.render_ids([QUESTION], add_generation_prompt=True)
    sampled, _ = _sampled_turn(renderer.render_ids([QUESTION, answer]), prompt, ids["im_end"])
    assert ids["think_end"] in sampled

    assert renderer.bridge_to_next_turn(prompt, sampled, [FOLLOW_UP]) is None
    # Why no bridge is right: the family's render of the next prompt drops the earlier reasoning.
    extended = _full_render(tokenizer, family, True, [QUESTION, answer, FOLLOW_UP], None)
    assert extended[: len(prompt) + len(sampled)] != prompt + sampled
    assert ids["think_end"] not in extended[len(prompt):]


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_user_follow_up_with_thinking_off_bridges_to_the_full_render(tokenizers, family):
    tokenizer, ids = tokenizers[family], IDS[family]
    renderer = _renderer(tokenizer, family, False)
    answer = {"role": "assistant", "content": "The answer is 58."}
    prompt = renderer.render_ids([QUESTION], add_generation_prompt=True)
    full = _full_render(tokenizer, family, False, [QUESTION, answer, FOLLOW_UP], None)
    sampled, end = _sampled_turn(full, prompt, ids["im_end"])
    assert tokenizer.decode(sampled) == "The answer is 58.<|im_end|>"

    bridged = renderer.bridge_to_next_turn(prompt, sampled, [FOLLOW_UP])

    assert bridged is not None and bridged.token_ids == full


@pytest.mark.parametrize(("family", "thinking"), CASES, ids=CASE_IDS)
def test_truncated_tool_call_turn_is_closed(tokenizers, family, thinking):
    tokenizer, ids = tokenizers[family], IDS[family]
    renderer = _renderer(tokenizer, family, thinking)
    prompt = renderer.render_ids([QUESTION], tools=[CALCULATOR], add_generation_prompt=True)
    full = _full_render(tokenizer, family, thinking, [QUESTION, _tool_call_turn(thinking), TOOL_RESULT], [CALCULATOR])
    complete, _ = _sampled_turn(full, prompt, ids["im_end"])
    truncated = complete[:-1]  # the engine stopped on the length limit just before <|im_end|>
    assert ids["im_end"] not in truncated

    bridged = renderer.bridge_to_next_turn(prompt, truncated, [TOOL_RESULT], tools=[CALCULATOR])

    assert bridged is not None
    assert bridged.token_ids[: len(prompt) + len(truncated)] == prompt + truncated
    assert bridged.token_ids == full


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_truncated_answer_with_thinking_off_is_closed(tokenizers, family):
    tokenizer, ids = tokenizers[family], IDS[family]
    renderer = _renderer(tokenizer, family, False)
    prompt = renderer.render_ids([QUESTION], add_generation_prompt=True)
    truncated = _text_ids(tokenizer, "The answer is")
    expected = _full_render(
        tokenizer, family, False, [QUESTION, {"role": "assistant", "content": "The answer is"}, FOLLOW_UP], None
    )

    bridged = renderer.bridge_to_next_turn(prompt, truncated, [FOLLOW_UP])

    assert bridged is not None
    assert bridged.token_ids[: len(prompt) + len(truncated) + 1] == prompt + truncated + [ids["im_end"]]
    assert bridged.token_ids == expected


@pytest.mark.parametrize(("family", "thinking"), CASES, ids=CASE_IDS)
def test_parser_reads_the_sampled_tool_call(tokenizers, family, thinking):
    tokenizer, ids = tokenizers[family], IDS[family]
    renderer = _renderer(tokenizer, family, thinking)
    prompt = renderer.render_ids([QUESTION], tools=[CALCULATOR], add_generation_prompt=True)
    full = _full_render(tokenizer, family, thinking, [QUESTION, _tool_call_turn(thinking), TOOL_RESULT], [CALCULATOR])
    sampled, _ = _sampled_turn(full, prompt, ids["im_end"])

    parsed = renderer.parse_response(sampled, tools=[CALCULATOR], prompt_ids=prompt)

    assert (parsed.reasoning_content or "") == ("Use the calculator for the product first." if thinking else "")
    assert (parsed.content or "") == ""
    assert [(c.name, c.arguments, c.status) for c in parsed.tool_calls] == [
        ("calculator", {"expression": "14 + 11 * 4"}, ToolCallParseStatus.OK)
    ]
    assert parsed.reasoning_complete is True
    assert renderer.get_stop_token_ids() == [ids["im_end"], ids["im_start"] - 1]


# DeepSeek-V4 (no Jinja template: its reference is a Python encoder, mirrored by the renderer).
DS_USER, DS_ASSISTANT, DS_EOS, DS_THINK, DS_THINK_END = 128803, 128804, 1, 128821, 128822


@pytest.fixture(scope="module")
def deepseek():
    return load_family_tokenizer(DEEPSEEK_V4)


@pytest.mark.parametrize("thinking", [True, False], ids=["think", "chat"])
def test_deepseek_v4_tool_loop_bridges_keeping_the_sampled_ids(deepseek, thinking):
    renderer = create_renderer(deepseek, DeepSeekV4RendererConfig(enable_thinking=thinking))
    prompt = renderer.render_ids([SYSTEM, QUESTION], tools=[CALCULATOR], add_generation_prompt=True)
    full = renderer.render_ids([SYSTEM, QUESTION, _tool_call_turn(thinking), TOOL_RESULT], tools=[CALCULATOR],
                               add_generation_prompt=True)
    canonical, end = _sampled_turn(full, prompt, DS_EOS)
    sampled = _drift(deepseek, canonical)
    assert sampled != canonical and deepseek.decode(sampled) == deepseek.decode(canonical)

    bridged = renderer.bridge_to_next_turn(prompt, sampled, [TOOL_RESULT], tools=[CALCULATOR])

    assert bridged is not None
    tail = [DS_USER, *_text_ids(deepseek, "<tool_result>58</tool_result>"), DS_ASSISTANT,
            DS_THINK if thinking else DS_THINK_END]
    assert full[end:] == tail
    assert bridged.token_ids == prompt + sampled + tail
    parsed = renderer.parse_response(sampled, tools=[CALCULATOR], prompt_ids=prompt)
    assert [(c.name, c.arguments, c.status) for c in parsed.tool_calls] == [
        ("calculator", {"expression": "14 + 11 * 4"}, ToolCallParseStatus.OK)
    ]
    assert (parsed.reasoning_content or "") == ("Use the calculator for the product first." if thinking else "")
    assert renderer.get_stop_token_ids() == [DS_EOS]


def test_deepseek_v4_user_follow_up_after_thinking_has_no_exact_bridge(deepseek):
    renderer = create_renderer(deepseek, DeepSeekV4RendererConfig(enable_thinking=True))
    answer = {"role": "assistant", "reasoning_content": "11 * 4 = 44; 14 + 44 = 58.", "content": "58"}
    prompt = renderer.render_ids([QUESTION], add_generation_prompt=True)
    sampled, _ = _sampled_turn(renderer.render_ids([QUESTION, answer]), prompt, DS_EOS)
    assert DS_THINK_END in sampled

    assert renderer.bridge_to_next_turn(prompt, sampled, [FOLLOW_UP]) is None
    extended = renderer.render_ids([QUESTION, answer, FOLLOW_UP], add_generation_prompt=True)
    assert extended[: len(prompt) + len(sampled)] != prompt + sampled
