"""Pure chat-completions logic of the vLLM worker: prompts, token-in tails, tool calls, responses.

Contract:
- `render_root_prompt` renders the whole conversation with the model's chat template (ROOT calls,
  and every call when capture is off): prompt ids = tokenize(template(messages, tools) + gen prompt).
- `render_token_in_tail` never re-tokenizes history: it renders only the text that follows the
  parent's last sampled token (the end of the last assistant turn) up to and including the
  generation prompt. The caller prepends the parent's exact ids. It raises `TailRenderError`
  when the template does not re-render history as a stable text prefix (then exact custody is
  impossible and the worker reports `capture_failed`).
- `parse_tool_calls` turns `<tool_call>{json}</tool_call>` blocks of generated text into OpenAI
  `tool_calls`; malformed blocks stay plain text (never guessed).
- `build_chat_completion` makes the engine-native OpenAI response: one choice, a unique id, the
  token echo (`prompt_token_ids`, choice `token_ids`, logprobs as `token_id:N`) when asked.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

IM_END = "<|im_end|>"
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_STRIP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class ChatTemplateTokenizer(Protocol):
    eos_token_id: int

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class InvalidChatRequest(ValueError):
    """The request body is not a chat-completions request this worker can serve (HTTP 400)."""


class TailRenderError(ValueError):
    """The conversation cannot be split into exact parent prefix + newly rendered tail."""


@dataclass(frozen=True)
class ParsedAssistant:
    content: str | None
    tool_calls: list[dict]


def normalize_messages(messages: Any) -> list[dict]:
    """Validate chat messages and map `developer` to `system` (ChatML has no developer role)."""
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
        out.append(m)
    return out


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


def render_token_in_tail(
    tokenizer: ChatTemplateTokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    *,
    prefix_ends_with_eos: bool,
) -> list[int]:
    """Token ids of everything after the parent's last sampled token, through the gen prompt."""
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise TailRenderError("a token_in call must carry the parent's assistant turn in messages")
    history = render_text(tokenizer, messages[: last_assistant + 1], tools, gen_prompt=False)
    full = render_text(tokenizer, messages, tools, gen_prompt=True)
    if not full.startswith(history):
        raise TailRenderError("the chat template re-renders history differently once later turns are added")
    end = history.rfind(IM_END)
    if end < 0:
        raise TailRenderError(f"the rendered assistant turn does not end with {IM_END}")
    # A turn that ended on EOS already holds <|im_end|> among the sampled ids; a turn cut by
    # max_tokens does not, so the tail must close it.
    boundary = end + len(IM_END) if prefix_ends_with_eos else end
    tail = full[boundary:]
    if not tail:
        raise TailRenderError("nothing to render after the parent's turn")
    return tokenizer.encode(tail, add_special_tokens=False)


def parse_tool_calls(text: str) -> ParsedAssistant:
    calls: list[dict] = []
    spans: list[tuple[int, int]] = []
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"), dict):
            continue
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])},
            }
        )
        spans.append(m.span())
    remaining = text
    for start, end in reversed(spans):
        remaining = remaining[:start] + remaining[end:]
    remaining = remaining.strip()
    return ParsedAssistant(content=remaining or (None if calls else ""), tool_calls=calls)


def generated_text(tokenizer: ChatTemplateTokenizer, token_ids: list[int]) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    for tok in _STRIP_TOKENS:
        text = text.replace(tok, "")
    return text


@dataclass(frozen=True)
class SamplingRequest:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    logprobs: bool
    return_token_ids: bool
    max_tokens_explicit: bool = False  # the caller set max_tokens (else the server default, clipped to fit)


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
        choice["logprobs"] = {
            "content": [
                {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(token_ids, logprobs)
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
