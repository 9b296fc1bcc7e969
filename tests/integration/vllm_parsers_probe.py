"""Runs `parsers.py` on real vLLM parsers in the worker venv (`test_vllm_parsers.py` starts it).

`python vllm_parsers_probe.py OUT_JSON` writes what it observed as JSON; the test holds the
expectations. Observed: the names of vLLM's two parser registries; per case, the decoding rule the
adjusted request asks for, the whole reply (`ChatParsers.parse`), every streamed delta
(`ReplyStream.push`, one engine step per token, the text of each step as vLLM's incremental
detokenizer makes it: the newly decodable suffix, nothing for the stop token) and the reply the
stream closes with; beside them, stock vLLM's own answer to the same engine output: its chat
server's whole-reply and streaming generators (`OpenAIServingChat`, built without an engine: only
the attributes those generators read) fed `RequestOutput`s of the same ids and texts; and the
set-up errors of names vLLM cannot build.

Tokenizers: the tiny model's (`examples/arith/tiny_model`), ChatML (hermes) and Llama-3
(llama3_json) families; the ChatML one also gets Qwen3's `<think>` / `</think>` as added,
non-special tokens (as Qwen3's own tokenizer has them) for the qwen3 reasoning parser.
Tool-call ids are minted by a counter (`call_0`, `call_1`, ...) so the expectations are exact.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path

from tokenizers import AddedToken

from examples.arith import task as arith_task
from examples.arith.tiny_model.chat_template import CHATML, LLAMA3
from examples.arith.tiny_model.corpus import task_conversation
from examples.arith.tiny_model.tokenizer import train_tokenizer
from nemo_rl.models.generation.vllm.config import GenerationSetupError
from nemo_rl.models.generation.vllm.errors import InvalidChatRequest, StreamConsistencyError
from nemo_rl.models.generation.vllm.parsers import ChatParsers, reply_text, resolve_parsers

THINK_TOKENS = ("<think>", "</think>")
TOOLS = [arith_task.CALCULATOR_TOOL]
USER = {"role": "user", "content": arith_task.user_prompt(arith_task.Problem("12 + 5", 17))}

HERMES_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 5"}}\n</tool_call>'
LLAMA_CALL = '{"name": "calculator", "parameters": {"expression": "12 + 5"}}'
THINK = "<think>\nI add 12 and 5.\n</think>\n\n"


def _tokenizer(family, extra: tuple[str, ...] = ()):
    texts = [json.dumps(task_conversation(p)) for p in arith_task.make_problems(0, 200)]
    tok = train_tokenizer(texts, vocab_size=600, max_length=2048, family=family)
    if extra:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    return tok


def _counter():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def _prompt_ids(tok, body: dict) -> list[int]:
    rendered = tok.apply_chat_template(body["messages"], tools=body.get("tools"), add_generation_prompt=True)
    return list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)


def _steps(tok, ids: list[int], skip: bool, cut: bool) -> list[tuple[str, list[int], bool]]:
    """One engine step per token: (the newly decodable text, the token, finished), as vLLM's
    incremental detokenizer reports them (the stop token that ends a turn adds no text)."""
    steps, sent = [], ""
    for n in range(1, len(ids) + 1):
        last = n == len(ids)
        so_far = reply_text(tok, ids[:n], skip_special_tokens=skip, stop_terminated=last and not cut)
        steps.append((so_far[len(sent):], ids[n - 1 : n], last))
        sent = so_far
    return steps


def _case(tok, names: dict, body: dict, generated: str, *, cut: bool = False) -> dict:
    """Whole and streamed parse of `generated` followed by eos (a turn that stopped on its stop token;
    `cut`: no eos, finish reason `length`), by parsers of their own (ids count from call_0: the
    whole reply's first, then the stream's), and stock's server on the same engine output."""
    parsers = resolve_parsers(tok, mint_tool_call_id=_counter(), **names)
    request = parsers.prepare(body)
    ids = tok.encode(generated, add_special_tokens=False) + ([] if cut else [tok.eos_token_id])
    finish = "length" if cut else "stop"
    prompt = _prompt_ids(tok, body)
    skip = request.skip_special_tokens
    text = reply_text(tok, ids, skip_special_tokens=skip, stop_terminated=not cut)
    whole = parsers.parse(request, prompt_token_ids=prompt, token_ids=ids, text=text, finish_reason=finish)
    stream = parsers.stream(request, prompt_token_ids=prompt)
    steps = _steps(tok, ids, skip, cut)
    deltas = [d for t, i, last in steps if (d := stream.push(t, i, finished=last)) is not None]
    closed = stream.close(finish)
    return {
        "skip_special_tokens": skip,
        "text": text,
        "whole": {"message": whole.message(), "finish_reason": whole.finish_reason},
        "deltas": deltas,
        "closed": {"message": closed.streamed.message(), "finish_reason": closed.streamed.finish_reason},
        "closed_whole": {"message": closed.whole.message(), "finish_reason": closed.whole.finish_reason},
        "agrees": closed.agrees,
        "disagreement": closed.disagreement(),
        "stock": asyncio.run(_stock(parsers, request, tok, prompt, text, ids, steps, finish)),
    }


def _stock_server(parsers: ChatParsers):
    """vLLM's own chat server, without an engine: only the attributes its two generators read, set
    as `vllm serve --enable-auto-tool-choice` sets them (no usage details, logging or fingerprint)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    server = OpenAIServingChat.__new__(OpenAIServingChat)
    for name, value in {
        "parser_cls": parsers.vllm_parser_cls, "enable_auto_tools": True, "response_role": "assistant",
        "model_config": None, "_include_reasoning_tokens_details": False, "enable_prompt_tokens_details": False,
        "enable_per_request_metrics": False, "system_fingerprint": None, "enable_log_outputs": False,
        "request_logger": None, "enable_force_include_usage": False, "default_chat_template_kwargs": {},
        "chat_template": None, "chat_template_content_format": "auto", "return_tokens_as_token_ids": False,
        "enable_log_deltas": True,
    }.items():
        setattr(server, name, value)
    return server


async def _stock(parsers: ChatParsers, request, tok, prompt, text, ids, steps, finish) -> dict:
    """Stock's whole reply and streamed deltas for the same engine output (`RequestOutput`s)."""
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata
    from vllm.outputs import CompletionOutput, RequestOutput

    async def engine(outputs):
        for out in outputs:
            yield out

    def output(text_, ids_, reason, finished):
        return RequestOutput("r", None, prompt, None, [CompletionOutput(0, text_, ids_, None, None, finish_reason=reason)], finished)

    server, req = _stock_server(parsers), request.vllm_request
    parser = server._make_parser(req, tok, request.chat_template_kwargs)
    full = await server.chat_completion_full_generator(
        req, engine([output(text, ids, finish, True)]), "r", "m", [], tok, RequestResponseMetadata(request_id="r"),
        parser=parser,
    )
    choice = json.loads(full.model_dump_json())["choices"][0]
    events = server.chat_completion_stream_generator(
        req, engine([output(t, i, finish if last else None, last) for t, i, last in steps]), "r", "m", [], tok,
        RequestResponseMetadata(request_id="r"), chat_template_kwargs=request.chat_template_kwargs,
    )
    chunks = [json.loads(e[len("data: "):]) async for e in events if e.strip() != "data: [DONE]"]
    choices = [c["choices"][0] for c in chunks[1:]]  # after the role chunk
    message = {k: choice["message"].get(k) for k in ("role", "content", "reasoning")}
    if choice["message"].get("tool_calls"):
        message["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")} for c in choice["message"]["tool_calls"]]
    return {
        "whole": {"message": message, "finish_reason": choice["finish_reason"]},
        "deltas": [c["delta"] for c in choices if c["delta"]],
        "finish_reasons": [c["finish_reason"] for c in choices if c["finish_reason"]],
    }


def _setup_error(tok, **names) -> dict:
    try:
        resolve_parsers(tok, mint_tool_call_id=_counter(), **names)
    except GenerationSetupError as e:
        return {"kind": e.kind, "message": str(e)}
    return {"kind": None, "message": "resolved"}


def _misuse(tok) -> dict:
    """The errors a malformed body and a stream pushed past its end raise (class and message)."""
    parsers = resolve_parsers(tok, tool_call_parser="hermes", reasoning_parser=None, mint_tool_call_id=_counter())
    out = {}
    try:
        parsers.prepare({"messages": "not a list"})
    except InvalidChatRequest as e:
        out["bad_body"] = [type(e).__name__, str(e).splitlines()[0]]
    stream = parsers.stream(parsers.prepare({"messages": [USER]}), prompt_token_ids=[1])
    try:
        stream.close("stop")
    except StreamConsistencyError as e:
        out["close_early"] = [type(e).__name__, str(e)]
    stream.push("x", [tok.eos_token_id], finished=True)
    try:
        stream.push("y", [tok.eos_token_id], finished=True)
    except StreamConsistencyError as e:
        out["push_late"] = [type(e).__name__, str(e)]
    return out


def main(out: Path) -> None:
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    chatml = _tokenizer(CHATML, THINK_TOKENS)
    llama = _tokenizer(LLAMA3)
    hermes = {"tool_call_parser": "hermes", "reasoning_parser": None}
    qwen3 = {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}
    llama3 = {"tool_call_parser": "llama3_json", "reasoning_parser": None}
    with_tools = {"messages": [USER], "tools": TOOLS}
    observed = {
        "registries": {
            "tool_call_parser": sorted(ToolParserManager.list_registered()),
            "reasoning_parser": sorted(ReasoningParserManager.list_registered()),
        },
        "cases": {
            "hermes_call": _case(chatml, hermes, with_tools, "Let me compute." + HERMES_CALL),
            "hermes_two_calls": _case(chatml, hermes, with_tools, HERMES_CALL + "\n" + HERMES_CALL),
            "hermes_plain": _case(chatml, hermes, {"messages": [USER]}, "The answer is 17."),
            "hermes_tool_choice_none": _case(
                chatml, hermes, {**with_tools, "tool_choice": "none"}, "Let me compute." + HERMES_CALL
            ),
            "hermes_parallel_off": _case(
                chatml, hermes, {**with_tools, "parallel_tool_calls": False}, HERMES_CALL + "\n" + HERMES_CALL
            ),
            "llama3_json_call": _case(llama, llama3, with_tools, LLAMA_CALL),
            "llama3_json_plain": _case(llama, llama3, with_tools, "The answer is 17."),
            "qwen3_think_content_call": _case(chatml, qwen3, with_tools, THINK + "Let me compute." + HERMES_CALL),
            "qwen3_think_answer": _case(chatml, qwen3, {"messages": [USER]}, THINK + "The answer is 17."),
            "qwen3_reasoning_hidden": _case(
                chatml, qwen3, {"messages": [USER], "include_reasoning": False}, THINK + "The answer is 17."
            ),
        },
        "disagreements": {
            "hermes_call_cut": _case(chatml, hermes, with_tools, "Hi" + HERMES_CALL[:30], cut=True),
            "llama3_json_text_then_call": _case(llama, llama3, with_tools, "ok " + LLAMA_CALL),
        },
        "misuse": _misuse(chatml),
        "setup_errors": {
            "unknown_tool": _setup_error(chatml, tool_call_parser="no_such_parser", reasoning_parser=None),
            "unknown_reasoning": _setup_error(chatml, tool_call_parser="hermes", reasoning_parser="no_such_parser"),
            "hf_without_template": _setup_error(chatml, tool_call_parser="hermes", reasoning_parser="hf"),
        },
    }
    out.write_text(json.dumps(observed, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
