"""Template-generic chat logic of the worker over two template families (ChatML and Llama-3).

The tokenizers are the real tiny-model tokenizers of each family (small vocabularies); the
tail tests rebuild turn 2's prompt the way the worker does (parent's exact ids + tail) and
compare it with the template's own rendering, for turns that ended on eos and turns cut by
max_tokens.
"""

from __future__ import annotations

import json

import pytest

from examples.arith import task as arith_task
from examples.arith.tiny_model.chat_template import CHATML, FAMILIES, LLAMA3, TemplateFamily
from examples.arith.tiny_model.corpus import TASK_TOOLS, task_conversation
from examples.arith.tiny_model.tokenizer import train_tokenizer
from nemo_rl.models.generation.vllm.chat import (
    HERMES,
    assistant_reply,
    derive_turn_end,
    generated_text,
    normalize_messages,
    parse_hermes,
    parses_tool_calls,
    render_root_prompt,
    render_text,
    render_token_in_tail,
    sampled_turn_close,
    tail_boundary,
)
from nemo_rl.models.generation.vllm.errors import TailRenderError, TemplateProbeError
from nemo_rl.models.generation.vllm.tool_parsers import (
    TOOL_CALL_PARSERS,
    get_tool_call_parser,
    parse_llama3_json,
)
from nemo_rl.models.generation.vllm.config import GenerationSetupError

PROBLEM = arith_task.Problem("12 + 5", 17)


@pytest.fixture(scope="module", params=[CHATML, LLAMA3], ids=lambda f: f.name)
def family_tokenizer(request):
    family: TemplateFamily = request.param
    texts = [json.dumps(task_conversation(p)) for p in arith_task.make_problems(0, 200)]
    return family, train_tokenizer(texts, vocab_size=600, max_length=2048, family=family)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_turn_end_is_derived_from_the_template(family_tokenizer):
    family, tokenizer = family_tokenizer
    assert derive_turn_end(tokenizer) == family.turn_end  # "<|im_end|>\n" / "<|eot_id|>"


class _FixedTemplate:
    """A tokenizer stand-in whose template renders a fixed string (probe failure cases)."""

    eos_token_id = 0

    def __init__(self, render) -> None:
        self._render = render

    def apply_chat_template(self, conversation, **kwargs):
        return self._render(conversation)


def test_a_template_without_end_of_turn_or_content_is_a_probe_error():
    with pytest.raises(TemplateProbeError, match="appends nothing"):
        derive_turn_end(_FixedTemplate(lambda msgs: "".join(m["content"] for m in msgs)))
    with pytest.raises(TemplateProbeError, match="drops the assistant content"):
        derive_turn_end(_FixedTemplate(lambda msgs: "<s>"))


def _turn_two(tokenizer, family, *, cut: bool):
    """Turn 1 sampled as the intended tool call (eos-ended, or cut just before eos)."""
    conv = task_conversation(PROBLEM)
    root = render_root_prompt(tokenizer, conv[:2], TASK_TOOLS)
    turn = render_text(tokenizer, conv[:3], TASK_TOOLS, gen_prompt=False)
    prompt = render_text(tokenizer, conv[:2], TASK_TOOLS, gen_prompt=True)
    body = turn[len(prompt) : len(turn) - len(family.turn_end)]
    sampled = _ids(tokenizer, body) + ([] if cut else [tokenizer.eos_token_id])
    return conv, root + sampled


@pytest.mark.parametrize("cut", [False, True], ids=["eos_ended", "max_tokens_cut"])
def test_token_in_tail_continues_the_parents_ids_exactly(family_tokenizer, cut):
    family, tokenizer = family_tokenizer
    conv, parent = _turn_two(tokenizer, family, cut=cut)
    close = sampled_turn_close(tokenizer, parent)
    assert close == ("" if cut else family.eos_token)
    tail = render_token_in_tail(tokenizer, conv[:4], TASK_TOOLS, turn_end=derive_turn_end(tokenizer), sampled_close=close)
    full = render_text(tokenizer, conv[:4], TASK_TOOLS, gen_prompt=True)
    # Text-exact: the parent's ids then the tail decode to the template's whole rendering.
    assert tokenizer.decode(parent + tail, skip_special_tokens=False) == full
    expected_tail = {
        ("chatml", False): "\n<|im_start|>tool\n<tool_response>\n17\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ("llama3", False): "<|start_header_id|>ipython<|end_header_id|>\n\n17<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    }
    decoded = tokenizer.decode(tail, skip_special_tokens=False)
    if cut:
        assert decoded == family.turn_end + expected_tail[(family.name, False)][len(family.turn_end) - len(family.eos_token) :]
    else:
        assert decoded == expected_tail[(family.name, False)]


def test_token_in_without_an_assistant_turn_is_a_tail_error(family_tokenizer):
    family, tokenizer = family_tokenizer
    conv = task_conversation(PROBLEM)
    with pytest.raises(TailRenderError, match="assistant turn"):
        render_token_in_tail(tokenizer, conv[:2], TASK_TOOLS, turn_end=family.turn_end, sampled_close="")


def test_tail_boundary_rules():
    # eos-ended ChatML: after "<|im_end|>"; cut: from the start of the turn end.
    history, full = "A<|im_end|>\n", "A<|im_end|>\nB"
    assert tail_boundary(history, full, turn_end="<|im_end|>\n", sampled_close="<|im_end|>") == len("A<|im_end|>")
    assert tail_boundary(history, full, turn_end="<|im_end|>\n", sampled_close="") == 1
    with pytest.raises(TailRenderError, match="re-renders history"):
        tail_boundary("A'<|im_end|>\n", full, turn_end="<|im_end|>\n", sampled_close="")
    with pytest.raises(TailRenderError, match="does not end with"):
        tail_boundary(history, full, turn_end="<|eot_id|>", sampled_close="")
    with pytest.raises(TailRenderError, match="does not begin"):
        tail_boundary(history, full, turn_end="<|im_end|>\n", sampled_close="<|endoftext|>")


def test_generated_text_drops_stop_tokens_and_keeps_tool_markup(family_tokenizer):
    family, tokenizer = family_tokenizer
    call = {
        "chatml": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>',
        "llama3": '{"name": "calculator", "parameters": {"expression": "1 + 2"}}',
    }[family.name]
    ids = _ids(tokenizer, call) + [tokenizer.eos_token_id]
    text = generated_text(tokenizer, ids)
    assert text == call
    parsed = get_tool_call_parser(family.tool_call_parser).parse(text)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["calculator"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"expression": "1 + 2"}


HERMES_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
CALC = ("calculator", '{"expression": "2 * 3"}')


# Expected values are what vLLM's own `Hermes2ProToolParser.extract_tool_calls` returns for each
# text (checked against it in tests/integration/test_stock_vllm_identity.py).
@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("The answer is 7.", "The answer is 7.", []),
        ("", "", []),
        (HERMES_CALL, None, [CALC]),
        (f"Let me compute.\n{HERMES_CALL}", "Let me compute.\n", [CALC]),  # before the first tag, unstripped
        (f"  {HERMES_CALL}", "  ", [CALC]),
        (f"{HERMES_CALL}\ntrailing", None, [CALC]),  # text after the blocks is dropped
        (HERMES_CALL + HERMES_CALL, None, [CALC, CALC]),
        (HERMES_CALL.removesuffix("\n</tool_call>"), None, [CALC]),  # left open by max_tokens
        ('<tool_call>\n{"name": "calculator", "arguments": "2 * 3"}\n</tool_call>', None, [("calculator", '"2 * 3"')]),
        ('<tool_call>\n{"name": "c", "arguments": {"e": "\u00e9"}}\n</tool_call>', None, [("c", '{"e": "\u00e9"}')]),
    ],
)
def test_hermes_follows_vllm(text, content, calls):
    parsed = parse_hermes(text)
    assert parsed.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)


@pytest.mark.parametrize(
    "text",
    [
        HERMES_CALL + "<tool_call>{bad json</tool_call>",  # one bad block spoils the whole reply
        '<tool_call>\n{"name": "calculator"}\n</tool_call>',  # no arguments
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
        "<tool_call></tool_call>",
    ],
)
def test_hermes_keeps_a_reply_with_any_malformed_block_as_text(text):
    parsed = parse_hermes(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_tool_calls_are_parsed_only_when_offered_and_not_refused():
    # vLLM's rule: no tools, or tool_choice="none", means the whole text is content.
    assert parses_tool_calls([arith_task.CALCULATOR_TOOL], None) is True
    assert parses_tool_calls([arith_task.CALCULATOR_TOOL], "auto") is True
    assert parses_tool_calls([arith_task.CALCULATOR_TOOL], "none") is False
    assert parses_tool_calls(None, "auto") is False
    assert parses_tool_calls([], None) is False


def test_assistant_reply_decodes_like_vllms_parser_asks(family_tokenizer):
    family, tokenizer = family_tokenizer
    call = {
        "chatml": HERMES_CALL,
        "llama3": '{"name": "calculator", "parameters": {"expression": "2 * 3"}}',
    }[family.name]
    bos = tokenizer.convert_tokens_to_ids(family.special_tokens[0])  # a special token inside the reply
    ids = [bos] + _ids(tokenizer, call) + [tokenizer.eos_token_id]
    without_tools = assistant_reply(tokenizer, ids, parser=get_tool_call_parser(family.tool_call_parser), parse_tools=False)
    assert without_tools.tool_calls == [] and without_tools.content == call  # special tokens dropped, nothing parsed
    parsed = assistant_reply(tokenizer, ids, parser=get_tool_call_parser(family.tool_call_parser), parse_tools=True)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("calculator", {"expression": "2 * 3"})
    ]
    if family.tool_call_parser == "hermes":
        # hermes keeps special tokens (vLLM turns skip_special_tokens off), but never the stop token.
        assert parsed.content == family.special_tokens[0]
        cut = assistant_reply(tokenizer, ids[:-1], parser=HERMES, parse_tools=True)  # cut by max_tokens: no stop token
        assert cut.content == family.special_tokens[0] and len(cut.tool_calls) == 1
    else:
        assert parsed.content is None


def test_normalize_messages_hands_tool_call_arguments_to_the_template_as_objects():
    def call(arguments):
        return {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}

    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call('{"expression":"1 + 2"}'), call({"x": 1})]},
        {"role": "assistant", "content": None, "tool_calls": [call("not json"), call("[1]"), call(""), call(None)]},
        {"role": "assistant", "content": "hi", "tool_calls": []},
        {"role": "developer", "content": "be brief"},
    ]
    out = normalize_messages(messages)
    assert out[0]["content"] == "ab"
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"expression": "1 + 2"}, {"x": 1}]
    assert [c["function"]["arguments"] for c in out[2]["tool_calls"]] == [{}, {}, {}, {}]
    assert out[1]["tool_calls"][0]["id"] == "c0" and out[1]["tool_calls"][0]["function"]["name"] == "calculator"
    assert "tool_calls" not in out[3]
    assert out[4]["role"] == "system"  # the one deliberate difference from vLLM (docs: vllm-worker-capture.md)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"expression":"1 + 2"}'  # input untouched


def test_llama3_json_follows_vllm():
    one = parse_llama3_json('{"name": "calculator", "parameters": {"expression": "2 * 3"}}')
    assert one.content is None
    assert one.tool_calls[0]["function"] == {"name": "calculator", "arguments": '{"expression": "2 * 3"}'}
    two = parse_llama3_json('{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {"y": {"z": 2}}}')
    assert [c["function"]["name"] for c in two.tool_calls] == ["a", "b"]
    assert len({c["id"] for c in two.tool_calls}) == 2
    assert json.loads(two.tool_calls[1]["function"]["arguments"]) == {"y": {"z": 2}}
    for text in (
        "The answer is 17.",
        '{"name": "calculator", "parameters": {"expression": "2 * 3"}',  # truncated (max_tokens)
        '{"name": "calculator"}',  # no arguments
        '{"name": "calculator", "parameters": "2 * 3"}',  # arguments not an object
        '{"name": 3, "parameters": {}}',
        'set {x} then {"name": "calculator", "parameters": {}}',  # a stray brace spoils the whole reply
    ):
        parsed = parse_llama3_json(text)
        assert parsed.tool_calls == [] and parsed.content == text, text


def test_parser_registry_matches_the_families():
    # The config takes every name of vLLM's registry (test_parser_config.py); these copies hold two.
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json"}
    assert {f.tool_call_parser for f in FAMILIES.values()} <= set(TOOL_CALL_PARSERS)
    with pytest.raises(GenerationSetupError, match="mistral") as e:
        get_tool_call_parser("mistral")
    assert e.value.kind == "tool_call_parser"
