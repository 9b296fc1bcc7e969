"""Pure chat-completions logic of the vLLM worker: prompts, token-in tails, tool calls, responses.

Works for any chat model: rendering comes from the model's own chat template (its tokenizer),
the end-of-turn text from probing that template, tool calls from a named parser (vLLM's names,
vLLM's rules). No vLLM import (importable in the driver venv).
Promises: a token-in tail never re-tokenizes history (the caller prepends the parent's exact
ids; the tail starts after the parent's last sampled token); a plain call's prompt and parsed
reply equal stock vLLM's. Refuses, by a named error, a template whose end of turn cannot be
probed (`TemplateProbeError`), a tail that cannot be placed exactly (`TailRenderError`: the
worker reports `capture_failed`, never a silently different prompt) and an unknown parser.
Function by function: docs/design-docs/vllm-worker-capture.md, "`chat.py`, function by function".
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from jinja2 import TemplateError

from nemo_rl.data.errors import FatalError, RecoverableError

ToolCallParserName = Literal["hermes", "llama3_json"]

# Sentinel assistant content of the end-of-turn probe (no whitespace: templates may trim).
TURN_END_PROBE = "NRL-TURN-END-PROBE-7f3a"
_HERMES_START = "<tool_call>"
_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_LLAMA3_CALL_START_RE = re.compile(r"\{")
_JSON_DECODER = json.JSONDecoder()


class ChatTemplateTokenizer(Protocol):
    eos_token_id: int

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class InvalidChatRequest(RecoverableError, ValueError):
    """The request body is not a chat-completions request this worker can serve (HTTP 400)."""


class TailRenderError(RecoverableError, ValueError):
    """The conversation cannot be split into exact parent prefix + newly rendered tail."""


class TemplateProbeError(RecoverableError, ValueError):
    """The chat template does not mark the end of an assistant turn in a way that can be found."""


class UnknownToolCallParser(FatalError, ValueError):
    """`generation.tool_call_parser` names no parser of `TOOL_CALL_PARSERS`."""


@dataclass(frozen=True)
class ParsedAssistant:
    content: str | None
    tool_calls: list[dict]


def normalize_messages(messages: Any) -> list[dict]:
    """Validate chat messages and shape them as vLLM hands them to the chat template.

    Text parts are joined; an assistant's tool-call `arguments` become JSON objects (vLLM's rule:
    `_template_arguments`). One deliberate difference from vLLM: `developer` is mapped to `system`
    (chat templates rarely render a developer role; vLLM passes it through).
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidChatRequest(f"messages must be a non-empty list, got {type(messages).__name__}")
    out: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise InvalidChatRequest(f"messages[{i}] must be an object with role system/developer/user/assistant/tool")
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list):
            if m["tool_calls"]:
                m["tool_calls"] = [_template_tool_call(call) for call in m["tool_calls"]]
            else:
                del m["tool_calls"]  # an empty list keeps the template on the plain assistant path
        out.append(m)
    return out


def _template_arguments(arguments: Any) -> dict:
    """Tool-call arguments as the chat template sees them in vLLM: a JSON object (OpenAI clients send a
    JSON string); empty, malformed or non-object arguments become {} so the history still renders."""
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def _template_tool_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call  # data.calls's rules refused these already; nothing to convert
    function = call["function"]
    return {**call, "function": {**function, "arguments": _template_arguments(function.get("arguments"))}}


def chat_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidChatRequest(f"tools must be a list, got {type(tools).__name__}")
    return tools or None


def render_text(tokenizer: ChatTemplateTokenizer, messages: list[dict], tools: list[dict] | None, gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=gen_prompt, tokenize=False)


def render_root_prompt(tokenizer: ChatTemplateTokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    text = render_text(tokenizer, messages, tools, gen_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def derive_turn_end(tokenizer: ChatTemplateTokenizer) -> str:
    """The text the chat template appends after an assistant turn's content.

    Rendered from a probe conversation (user, assistant=sentinel) without generation prompt:
    whatever follows the sentinel is the end-of-turn text.
    """
    probe = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": TURN_END_PROBE}]
    try:
        text = render_text(tokenizer, probe, None, gen_prompt=False)
    except TemplateError as e:
        raise TemplateProbeError(f"the chat template cannot render a user/assistant probe: {e}") from e
    at = text.rfind(TURN_END_PROBE)
    if at < 0:
        raise TemplateProbeError("the chat template drops the assistant content of the probe turn")
    turn_end = text[at + len(TURN_END_PROBE) :]
    if not turn_end:
        raise TemplateProbeError("the chat template appends nothing after an assistant turn: turns cannot be delimited")
    return turn_end


def sampled_turn_close(tokenizer: ChatTemplateTokenizer, prefix_ids: list[int]) -> str:
    """Text of the stop (eos) token ending the parent's sampled ids; "" for a turn cut by max_tokens."""
    if not prefix_ids or prefix_ids[-1] != tokenizer.eos_token_id:
        return ""
    return tokenizer.decode([prefix_ids[-1]], skip_special_tokens=False)


def tail_boundary(history: str, full: str, *, turn_end: str, sampled_close: str) -> int:
    """Offset in `full` right after the parent's last sampled token (pure text rule)."""
    if not full.startswith(history):
        raise TailRenderError("the chat template re-renders history differently once later turns are added")
    if not history.endswith(turn_end):
        raise TailRenderError(f"the rendered assistant turn does not end with the template's end-of-turn {turn_end!r}")
    if not turn_end.startswith(sampled_close):
        raise TailRenderError(
            f"the parent's turn ended on {sampled_close!r}, which does not begin the template's end-of-turn {turn_end!r}"
        )
    # A turn that ended on its stop token already holds that token's text among the sampled ids;
    # a turn cut by max_tokens does not, so the tail must close it with the whole end-of-turn.
    return len(history) - len(turn_end) + len(sampled_close)


def render_token_in_tail(
    tokenizer: ChatTemplateTokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    *,
    turn_end: str,
    sampled_close: str,
) -> list[int]:
    """Token ids of everything after the parent's last sampled token, through the gen prompt."""
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise TailRenderError("a token_in call must carry the parent's assistant turn in messages")
    history = render_text(tokenizer, messages[: last_assistant + 1], tools, gen_prompt=False)
    full = render_text(tokenizer, messages, tools, gen_prompt=True)
    tail = full[tail_boundary(history, full, turn_end=turn_end, sampled_close=sampled_close) :]
    if not tail:
        raise TailRenderError("nothing to render after the parent's turn")
    return tokenizer.encode(tail, add_special_tokens=False)


def _function_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_hermes(text: str) -> ParsedAssistant:
    """vLLM's `hermes` (`Hermes2ProToolParser.extract_tool_calls`), rule for rule.

    No `<tool_call>` in the text: all of it is content. Otherwise every `<tool_call>...</tool_call>`
    block, and a last block left open (a reply cut by max_tokens), must hold a JSON object with a
    string `name` and an `arguments` value (any JSON; re-serialized with `ensure_ascii=False`);
    if any block does not, the whole text stays content and nothing is called. The content of a
    reply with calls is the text before the first `<tool_call>`, unstripped (None when empty);
    text between or after the blocks is dropped.
    """
    if _HERMES_START not in text:
        return ParsedAssistant(content=text, tool_calls=[])
    calls: list[dict] = []
    for closed, left_open in _HERMES_RE.findall(text):
        try:
            obj = json.loads(closed or left_open)
        except json.JSONDecodeError:
            return ParsedAssistant(content=text, tool_calls=[])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return ParsedAssistant(content=text, tool_calls=[])
        calls.append(_function_call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    content = text[: text.find(_HERMES_START)]
    return ParsedAssistant(content=content or None, tool_calls=calls)


def parse_llama3_json(text: str) -> ParsedAssistant:
    """vLLM's `llama3_json`: every top-level JSON object `{"name", "arguments"|"parameters"}` in the
    text is a call (separators such as `; ` and surrounding text are dropped; content None).
    If any `{` does not open such an object, the whole text stays content and nothing is called.
    """
    calls: list[dict] = []
    end = -1
    for m in _LLAMA3_CALL_START_RE.finditer(text):
        if m.start() <= end:
            continue
        try:
            obj, length = _JSON_DECODER.raw_decode(text[m.start() :])
        except json.JSONDecodeError:
            return ParsedAssistant(content=text, tool_calls=[])
        end = m.start() + length
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return ParsedAssistant(content=text, tool_calls=[])
        calls.append(_function_call(obj["name"], json.dumps(args, ensure_ascii=False)))
    if calls:
        return ParsedAssistant(content=None, tool_calls=calls)
    return ParsedAssistant(content=text, tool_calls=[])


TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedAssistant]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}


def get_tool_call_parser(name: str) -> Callable[[str], ParsedAssistant]:
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise UnknownToolCallParser(
            f"tool_call_parser={name!r} is not one of {sorted(TOOL_CALL_PARSERS)}; set generation.tool_call_parser"
        ) from None


def parse_tool_calls(text: str, parser: str) -> ParsedAssistant:
    """Parse generated text with the named parser (see `TOOL_CALL_PARSERS`)."""
    return get_tool_call_parser(parser)(text)


def generated_text(tokenizer: ChatTemplateTokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


# Parsers whose vLLM class turns `skip_special_tokens` off for requests with tools (tool tags are
# special tokens in some models' vocabularies); the others decode with vLLM's default.
_PARSERS_KEEPING_SPECIAL_TOKENS = frozenset({"hermes"})


def parses_tool_calls(tools: list[dict] | None, tool_choice: Any) -> bool:
    """vLLM's rule for a non-streamed reply: tool calls are parsed only when the request offers
    tools and `tool_choice` is not "none"; otherwise the whole generated text is the content."""
    return bool(tools) and tool_choice != "none"


def assistant_reply(
    tokenizer: ChatTemplateTokenizer, token_ids: list[int], *, parser: str, parse_tools: bool
) -> ParsedAssistant:
    """The assistant message vLLM's chat server builds from these sampled ids.

    Without tool parsing: the ids decoded without special tokens, all content. With it: decoded
    the way the parser's vLLM class asks (hermes keeps special tokens; the stop token that ended
    the turn is never text, as vLLM's detokenizer drops it) and parsed by `parser`.
    """
    if not parse_tools:
        return ParsedAssistant(content=generated_text(tokenizer, token_ids), tool_calls=[])
    if parser not in _PARSERS_KEEPING_SPECIAL_TOKENS:
        return parse_tool_calls(generated_text(tokenizer, token_ids), parser)
    ids = token_ids[:-1] if token_ids and token_ids[-1] == tokenizer.eos_token_id else token_ids
    return parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=False), parser)


@dataclass(frozen=True)
class SamplingRequest:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    logprobs: bool
    return_token_ids: bool
    max_tokens_explicit: bool = False  # the caller set max_tokens (else the server default, clipped to fit)
    # vLLM's `return_tokens_as_token_ids`: logprob entries name tokens `token_id:N` (else their text).
    return_tokens_as_token_ids: bool = False


def sampling_from_body(body: dict, *, default_max_tokens: int) -> SamplingRequest:
    def num(key: str, default: float) -> float:
        value = body.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InvalidChatRequest(f"{key} must be a number, got {value!r}")
        return float(value)

    explicit = body.get("max_completion_tokens") or body.get("max_tokens")
    max_tokens = explicit or default_max_tokens
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidChatRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if body.get("n") not in (None, 1):
        raise InvalidChatRequest(f"n must be 1 (token custody is per single choice), got {body.get('n')!r}")
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise InvalidChatRequest(f"seed must be an integer, got {seed!r}")
    return SamplingRequest(
        temperature=num("temperature", 1.0),
        top_p=num("top_p", 1.0),
        max_tokens=max_tokens,
        seed=seed,
        logprobs=bool(body.get("logprobs")),
        return_token_ids=bool(body.get("return_token_ids")),
        max_tokens_explicit=bool(explicit),
        return_tokens_as_token_ids=bool(body.get("return_tokens_as_token_ids")),
    )


def build_chat_completion(
    *,
    request_id: str,
    model: str,
    parsed: ParsedAssistant,
    finish_reason: str,
    prompt_token_ids: list[int],
    token_ids: list[int],
    logprobs: list[float],
    include_logprobs: bool,
    include_token_ids: bool,
    logprob_tokens: list[str] | None = None,
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if parsed.tool_calls and finish_reason == "stop" else finish_reason,
        "logprobs": None,
    }
    if include_logprobs:
        names = logprob_tokens if logprob_tokens is not None else [f"token_id:{t}" for t in token_ids]
        choice["logprobs"] = {
            "content": [
                {"token": name, "logprob": lp, "bytes": None, "top_logprobs": []} for name, lp in zip(names, logprobs)
            ]
        }
    response: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt_token_ids),
            "completion_tokens": len(token_ids),
            "total_tokens": len(prompt_token_ids) + len(token_ids),
        },
    }
    if include_token_ids:
        response["prompt_token_ids"] = list(prompt_token_ids)
        choice["token_ids"] = list(token_ids)
    return response


def new_request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"
