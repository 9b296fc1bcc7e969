"""The worker's chat service: renders, generates and replies; admitted calls go through custody.

`ChatService` (`worker.py`'s HTTP transport is a thin shell over it) with its pure parts: the
prompt from the model's own chat template, the token-in tail, the `hermes` tool-call parser, the
sampling and the OpenAI reply (other parsers: `tool_parsers`; the end-of-turn probe: `lifecycle`).
Promises: a plain call is answered as stock vLLM would; an admitted (`ng_capture`) call goes through
`custody.CustodyCore` and its prompt is the parent's exact ids plus the newly rendered tail (never
re-tokenized history); its reply carries no token echo. Refuses, by a named `ApiError`, a template
refusal, a context overflow and a tail that cannot be placed exactly (`TailRenderError`: the call is
`capture_failed`, never a silently different prompt); anything else is a bug that propagates.
`stream=true` is `streaming.open_chat_stream`'s. See docs/design-docs/vllm-worker-capture.md.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from jinja2 import TemplateError

from nemo_rl.data.calls import RequestFieldError, ServedCall, check_chat_request
from nemo_rl.data.errors import ApiError, RecoverableError
from nemo_rl.models.generation.vllm.custody import CustodyCore, GenerationResultLike
from nemo_rl.models.generation.vllm.custody_state import TailRenderError
from nemo_rl.models.generation.vllm.engine import (
    EngineFailedError,
    GenerationTimeoutError,
    InvalidChatRequest,
    RefitGateTimeoutError,
    SamplingRequest,
)
from nemo_rl.utils import instrumentation  # opt-in per-call cost (benchmarks/capture_ab.py)

_HERMES_START = "<tool_call>"
_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
class TemplateProbeError(RecoverableError, ValueError):
    """The chat template does not mark the end of an assistant turn in a way that can be found."""


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
        calls.append(function_call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    content = text[: text.find(_HERMES_START)]
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


def record_generation(started: float, prompt_ids: list[int], result: GenerationResultLike) -> None:
    """The engine's part of one call's cost (both paths; read by benchmarks/capture_ab.py)."""
    instrumentation.add_call_cost("generate_s", time.perf_counter() - started)
    instrumentation.set_call_fact("generate_t0_s", started)
    instrumentation.set_call_fact("prompt_tokens", len(prompt_ids))
    instrumentation.set_call_fact("generated_tokens", len(result.token_ids))


class Generator(Protocol):
    weight_version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> GenerationResultLike: ...


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


class ChatService:
    """Chat completions over an exact-id engine; admitted calls go through `custody` (None: capture off)."""

    def __init__(
        self,
        engine: Generator,
        tokenizer: ChatTemplateTokenizer,
        *,
        model_name: str,
        default_max_tokens: int,
        max_model_len: int,
        turn_end: str | TemplateProbeError,
        tool_call_parser: ToolParser = HERMES,
        custody: CustodyCore | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 1")
        self._engine = engine
        self._tokenizer = tokenizer
        self._parser = tool_call_parser
        # The template's end-of-turn text, probed once at set-up (`lifecycle.probe_turn_end`); a
        # failed probe makes every token-in call capture_failed (plain and ROOT calls are unaffected).
        self._turn_end = turn_end
        self._model_name = model_name
        self._default_max_tokens = default_max_tokens
        self._max_model_len = max_model_len
        self.custody = custody
        self._stats: Counter[str] = Counter()

    @property
    def stats(self) -> Counter[str]:
        """Call counters: this layer's (plain calls, refusals) plus the custody core's (a snapshot)."""
        return self._stats + self.custody.stats if self.custody is not None else Counter(self._stats)

    @property
    def weight_version(self) -> int:
        return self._engine.weight_version

    @property
    def engine(self) -> Generator:
        return self._engine

    @property
    def tokenizer(self) -> ChatTemplateTokenizer:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def tool_call_parser(self) -> str:
        return self._parser.name

    def parse_chat(self, body: Any, *, streamed: bool) -> tuple[list[dict], list[dict] | None, SamplingRequest]:
        """The checked request's messages, tools and sampling (`ApiError` 400 naming the field otherwise)."""
        try:
            check_chat_request(body, max_model_len=self._max_model_len)
            if streamed and body.get("ng_capture") is None and (body.get("logprobs") or body.get("return_token_ids")):
                raise RequestFieldError("logprobs", "logprobs and return_token_ids are not streamed by this worker "
                                        "(fix: send them without stream=true)")
        except RequestFieldError as e:
            raise ApiError("invalid_request", e.message, param=e.field) from e
        try:
            messages = normalize_messages(body.get("messages"))
            tools = chat_tools(body.get("tools"))
            sampling = sampling_from_body(body, default_max_tokens=self._default_max_tokens)
        except InvalidChatRequest as e:
            raise ApiError("invalid_request", str(e)) from e
        return messages, tools, sampling

    async def chat_completions(self, body: Any) -> dict:
        messages, tools, sampling = self.parse_chat(body, streamed=False)
        raw_admission = body.get("ng_capture")
        if raw_admission is None:
            return await self._serve_plain(
                messages, tools, sampling, parse_tools=parses_tool_calls(tools, body.get("tool_choice"))
            )
        return await self.require_custody().serve(body, raw_admission, messages, tools, sampling, self)

    def require_custody(self) -> CustodyCore:
        """The custody core an admitted (`ng_capture`) call needs, whole or streamed; 400 without one."""
        if self.custody is None:
            raise ApiError(
                "capture_not_installed",
                "request carries ng_capture but token capture is not installed on this worker "
                "(set token_capture.enabled=true, or point the gate at a capture-off worker)",
                param="ng_capture",
            )
        return self.custody

    def take_served(self, rollout_ids: list[str]) -> list[ServedCall]:
        """Pop the served-call records of `rollout_ids` (`CustodyCore.take_served`; none without custody)."""
        return self.custody.take_served(rollout_ids) if self.custody is not None else []

    def render_tail(self, messages: list[dict], tools: list[dict] | None, prefix: list[int]) -> list[int]:
        """The token-in tail after `prefix` (`TailRenderError` when it cannot be exact; a template refusal is 400)."""
        if isinstance(self._turn_end, TemplateProbeError):
            raise TailRenderError(f"no end-of-turn marker: {self._turn_end}")
        try:
            return render_token_in_tail(
                self._tokenizer,
                messages,
                tools,
                turn_end=self._turn_end,
                sampled_close=sampled_turn_close(self._tokenizer, prefix),
            )
        except TemplateError as e:
            raise ApiError(
                "invalid_request", f"the model's chat template cannot render these messages: {e}", param="messages",
            ) from e

    def reply(self, result: GenerationResultLike) -> dict:
        """An admitted call's reply: no token echo, whatever the request asked."""
        return self._response(result, include_logprobs=False, include_token_ids=False)

    def fit_context(self, prompt_ids: list[int], sampling: SamplingRequest) -> SamplingRequest:
        """400 on context overflow; otherwise the sampling with max_tokens clipped to the room left."""
        requested = sampling.max_tokens if sampling.max_tokens_explicit else None
        message = context_overflow_message(len(prompt_ids), requested, self._max_model_len)
        if message is not None:
            self._stats["context_length_exceeded"] += 1
            field = "messages" if len(prompt_ids) >= self._max_model_len else "max_tokens"
            raise ApiError("context_length_exceeded", message, param=field)
        room = self._max_model_len - len(prompt_ids)
        return sampling if sampling.max_tokens <= room else replace(sampling, max_tokens=room)

    def render_root(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The whole conversation through the model's template; a template refusal is the caller's 400."""
        try:
            return render_root_prompt(self._tokenizer, messages, tools)
        except TemplateError as e:  # templates `raise_exception` on conversations they do not accept
            raise ApiError(
                "invalid_request", f"the model's chat template cannot render these messages: {e}", param="messages"
            ) from e

    async def _serve_plain(
        self, messages: list[dict], tools: list[dict] | None, sampling: SamplingRequest, *, parse_tools: bool
    ) -> dict:
        prompt_ids = self.render_root(messages, tools)
        sampling = self.fit_context(prompt_ids, sampling)
        return self.plain_reply(await self.generate(prompt_ids, sampling), sampling, parse_tools=parse_tools)

    def plain_reply(self, result: GenerationResultLike, sampling: SamplingRequest, *, parse_tools: bool) -> dict:
        """A plain (capture-off) call's reply, with the token echo its request asked for; counted served."""
        self._stats["plain_calls"] += 1
        self._stats["served_calls"] += 1
        return self._response(
            result,
            include_logprobs=sampling.logprobs,
            include_token_ids=sampling.return_token_ids,
            parse_tools=parse_tools,
            tokens_as_ids=sampling.return_tokens_as_token_ids,
        )

    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest) -> GenerationResultLike:
        started = time.perf_counter()
        with self.engine_errors():
            result = await self._engine.generate(prompt_ids, sampling, new_request_id())
            record_generation(started, prompt_ids, result)
            return result

    @contextlib.contextmanager
    def engine_errors(self) -> Iterator[None]:
        """The engine's failures as the `ApiError`s the transport answers (one mapping for both paths)."""
        try:
            yield
        except InvalidChatRequest as e:
            raise ApiError("invalid_request", str(e)) from e
        except EngineFailedError as e:
            raise ApiError("worker_failed", str(e)) from e
        except GenerationTimeoutError as e:
            self._stats["generation_timeout"] += 1
            raise ApiError("generation_timeout", str(e)) from e
        except RefitGateTimeoutError as e:
            raise ApiError("worker_refitting", str(e)) from e

    def _response(
        self,
        result: GenerationResultLike,
        *,
        include_logprobs: bool,
        include_token_ids: bool,
        parse_tools: bool = True,
        tokens_as_ids: bool = True,
    ) -> dict:
        parsed = assistant_reply(
            self._tokenizer, result.token_ids, parser=self._parser, parse_tools=parse_tools
        )
        return build_chat_completion(
            request_id=result.request_id,
            model=self._model_name,
            parsed=parsed,
            finish_reason=result.finish_reason,
            prompt_token_ids=result.prompt_token_ids,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            include_logprobs=include_logprobs,
            include_token_ids=include_token_ids,
            # vLLM names a logprob entry by the token's own text unless asked for `token_id:N`.
            logprob_tokens=None if tokens_as_ids or not include_logprobs else [
                self._tokenizer.decode([t], skip_special_tokens=False) for t in result.token_ids
            ],
        )

