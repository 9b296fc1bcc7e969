"""Flag-off identity: with capture off, our worker answers as stock vLLM's OpenAI server does.

With `token_capture.enabled=false` the worker serves chat completions from its own plain path
(`ChatService._serve_plain`: `chat.py` renders the prompt and parses the reply, `engine.py`
samples), not from vLLM's OpenAI server. This module starts both, once each, from the same
worker venv on the same tiny model with the same engine arguments
(`stock_identity_hosts.py`: stock vLLM gets our `engine_args` one by one, and our
`generation.tool_call_parser`), sends each the same fixed-seed requests in the same order
(plain chat, a tool call, a tool result in history, Gym's token echo, no echo, `/tokenize`)
and compares the replies field by field.

What must be equal, exactly (`identity_view`): the message (content, tool-call names and
arguments, role), `finish_reason`, `prompt_token_ids`, choice `token_ids`, every logprob entry's
`token` and `logprob` (the same engine build and arguments on the same prompt: bit-identical
floats, no tolerance), usage counts, `model`, `object`, `index`; `/tokenize` tokens and count.

What differs, asserted exactly (`documented_difference`; the design doc's "Flag-off identity"
section says why): random ids (their formats differ: `STOCK_ID`, `OURS_ID`, ...), `created`,
keys stock vLLM adds that our worker omits, with the values stock sends for them
(`STOCK_ONLY_*`), and a logprob entry's `bytes` (stock: the token's UTF-8 bytes; ours: null).
A field stock sends as null and ours omits (`prompt_token_ids`, `token_ids` without the echo)
counts as equal: Gym reads both with `.get`.
`developer` messages: ours renders them as `system` (a deliberate difference), so ours on a
developer conversation equals stock on the same conversation with the system role, and not
stock on the developer one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from examples.arith import task as arith_task
from examples.arith.tiny_model import TinyModelConfig, ensure_tiny_model
from nemo_rl.models.generation.vllm.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.vllm.launcher import worker_env
from nemo_rl.utils.venvs import REPO_ROOT, ensure_venv, venv_python, vllm_spec

pytestmark = pytest.mark.integration

HOSTS = Path(__file__).with_name("stock_identity_hosts.py")
START_TIMEOUT_S = 900.0  # two engines start side by side on a shared 2-core machine
REQUEST_TIMEOUT_S = 300.0
GEN = GenerationConfig(vllm=VllmConfig(flavor="cpu", kv_cache_memory_bytes=128 * 1024 * 1024))

SYSTEM = {"role": "system", "content": arith_task.SYSTEM_PROMPT}
USER = {"role": "user", "content": arith_task.user_prompt(arith_task.Problem("3 + 4", 7))}
TOOLS = [arith_task.CALCULATOR_TOOL]
# The history an agent sends back after the tool ran. The arguments string is compact JSON (not
# json.dumps spacing): vLLM hands the template a parsed object, so the spacing must not leak.
HISTORY = [
    SYSTEM,
    USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression":"3 + 4"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "7"},
]
# What Gym's vllm_model server adds with return_token_id_information (+ request_prompt_and_generation_token_ids).
GYM_ECHO = {"logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}

CHAT_REQUESTS: dict[str, dict] = {
    "tool_call": {"messages": [SYSTEM, USER], "tools": TOOLS, "temperature": 1.0, "seed": 7, "max_tokens": 48, **GYM_ECHO},
    "after_tool": {"messages": HISTORY, "tools": TOOLS, "temperature": 1.0, "seed": 7, "max_tokens": 48, **GYM_ECHO},
    # The tiny model is trained on this machine and its replies are a few tokens long: a cut at one
    # token holds for any build whose first sampled token is not end-of-turn (it answers in words).
    "plain_cut": {
        "messages": [SYSTEM, USER],
        "temperature": 0.8, "top_p": 0.9, "seed": 3, "max_tokens": 1, **GYM_ECHO,
    },
    "no_echo": {"messages": [SYSTEM, USER], "tools": TOOLS, "temperature": 1.0, "seed": 9, "max_tokens": 48},
    # logprobs without return_tokens_as_token_ids: entries are named by the token's text.
    "logprobs_as_text": {"messages": [USER], "temperature": 1.0, "seed": 4, "max_tokens": 6, "logprobs": True},
}
TOKENIZE_REQUESTS: dict[str, dict] = {
    "history": {"messages": HISTORY, "tools": TOOLS},
    "content_parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
}

MISSING = "<missing>"
# Keys stock vLLM sends that our worker omits, with the value stock sends (JSON path -> value);
# `system_fingerprint` is vLLM's version and build (`SYSTEM_FINGERPRINT`).
STOCK_ONLY_TOP = {
    "ec_transfer_params": None, "kv_transfer_params": None, "metrics": None, "prompt_logprobs": None,
    "prompt_text": None, "service_tier": None,
}
SYSTEM_FINGERPRINT = re.compile(r"vllm-\d+\.\d+\.\d+-[0-9a-f]{8}")
STOCK_ONLY_USAGE = {"completion_tokens_details": None, "prompt_tokens_details": None}
STOCK_ONLY_CHOICE = {"routed_experts": None, "stop_reason": None}
STOCK_ONLY_MESSAGE = {"annotations": None, "audio": None, "function_call": None, "reasoning": None, "refusal": None}
# Response ids: stock `chatcmpl-<16 hex>`, tool calls `chatcmpl-tool-<16 hex>`; ours 32 hex and `call_<24 hex>`.
STOCK_ID, STOCK_TOOL_ID = re.compile(r"chatcmpl-[0-9a-f]{16}"), re.compile(r"chatcmpl-tool-[0-9a-f]{16}")
OURS_ID, OURS_TOOL_ID = re.compile(r"chatcmpl-[0-9a-f]{32}"), re.compile(r"call_[0-9a-f]{24}")


# --- the two servers -------------------------------------------------------------------------
def _start(side: str, model_dir: Path, python: Path, workdir: Path) -> tuple[subprocess.Popen, Path]:
    ready = workdir / f"{side}.ready.json"
    log = (workdir / f"{side}.log").open("wb")
    env = {**os.environ, **worker_env(GEN, "cpu"), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [str(python), str(HOSTS), side, str(model_dir), GEN.model_dump_json(), str(ready)],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    return proc, ready


def _wait_ready(procs: dict[str, tuple[subprocess.Popen, Path]], workdir: Path) -> dict[str, str]:
    deadline = time.monotonic() + START_TIMEOUT_S
    urls: dict[str, str] = {}
    while len(urls) < len(procs):
        for side, (proc, ready) in procs.items():
            if side in urls:
                continue
            if ready.exists():
                urls[side] = json.loads(ready.read_text())["base_url"]
            elif proc.poll() is not None:
                tail = (workdir / f"{side}.log").read_text(errors="replace")[-4000:]
                pytest.fail(f"the {side} server exited {proc.returncode} before serving:\n{tail}")
        if time.monotonic() > deadline:
            pytest.fail(f"servers not ready within {START_TIMEOUT_S:.0f} s: ready={sorted(urls)}")
        time.sleep(1.0)
    return urls


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM our host's process group (it and the engine core it spawned), then SIGKILL stragglers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader if the engine core lingers
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def replies(tmp_path_factory) -> dict:
    """Both servers' replies to every request, sent in the same order (so prefix caches match)."""
    workdir = tmp_path_factory.mktemp("stock_identity")
    model_dir = ensure_tiny_model(TinyModelConfig())
    python = venv_python(ensure_venv(vllm_spec("cpu")))
    started = time.monotonic()
    procs = {side: _start(side, model_dir, python, workdir) for side in ("stock", "ours")}
    try:
        urls = _wait_ready(procs, workdir)
        up = time.monotonic()
        out: dict = {"chat": {}, "tokenize": {}, "window": [time.time(), None]}
        for name, body in CHAT_REQUESTS.items():
            out["chat"][name] = {side: _post(f"{urls[side]}/chat/completions", {"model": GEN.model_name, **body})
                                 for side in ("stock", "ours")}
        tokenize = {**TOKENIZE_REQUESTS, "developer": {"messages": [{**SYSTEM, "role": "developer"}, USER]},
                    "system": {"messages": [SYSTEM, USER]}}
        for name, body in tokenize.items():
            out["tokenize"][name] = {side: _post(f"{urls[side].removesuffix('/v1')}/tokenize", {"model": GEN.model_name, **body})
                                     for side in ("stock", "ours")}
        out["window"][1] = time.time()
        print(f"[stock-identity] engines up in {up - started:.1f} s, requests took {time.monotonic() - up:.1f} s")
        (workdir / "replies.json").write_text(json.dumps(out, indent=1))
        return out
    finally:
        for proc, _ in procs.values():
            _stop(proc)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        pytest.fail(f"{url} answered {e.code}: {e.read().decode(errors='replace')[:2000]}")


# --- the comparison (pure) -------------------------------------------------------------------
def identity_view(reply: dict) -> dict:
    """The fields that must be equal, exactly, between stock vLLM and our worker."""
    choice = reply["choices"][0]
    message = choice["message"]
    logprobs = choice["logprobs"]
    return {
        "object": reply["object"],
        "model": reply["model"],
        "usage": {k: reply["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "prompt_token_ids": reply.get("prompt_token_ids"),
        "index": choice["index"],
        "finish_reason": choice["finish_reason"],
        "token_ids": choice.get("token_ids"),
        "role": message["role"],
        "content": message["content"],
        "tool_calls": [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []],
        "logprobs": None if logprobs is None else [
            (e["token"], e["logprob"], e["top_logprobs"]) for e in logprobs["content"]
        ],
    }


def documented_difference(stock: dict, ours: dict) -> dict:
    """Every way the two replies differ beyond `identity_view`, by JSON path."""
    diff: dict = {}

    def extra(path: str, a: dict, b: dict, skip: tuple[str, ...] = ()) -> None:
        for key in sorted(set(a) | set(b)):
            if key in skip:
                continue
            va, vb = a.get(key, MISSING), b.get(key, MISSING)
            if va != vb and (va is MISSING or vb is MISSING or not isinstance(va, dict)):
                diff[f"{path}{key}"] = (va, vb)

    extra("", stock, ours, skip=("id", "created", "choices", "usage", "prompt_token_ids"))
    extra("usage.", stock["usage"], ours["usage"], skip=("prompt_tokens", "completion_tokens", "total_tokens"))
    sc, oc = stock["choices"][0], ours["choices"][0]
    extra("choice.", sc, oc, skip=("index", "finish_reason", "token_ids", "message", "logprobs"))
    extra("message.", sc["message"], oc["message"], skip=("role", "content", "tool_calls"))
    if sc["logprobs"] is not None and oc["logprobs"] is not None:
        stock_bytes = [e["bytes"] for e in sc["logprobs"]["content"]]
        diff["logprobs.bytes"] = ("utf-8 bytes" if all(isinstance(b, list) for b in stock_bytes) else stock_bytes,
                                  [e["bytes"] for e in oc["logprobs"]["content"]])
    return diff


def _expected_difference(stock: dict) -> dict:
    choice = stock["choices"][0]
    expected = {k: (v, MISSING) for k, v in STOCK_ONLY_TOP.items()}
    assert SYSTEM_FINGERPRINT.fullmatch(stock["system_fingerprint"]), stock["system_fingerprint"]
    expected["system_fingerprint"] = (stock["system_fingerprint"], MISSING)
    expected.update({f"usage.{k}": (v, MISSING) for k, v in STOCK_ONLY_USAGE.items()})
    expected.update({f"choice.{k}": (v, MISSING) for k, v in STOCK_ONLY_CHOICE.items()})
    expected.update({f"message.{k}": (v, MISSING) for k, v in STOCK_ONLY_MESSAGE.items()})
    if choice["logprobs"] is not None:
        expected["logprobs.bytes"] = ("utf-8 bytes", [None] * len(choice["logprobs"]["content"]))
    return expected


# --- the tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CHAT_REQUESTS))
def test_chat_replies_are_identical_where_it_matters(replies, name):
    stock, ours = replies["chat"][name]["stock"], replies["chat"][name]["ours"]
    assert identity_view(ours) == identity_view(stock)


@pytest.mark.parametrize("name", list(CHAT_REQUESTS))
def test_chat_replies_differ_only_as_documented(replies, name):
    stock, ours = replies["chat"][name]["stock"], replies["chat"][name]["ours"]
    assert documented_difference(stock, ours) == _expected_difference(stock)
    start, end = replies["window"]
    assert STOCK_ID.fullmatch(stock["id"]) and OURS_ID.fullmatch(ours["id"]), (stock["id"], ours["id"])
    for reply in (stock, ours):
        assert int(start) <= reply["created"] <= end + 1
    stock_calls = stock["choices"][0]["message"].get("tool_calls") or []
    ours_calls = ours["choices"][0]["message"].get("tool_calls") or []
    assert all(STOCK_TOOL_ID.fullmatch(c["id"]) for c in stock_calls)
    assert all(OURS_TOOL_ID.fullmatch(c["id"]) for c in ours_calls)


def test_the_requests_cover_what_gym_relies_on(replies):
    # The comparison is only as strong as what the model produced: a tool call with its arguments,
    # a final text answer after the tool, a reply cut by max_tokens, and the echo both on and off.
    chat = {name: pair["stock"] for name, pair in replies["chat"].items()}
    call = chat["tool_call"]["choices"][0]
    assert call["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in call["message"]["tool_calls"]] == ["calculator"]
    after = chat["after_tool"]["choices"][0]
    assert after["finish_reason"] == "stop" and after["message"]["content"] and not after["message"].get("tool_calls")
    assert chat["plain_cut"]["choices"][0]["finish_reason"] == "length", json.dumps(chat["plain_cut"]["choices"])
    assert chat["plain_cut"]["usage"]["completion_tokens"] == CHAT_REQUESTS["plain_cut"]["max_tokens"]
    for name in ("tool_call", "after_tool", "plain_cut"):
        choice = chat[name]["choices"][0]
        assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert chat[name]["prompt_token_ids"]
    as_text = chat["logprobs_as_text"]["choices"][0]["logprobs"]["content"]
    assert as_text and not any(e["token"].startswith("token_id:") for e in as_text)
    no_echo = replies["chat"]["no_echo"]
    for reply in no_echo.values():
        assert "prompt_token_ids" not in reply or reply["prompt_token_ids"] is None
        assert reply["choices"][0].get("token_ids") is None and reply["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("name", list(TOKENIZE_REQUESTS))
def test_tokenize_is_identical(replies, name):
    stock, ours = replies["tokenize"][name]["stock"], replies["tokenize"][name]["ours"]
    assert (ours["tokens"], ours["count"], ours["max_model_len"]) == (stock["tokens"], stock["count"], stock["max_model_len"])


def test_developer_role_renders_as_system_on_ours_only(replies):
    tok = replies["tokenize"]
    assert tok["developer"]["ours"]["tokens"] == tok["system"]["stock"]["tokens"] == tok["system"]["ours"]["tokens"]
    assert tok["developer"]["stock"]["tokens"] != tok["system"]["stock"]["tokens"]  # stock renders a developer turn
