"""The worker's one boundary to vLLM's tool-call and reasoning parsers (only importer of `vllm.parser`,
`vllm.tool_parsers`, `vllm.reasoning`, lazily), called in the order stock vLLM's chat server calls them.

Contract: `resolve_parsers` resolves both names in vLLM's registries once (a name, tokenizer or pair
vLLM refuses is a `GenerationSetupError` of kind `tool_call_parser` / `reasoning_parser`);
`ChatParsers.prepare(body)` is vLLM's adjusted request (`skip_special_tokens` to decode with; a body
vLLM refuses is `InvalidChatRequest`); `ChatParsers.parse` is the whole reply and
`ChatParsers.stream(...).push` the deltas, each field for field what stock vLLM returns for the same
text and ids (reasoning under `reasoning`, as vLLM 0.32 names it). Tool-call ids are
`mint_tool_call_id()`'s where vLLM would mint a random one, the same in every delta of a call.
Invariant: `ReplyStream.close` returns the concatenation of the deltas sent as the reply of record,
beside the whole parse and whether they agree (vLLM's two paths differ on some malformed or cut
replies: named, never rewritten); misuse of a stream is a `StreamConsistencyError`.
See docs/design-docs/vllm-worker-capture.md ("vLLM's own parsers").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_rl.models.generation.vllm.config import GenerationSetupError
from nemo_rl.models.generation.vllm.errors import InvalidChatRequest, StreamConsistencyError

# What of a chat body vLLM's parsers read (tool choice, history for Kimi's id counter, reasoning
# switches, decoding, constraints); the rest of the body is no parser's business.
PARSER_FIELDS = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "include_reasoning",
    "chat_template_kwargs",
    "reasoning_effort",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "response_format",
    "structured_outputs",
)

# vLLM's `make_tool_call_id` for the "random" id type; ids of any other form come from the model.
_VLLM_RANDOM_TOOL_CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]+")
# `build_chat_params` wants a default template and content format; the template kwargs read here
# (the request's own, plus what `reasoning_effort` implies) depend on neither.
_CONTENT_FORMAT = "auto"
_HARMONY_MODEL_TYPE = "gpt_oss"


@dataclass(frozen=True)
class ParsedReply:
    """The assistant message and finish reason stock vLLM returns for one generated reply.

    `tool_calls` are OpenAI tool-call dicts (`id`, `type`, `function` with `name` and `arguments`);
    a reply with tool calls carries the finish reason `tool_calls` unless the tool was named.
    """

    reasoning: str | None
    content: str | None
    tool_calls: tuple[dict, ...]
    finish_reason: str

    def __post_init__(self) -> None:
        for call in self.tool_calls:
            if set(call) != {"id", "type", "function"} or set(call["function"]) != {"name", "arguments"}:
                raise ValueError(f"a tool call must hold id, type and function(name, arguments): {call!r}")

    def message(self) -> dict:
        """The chat completion's assistant message (tool_calls only when there are some, as stock)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content, "reasoning": self.reasoning}
        if self.tool_calls:
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self.tool_calls]
        return msg


@dataclass(frozen=True)
class ParseRequest:
    """vLLM's request object for one chat body, adjusted by the parser as stock's renderer does."""

    vllm_request: Any  # vllm's ChatCompletionRequest
    chat_template_kwargs: dict
    skip_special_tokens: bool
    structured_outputs: Any  # vLLM's StructuredOutputsParams the parser asked for (required/named tools), or None

    @property
    def tool_choice(self) -> Any:
        return self.vllm_request.tool_choice


def reply_text(tokenizer: Any, token_ids: Sequence[int], *, skip_special_tokens: bool, stop_terminated: bool) -> str:
    """The reply's text as vLLM's detokenizer makes it: the stop token that ended the turn (eos or a
    stop token id) is not text; the rest decoded with the request's `skip_special_tokens`."""
    ids = list(token_ids[:-1] if stop_terminated and token_ids else token_ids)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _vllm_id(call_id: str | None) -> bool:
    return call_id is None or _VLLM_RANDOM_TOOL_CALL_ID.fullmatch(call_id) is not None


def _is_named(tool_choice: Any) -> bool:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

    return type(tool_choice) is ChatCompletionNamedToolChoiceParam


def _setup_error(kind: str, value: str, why: str) -> GenerationSetupError:
    flag = f"--{kind.replace('_', '-')}"
    return GenerationSetupError(
        f"generation.{kind}={value!r} cannot be set up in the worker's vLLM: {why} (fix: set generation.{kind} to "
        f"a name stock vLLM's {flag} accepts for this model and tokenizer)",
        kind=kind,  # type: ignore[arg-type]  # the two parser kinds are the field names
    )


class ChatParsers:
    """vLLM's composed parser class for the worker's two parser names, with the worker's tokenizer.

    Built once by `resolve_parsers`; every request gets fresh parser instances (vLLM's parsers keep
    per-reply state), as stock's server makes one per choice.
    """

    def __init__(
        self,
        parser_cls: Any,
        tokenizer: Any,
        *,
        mint_tool_call_id: Callable[[], str],
        model_config: Any = None,
    ) -> None:
        self._parser_cls = parser_cls
        self._tokenizer = tokenizer
        self._mint = mint_tool_call_id
        self._model_config = model_config

    @property
    def has_reasoning_parser(self) -> bool:
        return self._parser_cls.reasoning_parser_cls is not None

    @property
    def vllm_parser_cls(self) -> Any:
        """vLLM's composed `Parser` class (what stock's server holds for the same two names)."""
        return self._parser_cls

    def _new_parser(self, request: ParseRequest) -> Any:
        return self._parser_cls(
            self._tokenizer,
            request.vllm_request.tools,
            chat_template_kwargs=request.chat_template_kwargs,
            model_config=self._model_config,
        )

    def prepare(self, body: Mapping[str, Any]) -> ParseRequest:
        """vLLM's request for `body`, adjusted as stock's renderer adjusts it before sampling."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        fields = {k: body[k] for k in PARSER_FIELDS if k in body}
        try:
            request = ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            raise InvalidChatRequest(f"vLLM's chat request model refuses the body: {e}") from e
        kwargs = request.build_chat_params(None, _CONTENT_FORMAT).chat_template_kwargs
        # Stock's renderer lets the parser adjust the request (decoding, constraints) when a
        # reasoning parser is set, tools may be called, or the parser always asks to.
        if (
            self._parser_cls.always_adjust_request
            or self._parser_cls.reasoning_parser_cls is not None
            or request.tool_choice != "none"
        ):
            request = self._parser_cls(
                self._tokenizer, request.tools, model_config=self._model_config, chat_template_kwargs=kwargs
            ).adjust_request(request=request)
        return ParseRequest(
            vllm_request=request,
            chat_template_kwargs=kwargs,
            skip_special_tokens=request.skip_special_tokens,
            structured_outputs=request.structured_outputs,
        )

    def parse(
        self,
        request: ParseRequest,
        *,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        text: str,
        finish_reason: str | None,
    ) -> ParsedReply:
        """The whole reply stock's full generator returns for `text` (decoded from `token_ids`)."""
        return self._parse(request, prompt_token_ids, token_ids, text, finish_reason, self._mint)

    def _parse(
        self,
        request: ParseRequest,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        text: str,
        finish_reason: str | None,
        mint: Callable[[], str],
    ) -> ParsedReply:
        req = request.vllm_request
        parser = self._new_parser(request)
        parser.set_prompt_token_ids(list(prompt_token_ids))
        reasoning, content, calls = parser.parse(
            text, req, enable_auto_tools=True, model_output_token_ids=list(token_ids)
        )
        if not req.include_reasoning:
            reasoning = None
        named, required = _is_named(req.tool_choice), req.tool_choice == "required"
        auto_called = False
        if named or required:
            content, kept = content or "", list(calls or [])
        elif not req.tool_choice or req.tool_choice == "none":
            kept = []
        elif req.tools and req.tool_choice == "auto":
            kept = list(calls or [])
            auto_called = bool(kept)
        else:
            kept = []
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        kept = maybe_filter_parallel_tool_calls(kept, req)
        tool_calls = tuple(
            {
                "id": mint() if _vllm_id(c.id) else c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in kept
        )
        tools_finish = auto_called or (required and finish_reason == "stop")
        return ParsedReply(
            reasoning=reasoning,
            content=content,
            tool_calls=tool_calls,
            finish_reason="tool_calls" if tools_finish else (finish_reason or "stop"),
        )

    def stream(self, request: ParseRequest, *, prompt_token_ids: Sequence[int]) -> ReplyStream:
        return ReplyStream(self, request, self._new_parser(request), list(prompt_token_ids))

    def mint_for(self, parser_id: str | None) -> str | None:
        """The id a streamed call carries: ours where vLLM minted a random one, else the parser's."""
        if parser_id is None:
            return None
        return self._mint() if _vllm_id(parser_id) else parser_id


@dataclass
class _StreamedCall:
    id: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass
class ReplyStream:
    """One streamed reply: vLLM's `parse_delta` per engine step, as stock's stream generator calls it."""

    parsers: ChatParsers
    request: ParseRequest
    _parser: Any
    _prompt_token_ids: list[int]
    _text: list[str] = field(default_factory=list)
    _token_ids: list[int] = field(default_factory=list)
    _reasoning: list[str] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _calls: dict[int, _StreamedCall] = field(default_factory=dict)
    _finished: bool = False

    @property
    def tools_streamed(self) -> bool:
        return bool(self._calls)

    def push(self, delta_text: str, delta_token_ids: Sequence[int], *, finished: bool) -> dict | None:
        """The `delta` of this step's chunk as stock serializes it (`exclude_unset`), or None."""
        if self._finished:
            raise StreamConsistencyError("a step was pushed after the finishing step")
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

        self._text.append(delta_text)
        self._token_ids.extend(delta_token_ids)
        self._finished = finished
        delta = self._parser.parse_delta(
            delta_text=delta_text,
            delta_token_ids=list(delta_token_ids),
            request=self.request.vllm_request,
            prompt_token_ids=self._prompt_token_ids,
            finished=finished,
        )
        if delta is None:
            return None
        delta = maybe_filter_parallel_tool_calls(delta, self.request.vllm_request)
        out = delta.model_dump(mode="json", exclude_unset=True)
        for call in out.get("tool_calls", []):
            seen = self._calls.setdefault(call["index"], _StreamedCall())
            if call.get("id") is not None:
                if seen.id is None:
                    seen.id = self.parsers.mint_for(call["id"])
                call["id"] = seen.id
            fn = call.get("function") or {}
            seen.name += fn.get("name") or ""
            seen.arguments += fn.get("arguments") or ""
        self._reasoning.append(out.get("reasoning") or "")
        self._content.append(out.get("content") or "")
        return out

    def finish_reason(self, engine_reason: str | None) -> str:
        """Stock's streamed finish reason: `tool_calls` when calls were streamed and the turn stopped,
        unless the tool was named."""
        if self.tools_streamed and not _is_named(self.request.tool_choice) and engine_reason == "stop":
            return "tool_calls"
        return engine_reason or "stop"

    def close(self, engine_reason: str | None) -> StreamedReply:
        """The reply the deltas add up to, beside stock's whole parse of the same text and ids."""
        if not self._finished:
            raise StreamConsistencyError("the stream was closed before its finishing step was pushed")
        streamed = ParsedReply(
            reasoning="".join(self._reasoning) or None,
            content="".join(self._content) or None,
            tool_calls=tuple(
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for _, c in sorted(self._calls.items())
            ),
            finish_reason=self.finish_reason(engine_reason),
        )
        # The whole parse mints no ids: only the streamed ones reach the client.
        whole = self.parsers._parse(
            self.request, self._prompt_token_ids, self._token_ids, "".join(self._text), engine_reason, _no_id
        )
        return StreamedReply(streamed=streamed, whole=whole)


@dataclass(frozen=True)
class StreamedReply:
    """What one streamed reply came to.

    `streamed` is the sum of the deltas the client received, the reply of record of a streamed
    call; `whole` is what stock's non-streamed server makes of the same text and ids (its
    tool-call ids empty). vLLM's streaming and whole parsers disagree on some replies (measured
    with vLLM 0.32: a hermes call cut by max_tokens or holding malformed JSON streams as a call,
    parses whole as text; whitespace before a hermes call streams as content, parses whole as
    None; llama3_json text before the JSON streams as text, parses whole as a call): `agrees`
    says so, and `disagreement` names both, for the caller to count and log, never to rewrite.
    """

    streamed: ParsedReply
    whole: ParsedReply

    @property
    def agrees(self) -> bool:
        return _comparable(self.streamed) == _comparable(self.whole)

    def disagreement(self) -> str | None:
        if self.agrees:
            return None
        return (
            f"the streamed deltas add up to {_comparable(self.streamed)!r}, the whole reply parses as "
            f"{_comparable(self.whole)!r}"
        )


def _no_id() -> str:
    return ""


def _comparable(reply: ParsedReply) -> tuple:
    # Ids are minted per parse; the call structure, names, arguments and text must agree.
    return (
        reply.reasoning,
        reply.content,
        tuple((c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls),
        reply.finish_reason,
    )


def resolve_parsers(
    tokenizer: Any,
    *,
    tool_call_parser: str,
    reasoning_parser: str | None,
    mint_tool_call_id: Callable[[], str],
    model_config: Any = None,
) -> ChatParsers:
    """Both names resolved in vLLM's registries and composed as stock's server composes them.

    `model_config` is the engine's vLLM `ModelConfig` when the caller has one (stock passes it to
    every parser: Kimi's tool-call id type, gpt-oss's Harmony parser); None for a tokenizer alone.
    """
    from vllm.parser import ParserManager
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    tools = ToolParserManager.list_registered()
    if tool_call_parser not in tools:
        raise _setup_error("tool_call_parser", tool_call_parser, f"vLLM's tool-parser registry ({len(tools)} names) lacks it")
    reasonings = ReasoningParserManager.list_registered()
    if reasoning_parser is not None and reasoning_parser not in reasonings:
        raise _setup_error(
            "reasoning_parser", reasoning_parser, f"vLLM's reasoning-parser registry ({len(reasonings)} names) lacks it"
        )
    hf_config = getattr(model_config, "hf_config", None)
    common = {
        "enable_auto_tools": True,
        "model_name": getattr(model_config, "model", None),
        "is_harmony": getattr(hf_config, "model_type", None) == _HARMONY_MODEL_TYPE,
        "tokenizer": tokenizer,
    }
    # Each name alone first, so a failure names the knob that caused it; then the pair.
    steps = [("tool_call_parser", tool_call_parser, {"tool_parser_name": tool_call_parser})]
    if reasoning_parser is not None:
        steps.append(("reasoning_parser", reasoning_parser, {"reasoning_parser_name": reasoning_parser}))
        steps.append(
            (
                "reasoning_parser",
                reasoning_parser,
                {"tool_parser_name": tool_call_parser, "reasoning_parser_name": reasoning_parser},
            )
        )
    parser_cls = None
    for kind, value, names in steps:
        try:
            parser_cls = ParserManager.get_parser(**names, **common)
        except (TypeError, ValueError, KeyError) as e:
            raise _setup_error(kind, value, f"{type(e).__name__}: {e}") from e
    return ChatParsers(parser_cls, tokenizer, mint_tool_call_id=mint_tool_call_id, model_config=model_config)
