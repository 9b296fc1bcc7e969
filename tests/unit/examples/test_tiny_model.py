"""The tiny model builder: determinism, chat-template invariants, tokenizer, artefact, cache."""

from __future__ import annotations

import json
import shutil
import textwrap
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from examples.arith import task as arith_task
from examples.arith.episodes import Sampling, parse_calculator_call, run_episode
from examples.arith.tiny_model.build import cache_folder, cache_key, default_cache_root
from examples.arith.tiny_model.chat_template import LLAMA3, SPECIAL_TOKENS, TOOL_TOKENS
from examples.arith.tiny_model.corpus import TASK_TOOLS, CorpusError, english_text, task_conversation
from examples.arith.tiny_model.encoding import encode_transcript, render
from examples.arith.tiny_model.sft import collate, deterministic_torch, init_model, masked_loss
from examples.arith.tiny_model import (
    GENERATION_PROMPT,
    TURN_END,
    TinyModelBuildError,
    TinyModelConfig,
    build_tiny_model,
    config_digest,
    ensure_tiny_model,
)

SMALL = TinyModelConfig(
    vocab_size=512,
    tokenizer_transcripts=64,
    english_modules=("json",),
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=512,
    sft_examples=16,
    sft_steps=3,
    sft_batch_size=4,
    log_every=1,
)

PROBLEM = arith_task.Problem(expression="14 + 11 * 4", answer=58)

EXPECTED_TASK_TEXT = (
    "<|im_start|>system\n"
    "You are a careful assistant. Use the calculator tool, then state the answer.\n\n"
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an integer '
    'expression with + - *.", "parameters": {"type": "object", "properties": {"expression": '
    '{"type": "string"}}, "required": ["expression"]}}}\n'
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\nWhat is 14 + 11 * 4?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "14 + 11 * 4"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>tool\n<tool_response>\n58\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nThe answer is 58.<|im_end|>\n"
)


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _tool_call(call_id: str, name: str, arguments: str | dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


MULTI_TURN: list[dict] = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [_tool_call("a", "calculator", '{"expression": "1 + 2"}')]},
    {"role": "tool", "tool_call_id": "a", "content": "3"},
    {
        "role": "assistant",
        "content": "Checking twice.",
        "tool_calls": [
            _tool_call("b", "calculator", {"expression": "2 + 1"}),
            _tool_call("c", "calculator", '{"expression":"3"}'),
        ],
    },
    {"role": "tool", "tool_call_id": "b", "content": "3"},
    {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "3"}]},
    {"role": "assistant", "content": "The answer is 3."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": ""},
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(SMALL, tmp_path_factory.mktemp("tiny") / "model", progress=lambda _: None)


@pytest.fixture(scope="module")
def tokenizer(built: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(built)


# --- determinism -------------------------------------------------------------------------


def test_same_seed_gives_identical_weights_and_tokenizer(built: Path, tmp_path: Path) -> None:
    again = build_tiny_model(SMALL, tmp_path / "again", progress=lambda _: None)
    info_a = json.loads((built / "build_info.json").read_text())
    info_b = json.loads((again / "build_info.json").read_text())
    assert info_a["weights_sha256"] == info_b["weights_sha256"]
    assert (built / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert (built / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert info_a == info_b


def test_different_seed_gives_different_weights(built: Path, tmp_path: Path) -> None:
    other_cfg = SMALL.model_copy(update={"seed": SMALL.seed + 1})
    other = build_tiny_model(other_cfg, tmp_path / "other", progress=lambda _: None)
    info_a = json.loads((built / "build_info.json").read_text())
    info_b = json.loads((other / "build_info.json").read_text())
    assert info_a["weights_sha256"] != info_b["weights_sha256"]


def test_build_refuses_a_non_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(TinyModelBuildError, match="not empty"):
        build_tiny_model(SMALL, tmp_path, progress=lambda _: None)


def test_deterministic_torch_restores_global_state() -> None:
    threads = torch.get_num_threads()
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic_torch(SMALL.model_copy(update={"num_threads": 1})):
        assert torch.get_num_threads() == 1
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == before


# --- chat template -----------------------------------------------------------------------


def test_task_transcript_renders_exactly(tokenizer: PreTrainedTokenizerFast) -> None:
    assert render(tokenizer, task_conversation(PROBLEM), TASK_TOOLS, add_generation_prompt=False) == EXPECTED_TASK_TEXT


def test_multi_turn_history_is_a_prefix_and_turns_end_with_im_end(tokenizer: PreTrainedTokenizerFast) -> None:
    full = render(tokenizer, MULTI_TURN, TASK_TOOLS, add_generation_prompt=False)
    previous = ""
    for k in range(1, len(MULTI_TURN) + 1):
        text = render(tokenizer, MULTI_TURN[:k], TASK_TOOLS, add_generation_prompt=False)
        assert full.startswith(text)
        assert text.startswith(previous)
        assert text.endswith(TURN_END)
        if MULTI_TURN[k - 1]["role"] == "assistant":
            prompt = render(tokenizer, MULTI_TURN[: k - 1], TASK_TOOLS, add_generation_prompt=True)
            assert prompt == previous + GENERATION_PROMPT
            assert text.startswith(prompt)
        previous = text


def test_multi_turn_tool_calls_render_as_specified(tokenizer: PreTrainedTokenizerFast) -> None:
    text = render(tokenizer, MULTI_TURN[:5], TASK_TOOLS, add_generation_prompt=False)
    assert text.endswith(
        "<|im_start|>assistant\nChecking twice.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2 + 1"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "calculator", "arguments": {"expression":"3"}}\n</tool_call><|im_end|>\n'
    )


def test_string_and_mapping_arguments_agree_for_json_dumps_text(tokenizer: PreTrainedTokenizerFast) -> None:
    def turn(arguments: str | dict) -> list[dict]:
        return [{"role": "assistant", "content": None, "tool_calls": [_tool_call("a", "calculator", arguments)]}]

    as_text = render(tokenizer, turn(json.dumps({"expression": "1 + 2"})), None, False)
    assert as_text == render(tokenizer, turn({"expression": "1 + 2"}), None, False)


def test_generation_prompt_and_no_tools(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "hi"}]
    user_turn = "<|im_start|>user\nhi<|im_end|>\n"
    assert render(tokenizer, messages, None, add_generation_prompt=True) == user_turn + "<|im_start|>assistant\n"
    with_system = [{"role": "system", "content": "s"}, *messages]
    assert render(tokenizer, with_system, None, False) == "<|im_start|>system\ns<|im_end|>\n" + user_turn


def test_responses_form_tools_render_like_chat_form(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = task_conversation(PROBLEM)[:2]
    strict_chat = [{"type": "function", "function": {**arith_task.CALCULATOR_TOOL["function"], "strict": True}}]
    expected = render(tokenizer, messages, TASK_TOOLS, True)
    assert render(tokenizer, messages, [arith_task.CALCULATOR_TOOL_RESPONSES], True) == expected
    assert render(tokenizer, messages, strict_chat, True) == expected


def test_unknown_role_and_non_text_part_raise(tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(TemplateError, match="role narrator is not supported"):
        render(tokenizer, [{"role": "narrator", "content": "x"}], None, False)
    with pytest.raises(TemplateError, match="content part type image_url is not supported"):
        render(tokenizer, [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}], None, False)


_text = st.text(alphabet=st.sampled_from("ab1 +\n{}\"<>|_"), max_size=12)
_call = st.builds(
    lambda name, args, as_dict: _tool_call("id", name, args if as_dict else json.dumps(args)),
    st.sampled_from(["calculator", "other"]),
    st.fixed_dictionaries({"expression": _text}),
    st.booleans(),
)
_message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, _text),
    st.builds(lambda c: {"role": "tool", "tool_call_id": "id", "content": c}, _text),
    st.builds(
        lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
        st.one_of(st.none(), _text),
        st.lists(_call, max_size=2),
    ),
)


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(_message, min_size=1, max_size=6),
    system=st.one_of(st.none(), _text),
    with_tools=st.booleans(),
)
def test_prefix_property_holds_for_any_conversation(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict], system: str | None, with_tools: bool
) -> None:
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    tools = TASK_TOOLS if with_tools else None
    full = render(tokenizer, messages, tools, False)
    for k in range(1, len(messages) + 1):
        text = render(tokenizer, messages[:k], tools, False)
        assert full.startswith(text)
        assert text.endswith(TURN_END)
        assert render(tokenizer, messages[:k], tools, True) == text + GENERATION_PROMPT


# --- tokenizer and encoding --------------------------------------------------------------


def test_added_tokens_are_single_ids_and_round_trip(tokenizer: PreTrainedTokenizerFast) -> None:
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1
        assert tokenizer.decode(ids) == token
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert len(tokenizer) <= SMALL.vocab_size


def test_skip_special_tokens_keeps_tool_markup(tokenizer: PreTrainedTokenizerFast) -> None:
    text = '<tool_call>\n{"name": "calculator"}\n</tool_call><|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "calculator"}\n</tool_call>'


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=40))
def test_byte_level_round_trip_of_nfc_text(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    text = unicodedata.normalize("NFC", text)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_autotokenizer_loads_the_saved_pipeline_unchanged(built: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    saved = json.loads((built / "tokenizer.json").read_text())
    assert json.loads(tokenizer.backend_tokenizer.to_str()) == saved


def test_transcript_round_trips_through_the_tokenizer(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.decode(tokenizer.encode(EXPECTED_TASK_TEXT, add_special_tokens=False)) == EXPECTED_TASK_TEXT


def test_encoded_transcript_matches_whole_text_tokenization_and_masks_assistant_bodies(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    enc = encode_transcript(tokenizer, task_conversation(PROBLEM), TASK_TOOLS)
    whole = tokenizer.encode(EXPECTED_TASK_TEXT, add_special_tokens=False)
    assert list(enc.ids) == whole[:-1]
    assert tokenizer.decode(whole[-1:]) == "\n"
    spans, current = [], []
    for token_id, trained in zip(enc.ids, enc.loss_mask):
        if trained:
            current.append(token_id)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    spans.append(tokenizer.decode(current))
    assert spans == [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "14 + 11 * 4"}}\n</tool_call><|im_end|>',
        "The answer is 58.<|im_end|>",
    ]


def _per_row_loss(model: torch.nn.Module, examples: list) -> torch.Tensor:
    total, count = torch.tensor(0.0), 0
    for e in examples:
        ids = torch.tensor([e.ids])
        select = torch.tensor(e.loss_mask)[1:]
        logits = model(ids).logits[0, :-1][select]
        total = total + torch.nn.functional.cross_entropy(logits, ids[0, 1:][select], reduction="sum")
        count += int(select.sum())
    return total / count


def test_shared_prefix_loss_and_gradients_equal_per_row_ones(tokenizer: PreTrainedTokenizerFast) -> None:
    examples = [encode_transcript(tokenizer, task_conversation(p), TASK_TOOLS) for p in arith_task.make_problems(3, 4)]
    # A large init makes attention far from uniform, so a wrong mask or position would show.
    model = init_model(SMALL.model_copy(update={"init_std": 0.5}), tokenizer.eos_token_id, tokenizer.pad_token_id)
    batch = collate(examples, tokenizer.pad_token_id)
    assert batch.prefix.shape[1] > 100  # the system + tools turn is shared
    shared = masked_loss(model, batch)
    shared.backward()
    shared_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = _per_row_loss(model, examples)
    reference.backward()
    assert reference.item() > 1.0
    assert torch.allclose(shared, reference, rtol=1e-5)
    for name, param in model.named_parameters():
        assert torch.allclose(shared_grads[name], param.grad, rtol=1e-4, atol=1e-6), name


class ScriptedModel:
    """Stands in for `generate`: replies with scripted token ids and records each prompt."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    def generate(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        self.prompts.append(input_ids[0].tolist())
        return torch.cat([input_ids, torch.tensor([self.replies.pop(0)])], dim=1)


def test_run_episode_builds_turn_two_from_turn_one_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    conversation = task_conversation(PROBLEM)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "14 + 11 * 4"}}\n</tool_call><|im_end|>'
    model = ScriptedModel([_ids(tokenizer, call), _ids(tokenizer, "The answer is 58.<|im_end|>")])
    episode = run_episode(model, tokenizer, PROBLEM, Sampling(do_sample=False))
    assert episode.expression == "14 + 11 * 4"
    assert episode.final_reply == "The answer is 58."
    assert episode.reward == 1.0
    assert model.prompts[0] == _ids(tokenizer, render(tokenizer, conversation[:2], TASK_TOOLS, True))
    assert model.prompts[1] == _ids(tokenizer, render(tokenizer, conversation[:4], TASK_TOOLS, True))


def test_run_episode_stops_without_a_parseable_call(tokenizer: PreTrainedTokenizerFast) -> None:
    model = ScriptedModel([_ids(tokenizer, "The answer is 58.<|im_end|>")])
    episode = run_episode(model, tokenizer, PROBLEM, Sampling(do_sample=False))
    assert (episode.tool_call_ok, episode.final_reply, episode.reward) == (False, None, 0.0)
    assert len(model.prompts) == 1


def test_english_text_reads_source_files_not_live_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    before = english_text(("textwrap",))
    assert textwrap.dedent.__doc__.strip().splitlines()[0] in "\n".join(before)
    monkeypatch.setattr(textwrap.dedent, "__doc__", "patched by another library")
    assert english_text(("textwrap",)) == before


def test_english_text_rejects_modules_without_python_source() -> None:
    with pytest.raises(CorpusError, match="'math' has no Python source file"):
        english_text(("math",))


def test_parse_calculator_call() -> None:
    call = '<tool_call>\n{"name": "%s", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
    assert parse_calculator_call(call % "calculator") == "1 + 2"
    assert parse_calculator_call(call % "other") is None
    assert parse_calculator_call("<tool_call>\n{not json}\n</tool_call>") is None
    assert parse_calculator_call("The answer is 3.") is None


# --- artefact on disk --------------------------------------------------------------------


def test_saved_folder_loads_untied_float32_qwen2(built: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    assert config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == tokenizer.eos_token_id
    weights = load_file(built / "model.safetensors")
    assert "lm_head.weight" in weights
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    prompt = render(tokenizer, task_conversation(PROBLEM)[:2], TASK_TOOLS, add_generation_prompt=True)
    logits = model(torch.tensor([_ids(tokenizer, prompt)])).logits
    assert logits.shape[-1] == SMALL.vocab_size
    assert tokenizer.chat_template is not None


def test_build_info_records_config_and_hashes(built: Path) -> None:
    info = json.loads((built / "build_info.json").read_text())
    assert info["config"] == SMALL.model_dump(mode="json")
    assert info["config_digest"] == config_digest(SMALL)
    assert info["cache_key"] == cache_key(SMALL)
    assert len(info["weights_sha256"]) == 64


# --- config and cache --------------------------------------------------------------------


def test_config_rejects_unknown_fields_and_bad_heads() -> None:
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        TinyModelConfig(tie_word_embeddings=True)
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)


def test_config_digest_and_cache_key_follow_the_config() -> None:
    assert config_digest(SMALL) == config_digest(TinyModelConfig(**SMALL.model_dump()))
    assert config_digest(SMALL) != config_digest(SMALL.model_copy(update={"sft_steps": 4}))
    assert cache_key(SMALL) == cache_key(TinyModelConfig(**SMALL.model_dump()))
    assert cache_key(SMALL) != cache_key(SMALL.model_copy(update={"sft_steps": 4}))


def test_ensure_builds_once_then_reuses(tmp_path: Path) -> None:
    messages: list[str] = []
    folder = ensure_tiny_model(SMALL, tmp_path, progress=messages.append)
    assert folder.parent == tmp_path / "tiny_model"
    assert (folder / "model.safetensors").is_file()
    built_messages = len(messages)
    assert built_messages > 0
    assert ensure_tiny_model(SMALL, tmp_path, progress=messages.append) == folder
    assert len(messages) == built_messages
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_cache_root_comes_from_env_else_the_repo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NRL_CACHE_DIR", str(tmp_path))
    assert cache_folder(SMALL) == tmp_path / "tiny_model" / cache_key(SMALL)[:24]
    monkeypatch.delenv("NRL_CACHE_DIR")
    repo = Path(__file__).resolve().parents[3]
    assert default_cache_root() == repo / ".cache"


def test_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    bad = SMALL.model_copy(update={"english_modules": ("no_such_module_xyz",)})
    with pytest.raises(CorpusError, match="no_such_module_xyz"):
        ensure_tiny_model(bad, tmp_path, progress=lambda _: None)
    assert list((tmp_path / "tiny_model").iterdir()) == []


def test_ensure_rejects_a_folder_with_a_foreign_digest(built: Path, tmp_path: Path) -> None:
    folder = cache_folder(SMALL, tmp_path)
    shutil.copytree(built, folder)
    assert ensure_tiny_model(SMALL, tmp_path, progress=lambda _: None) == folder
    info = json.loads((folder / "build_info.json").read_text())
    info["cache_key"] = "0" * 64
    (folder / "build_info.json").write_text(json.dumps(info))
    with pytest.raises(TinyModelBuildError, match="delete the folder"):
        ensure_tiny_model(SMALL, tmp_path, progress=lambda _: None)


# --- second template family: Llama-3 headers, JSON tool calls ----------------------------

SMALL_LLAMA3 = SMALL.model_copy(update={"template_family": "llama3"})

EXPECTED_LLAMA3_TASK_TEXT = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "You are a careful assistant. Use the calculator tool, then state the answer.\n\n"
    "You have access to the following functions. To call a function, respond with a JSON object of the form "
    '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n'
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an integer '
    'expression with + - *.", "parameters": {"type": "object", "properties": {"expression": '
    '{"type": "string"}}, "required": ["expression"]}}}<|eot_id|>'
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 14 + 11 * 4?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "calculator", "parameters": {"expression": "14 + 11 * 4"}}<|eot_id|>'
    "<|start_header_id|>ipython<|end_header_id|>\n\n58<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is 58.<|eot_id|>"
)


@pytest.fixture(scope="module")
def llama3_built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(SMALL_LLAMA3, tmp_path_factory.mktemp("tiny_llama3") / "model", progress=lambda _: None)


@pytest.fixture(scope="module")
def llama3_tokenizer(llama3_built: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(llama3_built)


def test_llama3_transcript_renders_exactly_and_round_trips(llama3_tokenizer: PreTrainedTokenizerFast) -> None:
    text = render(llama3_tokenizer, task_conversation(PROBLEM), TASK_TOOLS, add_generation_prompt=False)
    assert text == EXPECTED_LLAMA3_TASK_TEXT
    assert llama3_tokenizer.decode(_ids(llama3_tokenizer, text)) == text


def test_llama3_tokenizer_tokens(llama3_built: Path, llama3_tokenizer: PreTrainedTokenizerFast) -> None:
    for token in LLAMA3.special_tokens:
        assert len(_ids(llama3_tokenizer, token)) == 1
    assert llama3_tokenizer.eos_token == "<|eot_id|>"
    assert llama3_tokenizer.pad_token == "<|end_of_text|>"
    assert llama3_tokenizer.bos_token is None
    assert "<|im_end|>" not in llama3_tokenizer.get_vocab()
    info = json.loads((llama3_built / "build_info.json").read_text())
    assert info["config"]["template_family"] == "llama3"
    eos = llama3_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert json.loads((llama3_built / "generation_config.json").read_text())["eos_token_id"] == eos


def test_llama3_multi_turn_history_is_a_prefix_and_turns_end_with_eot(llama3_tokenizer: PreTrainedTokenizerFast) -> None:
    full = render(llama3_tokenizer, MULTI_TURN, TASK_TOOLS, add_generation_prompt=False)
    for k in range(1, len(MULTI_TURN) + 1):
        text = render(llama3_tokenizer, MULTI_TURN[:k], TASK_TOOLS, add_generation_prompt=False)
        assert full.startswith(text) and text.endswith(LLAMA3.turn_end)
        assert render(llama3_tokenizer, MULTI_TURN[:k], TASK_TOOLS, True) == text + LLAMA3.generation_prompt
    assert render(llama3_tokenizer, MULTI_TURN[:5], TASK_TOOLS, False).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\nChecking twice.\n"
        '{"name": "calculator", "parameters": {"expression": "2 + 1"}}; '
        '{"name": "calculator", "parameters": {"expression":"3"}}<|eot_id|>'
    )


@settings(max_examples=40, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=6), with_tools=st.booleans())
def test_llama3_prefix_property_holds_for_any_conversation(
    llama3_tokenizer: PreTrainedTokenizerFast, messages: list[dict], with_tools: bool
) -> None:
    tools = TASK_TOOLS if with_tools else None
    full = render(llama3_tokenizer, messages, tools, False)
    for k in range(1, len(messages) + 1):
        text = render(llama3_tokenizer, messages[:k], tools, False)
        assert full.startswith(text) and text.endswith(LLAMA3.turn_end)


def test_llama3_encoded_transcript_is_the_whole_text_and_masks_bodies_through_eot(
    llama3_tokenizer: PreTrainedTokenizerFast,
) -> None:
    enc = encode_transcript(llama3_tokenizer, task_conversation(PROBLEM), TASK_TOOLS, LLAMA3)
    # Nothing follows <|eot_id|>: the encoded segments cover the whole transcript text.
    assert llama3_tokenizer.decode(list(enc.ids)) == EXPECTED_LLAMA3_TASK_TEXT
    trained = [llama3_tokenizer.decode([t]) for t, m in zip(enc.ids, enc.loss_mask) if m]
    assert "".join(trained) == (
        '{"name": "calculator", "parameters": {"expression": "14 + 11 * 4"}}<|eot_id|>The answer is 58.<|eot_id|>'
    )


def test_template_family_changes_the_cache_key_and_rejects_unknown_names() -> None:
    assert config_digest(SMALL) != config_digest(SMALL_LLAMA3)
    assert cache_key(SMALL) != cache_key(SMALL_LLAMA3)
    assert TinyModelConfig().template_family == "chatml"
    with pytest.raises(ValueError, match="template_family"):
        TinyModelConfig(template_family="mistral")
