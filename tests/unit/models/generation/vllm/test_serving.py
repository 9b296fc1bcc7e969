"""Admission handling of the worker core (ChatService) with Gym's real capture and rebuild.

The engine is a scripted stand-in (this is pure request logic); the tokenizer is the real
tiny-model tokenizer; custody goes through Gym's RolloutTokenCapture, CaptureAdmission and
verify_and_linearize, so what these tests accept the real gate and trainer accept too.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import pytest

from examples.arith import task as arith_task
from examples.arith.tiny_model.chat_template import LLAMA3
from examples.arith.tiny_model.corpus import task_conversation
from examples.arith.tiny_model.tokenizer import train_tokenizer
from nemo_gym.token_id_capture.staging import (
    CallRecord,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StageResult,
    staging_key,
    verify_and_linearize,
)
from nemo_rl.data.calls import ServedCall
from nemo_rl.data_plane import MissingKeysError
from nemo_rl.data_plane.errors import DataPlaneTimeoutError
from nemo_rl.data_plane.partitions import StagedKeysMissingError
from nemo_rl.data.errors import ApiError
from nemo_rl.models.generation.vllm.custody_state import PrefixCache, ServedRegistry
from nemo_rl.models.generation.vllm.engine import SamplingRequest
from nemo_rl.models.generation.vllm.chat import context_overflow_message, derive_turn_end, normalize_messages, render_root_prompt
from nemo_rl.models.generation.vllm.lifecycle import build_custody, build_tq_custody
from nemo_rl.models.generation.vllm.serving import ChatService
from nemo_rl.models.generation.vllm.tool_parsers import get_tool_call_parser
from nemo_rl.token_capture.config import TokenCaptureConfig


@pytest.fixture(scope="module")
def tokenizer():
    texts = [json.dumps(task_conversation(p)) for p in arith_task.make_problems(0, 200)]
    return train_tokenizer(texts, vocab_size=600, max_length=2048)


@dataclass(frozen=True)
class _Result:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class ScriptedEngine:
    """Returns scripted generations in order; remembers every prompt it was given."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = list(script)
        self.prompts: list[list[int]] = []
        self.samplings: list = []
        self.weight_version = 3

    async def generate(self, prompt_ids, sampling, request_id):
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        ids = self.script.pop(0)
        return _Result(request_id, list(prompt_ids), ids, [-0.5 - 0.01 * i for i in range(len(ids))], "stop", self.weight_version)


class MemoryStaging:
    """In-memory StagingSink + StagingSource (the TQ one is tested against real TQ elsewhere)."""

    def __init__(self) -> None:
        self.records: dict[str, StagedCallRecord] = {}
        self.fetches: list[list[str]] = []
        self._lock = threading.Lock()

    def stage(self, record, *, attachments=None):
        key = staging_key(record.rollout_id, record.model_call_id)
        with self._lock:
            self.records[key] = record
        return StageResult(ok=True, staging_key=key)

    def fetch(self, keys):
        self.fetches.append(list(keys))
        missing = [k for k in keys if k not in self.records]
        if missing:
            raise StagedKeysMissingError("staging", missing)  # the TQ source's named error
        return [StagedCallBaseSnapshot.model_validate(self.records[k].model_dump(exclude={"extras"})) for k in keys]


def _service(
    tokenizer,
    script,
    *,
    capture=True,
    staging=None,
    max_model_len=2048,
    worker_index=0,
    max_served_rollouts=100_000,
    tool_call_parser="hermes",
):
    engine = ScriptedEngine(script)
    staging = staging if staging is not None else MemoryStaging()
    custody = build_custody(
        staging,
        staging,
        weight_version_fn=lambda: engine.weight_version,
        prefix_cache_max_tokens=100_000,
        vocab_size=len(tokenizer),
        max_admitted_calls=1000,
        worker_index=worker_index,
        max_served_rollouts=max_served_rollouts,
    ) if capture else None
    svc = ChatService(
        engine,
        tokenizer,
        model_name="tiny",
        default_max_tokens=16,
        max_model_len=max_model_len,
        turn_end=derive_turn_end(tokenizer),
        tool_call_parser=get_tool_call_parser(tool_call_parser),
        custody=custody,
    )
    return svc, engine, staging


def _gen(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


PROBLEM = arith_task.Problem("12 + 5", 17)
MESSAGES = [
    {"role": "developer", "content": arith_task.SYSTEM_PROMPT},
    {"role": "user", "content": arith_task.user_prompt(PROBLEM)},
]
TOOLS = [arith_task.CALCULATOR_TOOL]
# What Gym's vllm_model server adds to a legacy (capture-off) request for its token echo.
GYM_ECHO = {"logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
CALL_TEXT = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 5"}}\n</tool_call>'


def _admission(mode, call_id, *, parent=None, prev_len=0, chain=(), parent_hash=None, inline=(), rollout="r1"):
    return {
        "schema_version": 2,
        "rollout_id": rollout,
        "model_call_id": call_id,
        "parent_call_id": parent,
        "prev_len": prev_len,
        "mode": mode,
        "required_prefix_token_ids": list(inline),
        "staging_chain": list(chain),
        "parent_chain_hash": parent_hash,
    }


def _second_turn_messages(first_response):
    msg = first_response["choices"][0]["message"]
    call = msg["tool_calls"][0]
    return MESSAGES + [
        {"role": "assistant", "content": msg["content"], "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "17"},
    ]


def _call_record(coords, response_id, mode):
    return CallRecord(
        model_call_id=coords["model_call_id"],
        parent_call_id=coords["parent_call_id"],
        prev_len=coords["prev_len"],
        delta_len=coords["delta_len"],
        cum_len=coords["cum_len"],
        weight_version=coords["weight_version"],
        digest=coords["digest"],
        extras_digest=coords["extras_digest"],
        staging_key=coords["staging_key"],
        mode=mode,
        chain_hash=coords["chain_hash"],
        cumulative_hash=coords["cumulative_hash"],
        response_id=response_id,
    )


async def test_root_then_token_in_via_staging_chain_verifies(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    svc, engine, staging = _service(tokenizer, [gen1, gen2])

    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    assert c1["disposition"] == "staged"
    root_prompt = render_root_prompt(tokenizer, [{**MESSAGES[0], "role": "system"}, MESSAGES[1]], TOOLS)
    assert engine.prompts[0] == root_prompt
    assert c1["delta_len"] == len(root_prompt) + len(gen1)
    assert r1["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(r1["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"expression": "12 + 5"}

    adm2 = _admission(
        "token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash=c1["chain_hash"]
    )
    r2 = await svc.chat_completions(
        {"messages": _second_turn_messages(r1), "tools": TOOLS, "ng_capture": adm2, "required_prefix_token_ids": []}
    )
    c2 = r2["ng_commit_coords"]
    assert c2["disposition"] == "staged"
    # The second prompt starts with the exact ids of turn 1 (prompt + sampled), not a re-render.
    assert engine.prompts[1][: c1["cum_len"]] == root_prompt + gen1
    tail = tokenizer.decode(engine.prompts[1][c1["cum_len"] :], skip_special_tokens=False)
    assert tail == "\n<|im_start|>tool\n<tool_response>\n17\n</tool_response><|im_end|>\n<|im_start|>assistant\n"

    records = [_call_record(c1, r1["id"], "text"), _call_record(c2, r2["id"], "token_in")]
    receipt = RolloutReceipt(rollout_id="r1", manifest=records, terminal_model_call_id="c2", terminal_selection="declared")
    row = verify_and_linearize(receipt, staging.fetch([c1["staging_key"], c2["staging_key"]]))
    assert row.token_ids == engine.prompts[1] + gen2
    assert [i for i, m in zip(row.token_ids, row.token_mask) if m == 1.0] == gen1 + gen2
    assert row.weight_versions == [3, 3]


@pytest.fixture(scope="module")
def llama3_tokenizer():
    texts = [json.dumps(task_conversation(p)) for p in arith_task.make_problems(0, 200)]
    return train_tokenizer(texts, vocab_size=600, max_length=2048, family=LLAMA3)


@pytest.mark.parametrize("cut", [False, True], ids=["eos_ended", "max_tokens_cut"])
async def test_llama3_family_root_then_token_in_verifies_with_llama3_json(llama3_tokenizer, cut):
    tok = llama3_tokenizer
    call = '{"name": "calculator", "parameters": {"expression": "12 + 5"}}'
    gen1 = tok.encode(call, add_special_tokens=False) + ([] if cut else [tok.eos_token_id])
    gen2 = _gen(tok, "The answer is 17.")
    svc, engine, staging = _service(tok, [gen1, gen2], tool_call_parser="llama3_json")

    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    assert c1["disposition"] == "staged"
    assert r1["choices"][0]["message"]["content"] is None
    assert json.loads(r1["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"expression": "12 + 5"}

    adm2 = _admission(
        "token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash=c1["chain_hash"]
    )
    r2 = await svc.chat_completions({"messages": _second_turn_messages(r1), "tools": TOOLS, "ng_capture": adm2})
    c2 = r2["ng_commit_coords"]
    assert c2["disposition"] == "staged"
    assert engine.prompts[1][: c1["cum_len"]] == engine.prompts[0] + gen1
    tail = tok.decode(engine.prompts[1][c1["cum_len"] :], skip_special_tokens=False)
    assert tail == ("<|eot_id|>" if cut else "") + (
        "<|start_header_id|>ipython<|end_header_id|>\n\n17<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert r2["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 17."}

    records = [_call_record(c1, r1["id"], "text"), _call_record(c2, r2["id"], "token_in")]
    receipt = RolloutReceipt(rollout_id="r1", manifest=records, terminal_model_call_id="c2", terminal_selection="declared")
    row = verify_and_linearize(receipt, staging.fetch([c1["staging_key"], c2["staging_key"]]))
    assert row.token_ids == engine.prompts[1] + gen2


async def test_hermes_parser_leaves_llama3_json_replies_as_text(llama3_tokenizer):
    call = '{"name": "calculator", "parameters": {"expression": "12 + 5"}}'
    svc, _, _ = _service(llama3_tokenizer, [_gen(llama3_tokenizer, call)], capture=False)
    r = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS})
    assert r["choices"][0]["message"] == {"role": "assistant", "content": call}


async def _three_turns(svc):
    """ROOT c1, then token-in c2 and c3 over staging_chain; returns the last reply and the chain of c3."""
    r = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    chain, parent, coords, messages = [], "c1", r["ng_commit_coords"], MESSAGES
    for i in (2, 3):
        chain.append(coords["staging_key"])
        messages = _second_turn_messages(r) if i == 2 else messages + [
            {"role": "assistant", "content": None, "tool_calls": [r["choices"][0]["message"]["tool_calls"][0]]},
            {"role": "tool", "tool_call_id": r["choices"][0]["message"]["tool_calls"][0]["id"], "content": "17"},
        ]
        adm = _admission("token_in", f"c{i}", parent=parent, prev_len=coords["cum_len"], chain=chain, parent_hash=coords["chain_hash"])
        r = await svc.chat_completions({"messages": messages, "tools": TOOLS, "ng_capture": adm})
        coords, parent = r["ng_commit_coords"], f"c{i}"
        assert coords["disposition"] == "staged"
    return r, chain + [coords["staging_key"]]


async def test_a_same_worker_continuation_fetches_nothing(tokenizer):
    gens = [_gen(tokenizer, CALL_TEXT), _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")]
    svc, engine, staging = _service(tokenizer, gens)
    await _three_turns(svc)
    # Each staged delta was seeded into the cache by the call that staged it: turns 2 and 3 fetched nothing.
    assert staging.fetches == []
    assert (svc.custody.prefix_cache.fetched_keys, svc.custody.prefix_cache.seeded_keys, svc.custody.prefix_cache.seed_rejected) == (0, 3, 0)
    assert engine.prompts[2][: len(engine.prompts[1])] == engine.prompts[1]


async def test_a_seeded_entry_is_exactly_what_a_fetch_returns(tokenizer):
    gens = [_gen(tokenizer, CALL_TEXT), _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")]
    svc, _, staging = _service(tokenizer, gens)
    _, chain = await _three_turns(svc)
    last = staging.records[chain[-1]]
    # Another worker (a fresh cache over the same store) resolves the whole chain by fetching each key once.
    fresh = PrefixCache(staging, max_tokens=100_000)
    prefix = fresh.resolve(chain, last.cum_len, last.chain_hash)
    assert staging.fetches == [chain] and fresh.fetched_keys == 3
    assert [fresh.entry(k) for k in chain] == [svc.custody.prefix_cache.entry(k) for k in chain]
    assert prefix == [t for k in chain for t in staging.records[k].token_ids_delta]
    assert svc.custody.prefix_cache.resolve(chain, last.cum_len, last.chain_hash) == prefix  # from the seeded entries


async def test_prefix_cache_fetches_each_parent_once(tokenizer):
    gens = [_gen(tokenizer, CALL_TEXT), _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")]
    svc, _, staging = _service(tokenizer, gens)
    svc.custody.prefix_cache.seed = lambda key, **entry: True  # a worker that never seeds: every parent comes from the store
    await _three_turns(svc)
    # Turn 3 needed keys c1 and c2 but fetched only c2: c1 was cached when turn 2 resolved it.
    assert staging.fetches == [["r1/c1"], ["r1/c2"]]
    assert svc.custody.prefix_cache.fetched_keys == 2


async def test_admitted_replies_carry_no_token_echo(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    svc, engine, staging = _service(tokenizer, [gen1, gen2])
    echo = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, **echo, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    adm2 = _admission("token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash=c1["chain_hash"])
    r2 = await svc.chat_completions({"messages": _second_turn_messages(r1), "tools": TOOLS, **echo, "ng_capture": adm2})
    for reply, gen in ((r1, gen1), (r2, gen2)):
        assert set(reply) == {"id", "object", "created", "model", "choices", "usage", "ng_commit_coords"}
        [choice] = reply["choices"]
        assert set(choice) == {"index", "message", "finish_reason", "logprobs"} and choice["logprobs"] is None
        assert reply["usage"]["completion_tokens"] == len(gen)
    # The ids and logprobs are in the staged records, exactly as the engine produced them.
    rec1, rec2 = staging.records["r1/c1"], staging.records["r1/c2"]
    assert rec1.token_ids_delta == engine.prompts[0] + gen1
    assert rec2.token_ids_delta == engine.prompts[1][c1["cum_len"] :] + gen2
    assert rec2.generation_log_probs_delta[-len(gen2) :] == [-0.5 - 0.01 * i for i in range(len(gen2))]
    assert rec2.token_mask_delta == [0.0] * (len(engine.prompts[1]) - c1["cum_len"]) + [1.0] * len(gen2)


async def test_plain_calls_on_a_capture_worker_still_echo(tokenizer):
    gen = _gen(tokenizer, "The answer is 17.")
    svc, engine, _ = _service(tokenizer, [gen])
    r = await svc.chat_completions({"messages": MESSAGES, **GYM_ECHO})
    assert r["prompt_token_ids"] == engine.prompts[0] and r["choices"][0]["token_ids"] == gen
    assert [c["token"] for c in r["choices"][0]["logprobs"]["content"]] == [f"token_id:{t}" for t in gen]


class CountingCapture:
    """Gym's capture core with its begin_call counted (everything else passes through)."""

    def __init__(self, inner):
        self.inner = inner
        self.begin_calls: list[int] = []

    def begin_call(self, admission, **kwargs):
        self.begin_calls.append(kwargs["weight_version"])
        return self.inner.begin_call(admission, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RefitDuringGeneration(ScriptedEngine):
    """The weights change between admission and generation (a refit landed in between)."""

    async def generate(self, prompt_ids, sampling, request_id):
        self.weight_version += 1
        return await super().generate(prompt_ids, sampling, request_id)


async def test_one_admission_check_and_the_generations_weight_version_is_staged(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    svc, _, staging = _service(tokenizer, [])
    engine = RefitDuringGeneration([gen1, gen2])
    svc._engine = engine
    counting = CountingCapture(svc.custody.capture)
    svc.custody.install_token_capture(counting)
    r1, r2 = await _root_then_token_in(svc, engine)
    # One begin_call per admitted call, at the version current at admission (3, then 4) ...
    assert counting.begin_calls == [3, 4]
    # ... and each call is staged with the version its generation ran under (4, then 5).
    assert [r["ng_commit_coords"]["weight_version"] for r in (r1, r2)] == [4, 5]
    assert [staging.records[k].weight_version for k in ("r1/c1", "r1/c2")] == [4, 5]


async def test_an_admission_gym_refuses_is_400_before_generation_and_may_be_retried(tokenizer):
    gen1 = _gen(tokenizer, CALL_TEXT)
    svc, engine, staging = _service(tokenizer, [gen1, _gen(tokenizer, "The answer is 17.")])
    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    body = {"messages": _second_turn_messages(r1), "tools": TOOLS}
    conflicting = _admission("token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]],
                             parent_hash=c1["chain_hash"], inline=[1] * c1["cum_len"])
    with pytest.raises(ApiError) as e:
        await svc.chat_completions({**body, "ng_capture": conflicting})
    assert (e.value.status, e.value.err_type, e.value.param) == (400, "invalid_capture_admission", "ng_capture")
    assert e.value.message == "rollout r1 call c2: prefix_token_ids conflict with the admission's inline prefix"
    assert len(engine.prompts) == 1 and list(staging.records) == ["r1/c1"]
    assert [c.model_call_id for c in svc.take_served(["r1"])] == ["c1"]
    ok = _admission("token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash=c1["chain_hash"])
    assert (await svc.chat_completions({**body, "ng_capture": ok}))["ng_commit_coords"]["disposition"] == "staged"


async def test_token_in_with_inline_prefix(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    svc, engine, _ = _service(tokenizer, [gen1, gen2])
    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    prefix = engine.prompts[0] + gen1
    adm = _admission("token_in", "c2", parent="c1", prev_len=len(prefix), parent_hash=c1["chain_hash"], inline=prefix)
    r2 = await svc.chat_completions({"messages": _second_turn_messages(r1), "tools": TOOLS, "ng_capture": adm})
    assert r2["ng_commit_coords"]["disposition"] == "staged"
    assert engine.prompts[1][: len(prefix)] == prefix


@pytest.mark.parametrize(
    "admission, err_type",
    [
        ({"mode": "text"}, "invalid_capture_admission"),
        (_admission("token_in", "c2", parent=None, prev_len=5, chain=["r1/c1"], parent_hash="ab"), "invalid_capture_admission"),
        (_admission("token_in", "c2", parent="c1", prev_len=3, parent_hash="ab" * 32, inline=[1, 2]), "invalid_capture_admission"),
    ],
)
async def test_invalid_admission_is_400(tokenizer, admission, err_type):
    svc, engine, _ = _service(tokenizer, [[1]])
    with pytest.raises(ApiError) as e:
        await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": admission})
    assert (e.value.status, e.value.err_type) == (400, err_type)
    assert engine.prompts == []  # nothing was generated


async def test_admission_without_installed_capture_is_400(tokenizer):
    svc, _, _ = _service(tokenizer, [[1]], capture=False)
    with pytest.raises(ApiError) as e:
        await svc.chat_completions({"messages": MESSAGES, "ng_capture": _admission("text", "c1")})
    assert e.value.status == 400 and e.value.err_type == "capture_not_installed"
    assert "token_capture.enabled=true" in e.value.message


async def test_bad_stream_and_n_are_rejected(tokenizer):
    svc, _, _ = _service(tokenizer, [[1]])
    for body, needle in (({"stream": "yes"}, "stream must be a boolean"), ({"n": 2}, "n must be 1")):
        with pytest.raises(ApiError) as e:
            await svc.chat_completions({"messages": MESSAGES, **body})
        assert e.value.status == 400 and needle in e.value.message


async def test_missing_staged_parent_is_503_and_bad_hash_is_409(tokenizer):
    gen1 = _gen(tokenizer, CALL_TEXT)
    svc, engine, _ = _service(tokenizer, [gen1, [1]])
    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    body = {"messages": _second_turn_messages(r1), "tools": TOOLS}
    missing = _admission("token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=["r1/nope"], parent_hash=c1["chain_hash"])
    with pytest.raises(ApiError) as e:
        await svc.chat_completions({**body, "ng_capture": missing})
    assert e.value.status == 503 and "r1/nope" in e.value.message
    bad = _admission("token_in", "c3", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash="0" * 64)
    with pytest.raises(ApiError) as e:
        await svc.chat_completions({**body, "ng_capture": bad})
    assert e.value.status == 409 and e.value.err_type == "prefix_mismatch"
    assert len(engine.prompts) == 1


async def test_capture_off_serves_legacy_token_echo(tokenizer):
    gen = _gen(tokenizer, "The answer is 17.")
    svc, engine, _ = _service(tokenizer, [gen, gen], capture=False)
    r = await svc.chat_completions({"messages": MESSAGES, **GYM_ECHO})
    assert r["prompt_token_ids"] == engine.prompts[0]
    assert set(r) == {"id", "object", "created", "model", "choices", "usage", "prompt_token_ids"}
    choice = r["choices"][0]
    assert set(choice) == {"index", "message", "finish_reason", "logprobs", "token_ids"}
    assert choice["token_ids"] == gen
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in gen]
    assert choice["message"]["content"] == "The answer is 17."
    assert "ng_commit_coords" not in r
    # Without return_tokens_as_token_ids vLLM names each logprob entry by its token's text.
    named = await svc.chat_completions({"messages": MESSAGES, "logprobs": True, "top_logprobs": 0})
    tokens = [c["token"] for c in named["choices"][0]["logprobs"]["content"]]
    assert tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in gen] and tokens[-1] == "<|im_end|>"
    assert "".join(tokens[:-1]) == "The answer is 17."


async def test_plain_calls_parse_tool_calls_only_when_tools_are_offered(tokenizer):
    # vLLM's rule: without tools, or with tool_choice="none", a <tool_call> block is plain content.
    gen = _gen(tokenizer, CALL_TEXT)
    svc, _, _ = _service(tokenizer, [gen, gen, gen], capture=False)
    offered = (await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS}))["choices"][0]
    assert offered["finish_reason"] == "tool_calls" and offered["message"]["content"] is None
    assert [c["function"]["name"] for c in offered["message"]["tool_calls"]] == ["calculator"]
    for body in ({"messages": MESSAGES}, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}):
        choice = (await svc.chat_completions(body))["choices"][0]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == CALL_TEXT


async def test_tail_render_failure_is_capture_failed_not_silent(tokenizer):
    gen1 = _gen(tokenizer, CALL_TEXT)
    svc, _, staging = _service(tokenizer, [gen1, [5, tokenizer.eos_token_id]])
    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    adm = _admission("token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash=c1["chain_hash"])
    # No assistant turn in the history: the tail cannot be placed after the parent's tokens.
    r2 = await svc.chat_completions({"messages": MESSAGES + [{"role": "user", "content": "again"}], "tools": TOOLS, "ng_capture": adm})
    assert r2["ng_commit_coords"]["disposition"] == "capture_failed"
    assert r2["ng_commit_coords"]["staging_key"] is None
    assert svc.stats["capture_failed"] == 1
    assert svc.custody.capture_failures[-1]["model_call_id"] == "c2"
    assert "tail_render_failed" in svc.custody.capture_failures[-1]["reason"]
    assert "r1/c2" not in staging.records


# --- the HTTP transport (http.py) --------------------------------------------------------------


async def test_http_routes_answer_503_until_the_service_is_let_through(tokenizer):
    from aiohttp import ClientSession

    from nemo_rl.models.generation.vllm.http import Endpoint, build_app, serve

    svc, engine, _ = _service(tokenizer, [_gen(tokenizer, "The answer is 17.")], capture=False)
    endpoint = Endpoint()
    runner, port = await serve(
        build_app(endpoint, model_name="tiny", max_model_len=2048, max_request_bytes=1 << 20, control_token="t0k")
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with ClientSession() as http:
            for method, path, body in [
                ("GET", "/health", None),
                ("POST", "/v1/chat/completions", {"messages": MESSAGES}),
                ("POST", "/tokenize", {"messages": MESSAGES}),
            ]:
                async with http.request(method, base + path, json=body) as resp:
                    assert (resp.status, (await resp.json())["error"]["type"]) == (503, "worker_starting"), path
            assert engine.prompts == []

            endpoint.service = svc
            async with http.get(base + "/health") as resp:
                assert (resp.status, await resp.json()) == (200, {"status": "ok"})
            async with http.post(base + "/v1/chat/completions", json={"messages": MESSAGES}) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["message"]["content"] == "The answer is 17."
            async with http.post(base + "/v1/chat/completions", data=b"{not json") as resp:
                assert (resp.status, (await resp.json())["error"]["type"]) == (400, "invalid_json")
    finally:
        await runner.cleanup()
    assert len(engine.prompts) == 1


# --- the served-call witness (ServedCall registry) ----------------------------------------------


class RejectingStaging(MemoryStaging):
    """A sink that answers every write with a failed StageResult (the store is down)."""

    def stage(self, record, *, attachments=None):
        return StageResult(ok=False, error="store down")


async def _root_then_token_in(svc, engine, rollout="r1"):
    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1", rollout=rollout)})
    c1 = r1["ng_commit_coords"]
    adm2 = _admission(
        "token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash=c1["chain_hash"], rollout=rollout
    )
    r2 = await svc.chat_completions({"messages": _second_turn_messages(r1), "tools": TOOLS, "ng_capture": adm2})
    return r1, r2


async def test_served_records_root_and_token_in_exactly(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    svc, engine, _ = _service(tokenizer, [gen1, gen2], worker_index=2)
    _, r2 = await _root_then_token_in(svc, engine)
    assert r2["ng_commit_coords"]["disposition"] == "staged"
    assert svc.take_served(["r1"]) == [
        ServedCall("r1", "c1", None, "text", generated_tokens=len(gen1), staged=True, failure=None, worker_index=2),
        ServedCall("r1", "c2", "c1", "token_in", generated_tokens=len(gen2), staged=True, failure=None, worker_index=2),
    ]
    assert svc.take_served(["r1"]) == []  # popped
    assert svc.stats["served_calls"] == 2


async def test_a_text_admission_over_a_history_with_assistant_turns_is_an_unresolved_continuation(tokenizer):
    # The gate found no parent for c3 (the harness edited c1's reply) and admitted it as a new root:
    # the worker sees the assistant turn in the messages it renders and says so in its report.
    gen1, gen2, gen3 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17."), _gen(tokenizer, "17.")
    svc, engine, _ = _service(tokenizer, [gen1, gen2, gen3])
    r1, _ = await _root_then_token_in(svc, engine)
    edited = _second_turn_messages(r1)
    edited[2] = {**edited[2], "content": "I will use the calculator."}
    await svc.chat_completions({"messages": edited, "tools": TOOLS, "ng_capture": _admission("text", "c3")})

    assert [(c.model_call_id, c.mode, c.unresolved_continuation) for c in svc.take_served(["r1"])] == [
        ("c1", "text", False), ("c2", "token_in", False), ("c3", "text", True)]


async def test_staging_failure_is_served_but_not_staged(tokenizer):
    gen1 = _gen(tokenizer, CALL_TEXT)
    svc, _, staging = _service(tokenizer, [gen1], staging=RejectingStaging())
    r = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    assert r["ng_commit_coords"]["disposition"] == "capture_failed"
    assert staging.records == {}
    [served] = svc.take_served(["r1"])
    assert (served.staged, served.failure, served.generated_tokens) == (False, "staging_failed (see worker log)", len(gen1))


class GatedPlane:
    """An in-memory data plane (put / put_many / get / clear) whose batched writes can be held or failed.

    Rows go through the real TQ row codec (`TQTokenSink` / `TQTokenSource`); only the transport is fake.
    """

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}
        self.batches: list[list[str]] = []
        self.gets: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next: list[BaseException] = []

    def put_many(self, partition, keys, rows, *, timeout_s=None):
        assert self.gate.wait(10), "test plane gate never opened"
        self.batches.append(list(keys))
        if self.fail_next:
            raise self.fail_next.pop(0)
        self.rows.update({k: dict(r) for k, r in zip(keys, rows)})

    def put(self, partition, key, fields, *, timeout_s=None):
        self.rows[key] = dict(fields)

    def get(self, partition, keys, fields, *, timeout_s=None):
        self.gets.append(list(keys))
        missing = [k for k in keys if k not in self.rows]
        if missing:
            raise MissingKeysError(partition, missing)
        return [{f: self.rows[k][f] for f in fields} for k in keys]

    def clear(self, partition, keys, *, timeout_s=None):
        for k in keys:
            self.rows.pop(k, None)


STAGE_TIMEOUT_S = 0.3


def _behind(tokenizer, script, plane=None, **kw):
    """A worker core built as the worker builds it under write-behind staging (`build_tq_custody`)."""
    svc, engine, _ = _service(tokenizer, script, capture=False, **kw)
    plane = plane if plane is not None else GatedPlane()
    cfg = TokenCaptureConfig(enabled=True, stage_timeout_s=STAGE_TIMEOUT_S, staging_partition="p")
    custody = build_tq_custody(plane, cfg, weight_version_fn=lambda: engine.weight_version,
                               vocab_size=len(tokenizer), max_admitted_calls=1000)
    svc.custody = custody.core
    return svc, engine, plane, custody.writer


def _child(r1, call_id="c2", *, inline=None):
    c1 = r1["ng_commit_coords"]
    if inline is not None:
        adm = _admission("token_in", call_id, parent="c1", prev_len=c1["cum_len"], parent_hash=c1["chain_hash"],
                         inline=inline)
    else:
        adm = _admission("token_in", call_id, parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]],
                         parent_hash=c1["chain_hash"])
    return {"messages": _second_turn_messages(r1), "tools": TOOLS, "ng_capture": adm}


async def _root(svc):
    return await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})


async def test_a_row_lost_behind_the_reply_turns_its_call_unstaged_in_the_served_report(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    svc, engine, plane, writer = _behind(tokenizer, [gen1, gen2])
    error = DataPlaneTimeoutError("put", "p", STAGE_TIMEOUT_S)
    r1 = await _root(svc)
    assert writer.flush(["r1"], 5.0) == {}
    plane.fail_next.append(error)
    r2 = await svc.chat_completions(_child(r1))
    assert r2["ng_commit_coords"]["disposition"] == "staged"  # the reply left before the write
    root, child = svc.take_served(["r1"])
    why = f"staging write failed: DataPlaneTimeoutError: {error}"
    assert (root.staged, root.failure) == (True, None)
    assert (child.staged, child.failure) == (False, why)
    assert svc.stats["capture_failed"] == 1
    assert list(svc.custody.capture_failures) == [{"rollout_id": "r1", "model_call_id": "c2", "reason": why}]


async def test_a_parent_enters_the_prefix_cache_only_once_its_row_is_written(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    svc, engine, plane, writer = _behind(tokenizer, [gen1, gen2])
    plane.gate.clear()  # a slow write
    r1 = await _root(svc)
    assert r1["ng_commit_coords"]["disposition"] == "staged"
    assert svc.custody.prefix_cache.entry("r1/c1") is None  # queued, not durable: not a parent yet
    plane.gate.set()
    assert writer.flush(["r1"], 5.0) == {}
    assert svc.custody.prefix_cache.entry("r1/c1") is not None and svc.custody.prefix_cache.seeded_keys == 1
    r2 = await svc.chat_completions(_child(r1))
    assert r2["ng_commit_coords"]["disposition"] == "staged"
    assert plane.gets == []  # the same-worker child read nothing: its parent was seeded once durable
    assert engine.prompts[1][: r1["ng_commit_coords"]["cum_len"]] == engine.prompts[0] + gen1


@pytest.mark.parametrize("inline", [False, True], ids=["staging_chain", "inline_prefix"])
async def test_a_child_waits_for_its_parents_slow_write_then_is_generated(tokenizer, inline):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    svc, engine, plane, writer = _behind(tokenizer, [gen1, gen2])
    plane.gate.clear()
    r1 = await _root(svc)
    threading.Timer(0.1, plane.gate.set).start()  # lands within the parents' wait
    r2 = await svc.chat_completions(_child(r1, inline=engine.prompts[0] + gen1 if inline else None))
    assert r2["ng_commit_coords"]["disposition"] == "staged"
    assert plane.batches[0] == ["r1/c1"] and "r1/c1" in plane.rows
    assert writer.stats["parent_waits"] == 2  # the quick check found it pending, the bounded wait saw it land


@pytest.mark.parametrize("inline", [False, True], ids=["staging_chain", "inline_prefix"])
@pytest.mark.parametrize("fault", ["slow", "failed"])
async def test_a_child_of_a_parent_row_that_is_not_durable_is_refused_before_generation(tokenizer, inline, fault):
    gen1 = _gen(tokenizer, CALL_TEXT)
    svc, engine, plane, _ = _behind(tokenizer, [gen1, _gen(tokenizer, "never generated")])
    error = DataPlaneTimeoutError("put", "p", STAGE_TIMEOUT_S)
    if fault == "slow":
        plane.gate.clear()
    else:
        plane.fail_next.append(error)
    r1 = await _root(svc)
    param = "ng_capture.required_prefix_token_ids" if inline else "ng_capture.staging_chain"
    where = "inline prefix of call c2" if inline else "staging_chain of call c2"
    why = (f"staging write not finished within token_capture.stage_timeout_s={STAGE_TIMEOUT_S}s" if fault == "slow"
           else f"staging write failed: DataPlaneTimeoutError: {error}")
    with pytest.raises(ApiError) as e:
        await svc.chat_completions(_child(r1, inline=engine.prompts[0] + gen1 if inline else None))
    plane.gate.set()
    assert (e.value.status, e.value.err_type, e.value.param) == (503, "staging_unavailable", param)
    assert e.value.message == (
        f"{where}: parent row(s) this worker staged are not durable, so no child is generated from them: r1/c1: {why}")
    assert len(engine.prompts) == 1  # the child was never generated
    assert svc.stats["parents_not_durable"] == 1


@pytest.mark.parametrize("inline", [False, True], ids=["staging_chain", "inline_prefix"])
async def test_a_lost_parent_stays_refused_after_the_served_report_took_its_failure(tokenizer, inline):
    gen1 = _gen(tokenizer, CALL_TEXT)
    svc, engine, plane, _ = _behind(tokenizer, [gen1, _gen(tokenizer, "never generated")])
    plane.fail_next.append(DataPlaneTimeoutError("put", "p", STAGE_TIMEOUT_S))
    r1 = await _root(svc)
    [root] = svc.take_served(["r1"])  # the report names the lost row ...
    assert root.staged is False
    with pytest.raises(ApiError) as e:  # ... and a straggling child of it is still refused
        await svc.chat_completions(_child(r1, inline=engine.prompts[0] + gen1 if inline else None))
    assert (e.value.status, e.value.err_type) == (503, "staging_unavailable")
    assert "r1/c1: staging write failed" in e.value.message
    assert len(engine.prompts) == 1 and svc.custody.prefix_cache.entry("r1/c1") is None


async def test_a_row_the_report_deadline_abandoned_is_never_a_parent_even_if_it_lands(tokenizer):
    gen1 = _gen(tokenizer, CALL_TEXT)
    svc, engine, plane, writer = _behind(tokenizer, [gen1, _gen(tokenizer, "never generated")])
    plane.gate.clear()  # a write slower than the report's deadline
    r1 = await _root(svc)
    [root] = svc.take_served(["r1"])
    assert root.staged is False and "abandoned in its write" in root.failure
    plane.gate.set()
    while writer.stats["late_rows_landed"] == 0:
        await asyncio.sleep(0.01)
    assert "r1/c1" in plane.rows  # it landed after all, after the report called it lost
    with pytest.raises(ApiError) as e:
        await svc.chat_completions(_child(r1))
    assert (e.value.status, e.value.err_type) == (503, "staging_unavailable")
    assert len(engine.prompts) == 1 and svc.custody.prefix_cache.entry("r1/c1") is None


async def test_an_inline_parent_staged_by_another_worker_is_read_before_the_child_is_generated(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), _gen(tokenizer, "The answer is 17.")
    plane = GatedPlane()
    svc_a, engine_a, _, writer_a = _behind(tokenizer, [gen1], plane)
    svc_b, engine_b, _, _ = _behind(tokenizer, [gen2, gen2], plane)
    plane.gate.clear()
    r1 = await _root(svc_a)
    prefix = engine_a.prompts[0] + gen1
    # Worker B cannot vouch for A's row: it reads it (re-reading a missing key, bounded), and the row is not there.
    with pytest.raises(ApiError) as e:
        await svc_b.chat_completions(_child(r1, inline=prefix))
    assert (e.value.status, e.value.err_type, e.value.param) == (
        503, "staging_unavailable", "ng_capture.required_prefix_token_ids")
    assert "StagedKeysMissingError" in e.value.message and engine_b.prompts == []
    plane.gate.set()
    assert writer_a.flush(["r1"], 5.0) == {}
    r2 = await svc_b.chat_completions(_child(r1, "c3", inline=prefix))
    assert r2["ng_commit_coords"]["disposition"] == "staged" and engine_b.prompts[0][: len(prefix)] == prefix
    # An inline admission whose prev_len disagrees with the staged parent is refused.
    bad = _child(r1, "c4", inline=prefix[:-1])
    bad["ng_capture"]["prev_len"] = len(prefix) - 1
    with pytest.raises(ApiError) as e:
        await svc_b.chat_completions(bad)
    assert (e.value.status, e.value.err_type) == (409, "prefix_mismatch")
    assert len(engine_b.prompts) == 1


async def test_tail_render_failure_is_served_with_its_reason(tokenizer):
    gen1, gen2 = _gen(tokenizer, CALL_TEXT), [5, tokenizer.eos_token_id]
    svc, _, _ = _service(tokenizer, [gen1, gen2])
    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    adm = _admission("token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash=c1["chain_hash"])
    await svc.chat_completions({"messages": MESSAGES + [{"role": "user", "content": "again"}], "tools": TOOLS, "ng_capture": adm})
    root, child = svc.take_served(["r1"])
    assert root.staged and root.failure is None
    assert (child.parent_call_id, child.staged, child.generated_tokens) == ("c1", False, 2)
    assert child.failure.startswith("tail_render_failed")


async def test_plain_calls_record_nothing(tokenizer):
    svc, _, _ = _service(tokenizer, [_gen(tokenizer, "The answer is 17.")])
    await svc.chat_completions({"messages": MESSAGES})
    assert svc.custody.served_rollouts_pending() == 0
    assert svc.take_served(["r1"]) == []
    assert (svc.stats["plain_calls"], svc.stats["served_calls"]) == (1, 1)


async def test_take_served_pops_exactly_the_asked_rollouts(tokenizer):
    svc, _, _ = _service(tokenizer, [[7, tokenizer.eos_token_id]] * 3)
    for rid in ("ra", "rb", "rc"):
        await svc.chat_completions({"messages": MESSAGES, "ng_capture": _admission("text", "c1", rollout=rid)})
    assert [c.rollout_id for c in svc.take_served(["rc", "unknown", "ra"])] == ["rc", "ra"]
    assert svc.take_served(["ra", "rc"]) == []
    assert [c.rollout_id for c in svc.take_served(["rb"])] == ["rb"]
    assert svc.custody.served_rollouts_pending() == 0


async def test_served_registry_is_bounded_and_counts_evictions(tokenizer):
    svc, _, _ = _service(tokenizer, [[7, tokenizer.eos_token_id]] * 4, max_served_rollouts=2)
    for rid, call in (("ra", "c1"), ("rb", "c1"), ("ra", "c2"), ("rc", "c1")):
        adm = _admission("text", call, rollout=rid)  # two roots in "ra": the registry does not judge lineage
        await svc.chat_completions({"messages": MESSAGES, "ng_capture": adm})
    # "ra" was written after "rb", so "rb" is the least recently written rollout and goes first.
    assert svc.stats["served_evicted_rollouts"] == 1
    assert svc.take_served(["rb"]) == []
    assert [(c.rollout_id, c.model_call_id) for c in svc.take_served(["ra", "rc"])] == [("ra", "c1"), ("ra", "c2"), ("rc", "c1")]


def test_served_registry_rejects_a_zero_bound():
    with pytest.raises(ValueError, match="max_rollouts"):
        ServedRegistry(0)


# --- context overflow: vLLM's 400, before any capture step --------------------------------------


GYM_CONTEXT_SUBSTRING = "context length"  # responses_api_models/vllm_model/app.py: is_out_of_context_length


def _root_prompt_len(tokenizer):
    return len(render_root_prompt(tokenizer, normalize_messages(MESSAGES), TOOLS))


@pytest.mark.parametrize("admitted", [False, True])
async def test_prompt_beyond_max_model_len_is_400_and_nothing_is_recorded(tokenizer, admitted):
    n = _root_prompt_len(tokenizer)
    svc, engine, staging = _service(tokenizer, [[1]], max_model_len=n)  # no room for a single token
    body = {"messages": MESSAGES, "tools": TOOLS}
    if admitted:
        body["ng_capture"] = _admission("text", "c1")
    with pytest.raises(ApiError) as e:
        await svc.chat_completions(body)
    assert (e.value.status, e.value.err_type) == (400, "context_length_exceeded")
    assert e.value.message.startswith(f"This model's maximum context length is {n} tokens. However, you requested {n} tokens")
    assert GYM_CONTEXT_SUBSTRING in json.dumps(e.value.body())
    assert engine.prompts == [] and staging.records == {}
    assert svc.take_served(["r1"]) == [] and svc.stats["served_calls"] == 0


async def test_explicit_max_tokens_beyond_the_room_is_400_default_is_clipped(tokenizer):
    n = _root_prompt_len(tokenizer)
    svc, engine, _ = _service(tokenizer, [[7, tokenizer.eos_token_id]] * 2, max_model_len=n + 10)
    too_long = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 11, "ng_capture": _admission("text", "c1")}
    with pytest.raises(ApiError) as e:
        await svc.chat_completions(too_long)
    assert e.value.status == 400
    assert e.value.message.startswith(
        f"This model's maximum context length is {n + 10} tokens. "
        f"However, you requested {n + 11} tokens ({n} in the messages, 11 in the completion)."
    )
    assert engine.prompts == [] and svc.take_served(["r1"]) == []
    await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "max_tokens": 10})  # fits exactly
    await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS})  # default 16, clipped to the room
    assert [s.max_tokens for s in engine.samplings] == [10, 10]


async def test_token_in_overflow_is_400_before_begin_call(tokenizer):
    gen1 = _gen(tokenizer, CALL_TEXT)
    n = _root_prompt_len(tokenizer)
    svc, engine, staging = _service(tokenizer, [gen1, [1]], max_model_len=n + len(gen1) + 2)
    r1 = await svc.chat_completions({"messages": MESSAGES, "tools": TOOLS, "ng_capture": _admission("text", "c1")})
    c1 = r1["ng_commit_coords"]
    adm = _admission("token_in", "c2", parent="c1", prev_len=c1["cum_len"], chain=[c1["staging_key"]], parent_hash=c1["chain_hash"])
    with pytest.raises(ApiError) as e:
        await svc.chat_completions({"messages": _second_turn_messages(r1), "tools": TOOLS, "ng_capture": adm})
    assert e.value.status == 400 and "maximum context length" in e.value.message
    assert len(engine.prompts) == 1 and list(staging.records) == ["r1/c1"]
    assert [c.model_call_id for c in svc.take_served(["r1"])] == ["c1"]


async def test_http_context_overflow_body_matches_gyms_check(tokenizer):
    from aiohttp import ClientSession

    from nemo_rl.models.generation.vllm.http import Endpoint, build_app, serve

    svc, engine, _ = _service(tokenizer, [[1]], capture=False, max_model_len=8)
    endpoint = Endpoint()
    endpoint.service = svc
    runner, port = await serve(build_app(endpoint, model_name="tiny", max_model_len=8, max_request_bytes=1 << 20, control_token="t"))
    try:
        async with ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"messages": MESSAGES}) as resp:
                raw = await resp.read()
                # Gym's gate: e.status == 400 and "context length" in e.response_content.decode()
                assert resp.status == 400 and GYM_CONTEXT_SUBSTRING in raw.decode()
                assert json.loads(raw)["error"]["type"] == "context_length_exceeded"
    finally:
        await runner.cleanup()
    assert engine.prompts == []


def test_context_overflow_message_follows_vllm():
    assert context_overflow_message(10, None, 11) is None
    assert context_overflow_message(10, 1, 11) is None
    assert "you requested 11 tokens in the messages" in context_overflow_message(11, None, 11)
    assert "you requested 12 tokens (10 in the messages, 2 in the completion)" in context_overflow_message(10, 2, 11)


# --- the worker actor shell (no Ray, no vLLM: a service set by hand) ----------------------------


async def test_worker_take_served_returns_wire_dicts_and_counts_calls(tokenizer):
    from nemo_rl.models.generation.vllm.config import GenerationConfig
    from nemo_rl.models.generation.vllm.errors import WorkerError
    from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker

    worker = VllmGenerationWorker("/nonexistent", GenerationConfig().model_dump(), {}, None, worker_index=1)
    with pytest.raises(WorkerError, match="take_served called before start"):
        await worker.take_served(["r1"])
    svc, _, _ = _service(tokenizer, [[7, tokenizer.eos_token_id]] * 2, worker_index=1)
    worker._service = svc
    await svc.chat_completions({"messages": MESSAGES, "ng_capture": _admission("text", "c1")})
    await svc.chat_completions({"messages": MESSAGES})
    stats = worker.capture_stats()
    assert (stats["worker_index"], stats["served_calls"], stats["served_rollouts_pending"]) == (1, 2, 1)
    wire = await worker.take_served(["r1"])
    assert wire == [ServedCall("r1", "c1", None, "text", 2, True, None, 1).to_wire()]
    assert await worker.take_served(["r1"]) == []


def _record_commit_threads(svc) -> list[int]:
    threads: list[int] = []
    inner = svc.custody.capture.complete_call_from_response

    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return inner(*args, **kwargs)

    svc.custody.capture.complete_call_from_response = recording
    return threads


async def test_the_commit_runs_on_the_loop_behind_the_reply_and_off_it_before_the_reply(tokenizer):
    # Behind the reply the commit only queues the row: a thread hop would cost more than the work.
    # Before the reply the commit includes the blocking data-plane write: it must leave the loop.
    loop_thread = threading.get_ident()
    behind, _, _, writer = _behind(tokenizer, [_gen(tokenizer, CALL_TEXT)])
    behind_threads = _record_commit_threads(behind)
    await _root(behind)
    assert writer.flush(["r1"], 5.0) == {}
    before, _, _ = _service(tokenizer, [_gen(tokenizer, CALL_TEXT)])
    before_threads = _record_commit_threads(before)
    await _root(before)
    assert behind_threads == [loop_thread]
    assert len(before_threads) == 1 and before_threads[0] != loop_thread


# --- the custody core on its own: driven step by step, no service to call back ----------------


async def test_custody_opens_plans_and_finishes_a_call_without_a_service_and_replays_a_resend(tokenizer):
    staging = MemoryStaging()
    custody = build_custody(staging, staging, weight_version_fn=lambda: 5, prefix_cache_max_tokens=1000,
                            vocab_size=len(tokenizer), max_admitted_calls=10)
    body = {"messages": MESSAGES, "ng_capture": _admission("text", "c1")}
    opening = await custody.open(body, body["ng_capture"])
    assert (opening.key, opening.prefix, opening.replay) == (("r1", "c1"), None, None)
    sampling = SamplingRequest(temperature=1.0, top_p=1.0, max_tokens=4, seed=None, logprobs=False,
                               return_token_ids=False)
    plan = custody.plan(opening, prompt_ids=[1, 2, 3], tail_error=None, sampling=sampling, weight_version=5,
                        history_has_assistant_turn=False)
    assert (plan.key, plan.prompt_ids, plan.sampling) == (("r1", "c1"), [1, 2, 3], sampling)
    result = _Result("chatcmpl-1", [1, 2, 3], [7, tokenizer.eos_token_id], [-0.5, -0.25], "stop", 5)
    reply = await custody.finish(plan, result, {"id": "chatcmpl-1", "object": "chat.completion"})
    coords = reply["ng_commit_coords"]
    assert (reply["id"], coords["disposition"], coords["staging_key"], coords["cum_len"]) == (
        "chatcmpl-1", "staged", "r1/c1", 5)
    assert list(staging.records) == ["r1/c1"] and custody.stats["text_calls"] == 1
    # A byte-identical re-send opens as the committed reply: nothing planned, generated or staged again.
    again = await custody.open(body, body["ng_capture"])
    assert (again.admission, again.prefix, again.replay) == (None, None, reply)
    assert custody.stats["replayed_calls"] == 1 and list(staging.records) == ["r1/c1"]
    [served] = custody.take_served(["r1"])
    assert (served.model_call_id, served.generated_tokens, served.staged) == ("c1", 2, True)


async def test_custody_frees_a_released_id_and_spoils_an_abandoned_one(tokenizer):
    staging = MemoryStaging()
    custody = build_custody(staging, staging, weight_version_fn=lambda: 0, prefix_cache_max_tokens=1000,
                            vocab_size=len(tokenizer), max_admitted_calls=10)
    body = {"messages": MESSAGES, "ng_capture": _admission("text", "c1")}
    custody.release(await custody.open(body, body["ng_capture"]))  # not generated: the id is free again
    opening = await custody.open(body, body["ng_capture"])
    sampling = SamplingRequest(temperature=1.0, top_p=1.0, max_tokens=4, seed=None, logprobs=False,
                               return_token_ids=False)
    plan = custody.plan(opening, prompt_ids=[1, 2], tail_error=None, sampling=sampling, weight_version=0,
                        history_has_assistant_turn=False)
    custody.abandon(plan, 3, "client_disconnected")
    with pytest.raises(ApiError) as e:
        await custody.open(body, body["ng_capture"])
    assert e.value.status == 409 and "was generated by this worker but never answered" in e.value.message
    [served] = custody.take_served(["r1"])
    assert (served.generated_tokens, served.staged, served.failure) == (3, False, "client_disconnected")
    assert staging.records == {}
