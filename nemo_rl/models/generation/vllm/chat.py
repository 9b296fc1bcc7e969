"""The worker's pure chat logic: what a chat request means in ids, and what ids mean as a reply.

No I/O, no engine, no custody (`serving` orchestrates). Request: `normalize_messages`,
`chat_tools`, `sampling_from_body` (`InvalidChatRequest` naming the field),
`context_overflow_message` (vLLM's wording). Render: `render_root_prompt` (the model's own
template) and the token-in rule `render_token_in_tail` (only what follows the parent's last
sampled token; `TailRenderError` when it cannot be placed exactly, never a silently different
prompt), with the end-of-turn probed once at set-up (`probe_turn_end`). Parse: one seam, a
`ToolParser` resolved at set-up (`hermes` here, the others in `tool_parsers`), so a parser can be
swapped without touching the reply builders. Reply: `build_chat_completion`; for `stream=true` the
chunk builders, `ContentStreamer` and the SSE framing (`sse_event`, `SSE_DONE`). Invariant: the
concatenated streamed deltas equal the finished reply's content (`StreamConsistencyError`
otherwise). See docs/design-docs/vllm-worker-capture.md ("Any chat model", "The streamed path").
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError

from nemo_rl.models.generation.vllm.engine import SamplingRequest
from nemo_rl.models.generation.vllm.errors import (
    InvalidChatRequest,
    StreamConsistencyError,
    TailRenderError,
    TemplateProbeError,
)

LOGGER = logging.getLogger(__name__)

HERMES_TOOL_START = "<tool_call>"  # where a `hermes` reply's tool calls begin (its content ends)
_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
SSE_DONE = b"data: [DONE]\n\n"
CHUNK_OBJECT = "chat.completion.chunk"


class ChatTemplateTokenizer(Protocol):
    eos_token_id: int

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class ParsedAssistant:
    content: str | None
    tool_calls: list[dict]


@dataclass(frozen=True)
class ToolParser:
    """A tool-call parser by vLLM's name; `keeps_special_tokens`: its vLLM class decodes with them."""

    name: str
    parse: Callable[[str], ParsedAssistant]
    keeps_special_tokens: bool = False


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


def function_call(name: str, arguments: str) -> dict:
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
    if HERMES_TOOL_START not in text:
        return ParsedAssistant(content=text, tool_calls=[])
    calls: list[dict] = []
    for closed, left_open in _HERMES_RE.findall(text):
        try:
            obj = json.loads(closed or left_open)
        except json.JSONDecodeError:
            return ParsedAssistant(content=text, tool_calls=[])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return ParsedAssistant(content=text, tool_calls=[])
        calls.append(function_call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    content = text[: text.find(HERMES_TOOL_START)]
    return ParsedAssistant(content=content or None, tool_calls=calls)


HERMES = ToolParser("hermes", parse_hermes, keeps_special_tokens=True)  # the default (`GenerationConfig`)


def generated_text(tokenizer: ChatTemplateTokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def parses_tool_calls(tools: list[dict] | None, tool_choice: Any) -> bool:
    """vLLM's rule for a non-streamed reply: tool calls are parsed only when the request offers
    tools and `tool_choice` is not "none"; otherwise the whole generated text is the content."""
    return bool(tools) and tool_choice != "none"


def assistant_reply(
    tokenizer: ChatTemplateTokenizer, token_ids: list[int], *, parser: ToolParser, parse_tools: bool
) -> ParsedAssistant:
    """The assistant message vLLM's chat server builds from these sampled ids.

    Without tool parsing: the ids decoded without special tokens, all content. With it: decoded
    the way the parser's vLLM class asks (hermes keeps special tokens; the stop token that ended
    the turn is never text, as vLLM's detokenizer drops it) and parsed by `parser`.
    """
    if not parse_tools:
        return ParsedAssistant(content=generated_text(tokenizer, token_ids), tool_calls=[])
    if not parser.keeps_special_tokens:
        return parser.parse(generated_text(tokenizer, token_ids))
    ids = token_ids[:-1] if token_ids and token_ids[-1] == tokenizer.eos_token_id else token_ids
    return parser.parse(tokenizer.decode(ids, skip_special_tokens=False))


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


def context_overflow_message(prompt_len: int, requested: int | None, max_model_len: int) -> str | None:
    """vLLM's context-length rejection for this request, or None when it fits.

    `requested` is the caller's explicit max_tokens (None: the server default, clipped to the
    room left). The wording is vLLM's, so anything that recognizes a vLLM overflow (Gym's gate
    looks for "context length" in a 400) recognizes ours.
    """
    if prompt_len >= max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len} tokens in the messages, Please reduce the length of the messages."
        )
    if requested is not None and prompt_len + requested > max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return None


# --- the turn-end probe (run once at set-up) ---------------------------------------------------

# Sentinel assistant content of the end-of-turn probe (no whitespace: templates may trim).
TURN_END_PROBE = "NRL-TURN-END-PROBE-7f3a"


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


def probe_turn_end(tokenizer: ChatTemplateTokenizer) -> str | TemplateProbeError:
    """`derive_turn_end`, a failure kept (and logged) as the service's answer to every token-in call."""
    try:
        return derive_turn_end(tokenizer)
    except TemplateProbeError as e:
        LOGGER.error("token-in tails cannot be rendered for this model: %s", e)
        return e


# --- streamed replies -------------------------------------------------------------------------


def sse_event(payload: Any) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def chunk(request_id: str, model: str, created: int, delta: dict, finish_reason: str | None = None) -> dict:
    """A `chat.completion.chunk` with one choice."""
    return {
        "id": request_id,
        "object": CHUNK_OBJECT,
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, created: int, usage: dict) -> dict:
    """The chunk `stream_options.include_usage` asks for: no choices, the call's usage."""
    return {"id": request_id, "object": CHUNK_OBJECT, "created": created, "model": model, "choices": [],
            "usage": usage}


def hold_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (so they are not streamed yet)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ContentStreamer:
    """Content deltas of one reply as its ids arrive (see the module contract).

    `decode(ids)` renders the ids generated so far the way the finished reply decodes them; the
    whole text is decoded on every push, so a multi-byte character or a merge across tokens is
    never split (the decode cost grows with the reply's length, not with the history's).
    `mode`: "all" streams every character, "until_marker" stops before `HERMES_TOOL_START`,
    "at_end" streams nothing until `final_chunks`.
    """

    def __init__(self, decode: Callable[[list[int]], str], mode: str) -> None:
        if mode not in ("all", "until_marker", "at_end"):
            raise ValueError(f"mode={mode!r}: must be all, until_marker or at_end")
        self._decode = decode
        self._mode = mode
        self._ids: list[int] = []
        self.streamed = ""
        self._stopped = mode == "at_end"

    def push(self, new_ids: list[int]) -> str:
        """The new content these ids make safe to stream ("" when none)."""
        self._ids.extend(new_ids)
        if self._stopped or not new_ids:
            return ""
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        if self._mode == "until_marker":
            at = text.find(HERMES_TOOL_START)
            if at >= 0:
                text, self._stopped = text[:at], True
            else:
                text = text[: len(text) - hold_back(text, HERMES_TOOL_START)]
        if not text.startswith(self.streamed) or len(text) <= len(self.streamed):
            return ""  # a decode that rewrote earlier text (rare merges): wait, the end reconciles
        delta = text[len(self.streamed) :]
        self.streamed = text
        return delta


def content_mode(parse_tools: bool, parser: str) -> str:
    """The `ContentStreamer` mode for a reply (see the module contract)."""
    if not parse_tools:
        return "all"
    return "until_marker" if parser == "hermes" else "at_end"


def streamed_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """Tool calls in OpenAI's streamed delta shape (each whole, with its `index`)."""
    return [
        {"index": i, "id": call["id"], "type": call.get("type", "function"),
         "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}
        for i, call in enumerate(tool_calls)
    ]


def final_chunks(reply: dict, streamed: str, *, include_usage: bool) -> list[dict]:
    """The chunks that close a stream whose content so far is `streamed` (module contract).

    `reply` is the finished chat completion; its `ng_commit_coords` (when present) rides on the
    finish chunk, the one a relay must read before it lets `[DONE]` through.
    """
    request_id, model, created = reply["id"], reply["model"], reply["created"]
    choice = reply["choices"][0]
    message = choice["message"]
    content = message.get("content")
    if not (content or "").startswith(streamed):
        raise StreamConsistencyError(
            f"stream {request_id}: streamed content {streamed[-40:]!r}... is not a prefix of the reply's content"
        )
    out: list[dict] = []
    rest = (content or "")[len(streamed) :]
    if rest:
        out.append(chunk(request_id, model, created, {"content": rest}))
    if message.get("tool_calls"):
        out.append(chunk(request_id, model, created, {"tool_calls": streamed_tool_calls(message["tool_calls"])}))
    finish = chunk(request_id, model, created, {}, choice["finish_reason"])
    if "ng_commit_coords" in reply:
        finish["ng_commit_coords"] = reply["ng_commit_coords"]
    out.append(finish)
    if include_usage:
        out.append(usage_chunk(request_id, model, created, reply["usage"]))
    return out


def replay_chunks(reply: dict, *, include_usage: bool) -> list[dict]:
    """A finished reply as a whole stream (a re-send replayed): the role chunk, then `final_chunks`."""
    first = chunk(reply["id"], reply["model"], reply["created"], {"role": "assistant", "content": ""})
    return [first, *final_chunks(reply, "", include_usage=include_usage)]


def include_usage(body: dict) -> bool:
    """`stream_options.include_usage` of a streamed request (`data.calls` checked its shape)."""
    options = body.get("stream_options")
    return bool(isinstance(options, dict) and options.get("include_usage"))


def stream_decoder(tokenizer: ChatTemplateTokenizer, mode: str) -> Callable[[list[int]], str]:
    """How `ContentStreamer` decodes the ids so far in `mode`: as `assistant_reply` decodes the reply."""
    eos = tokenizer.eos_token_id
    if mode == "all":
        return lambda ids: generated_text(tokenizer, ids)
    # What `assistant_reply` parses for hermes: special tokens kept, the closing stop token dropped.
    return lambda ids: tokenizer.decode(ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=False)


