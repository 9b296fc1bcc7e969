"""The worker's chat-completions core: honours `ng_capture` admissions over an exact-id engine.

Owns `ChatService` (`worker.py`'s HTTP transport is a thin shell over it); admitted calls go
through the custody core (`custody.CustodyCore`). Promises: a plain call is answered as stock
vLLM would; an admitted call's prompt is the parent's exact ids plus the newly rendered tail,
admitted once by Gym's `begin_call` before anything is generated, and its reply carries no
token echo (the staged record is the source of truth). Refuses generation from an unverified
prefix, a second generation of a call (a byte-identical re-send is replayed) and a silently
uncaptured success (custody failing after generation is `capture_failed`, counted). Invariant:
only durable rows enter the `PrefixCache`; errors are named `ApiError`s, anything else is a bug
that propagates. `stream=true` is `streaming.open_chat_stream`'s, over this service's public parts.
See docs/design-docs/vllm-worker-capture.md ("One request" to "Errors, context overflow ...").
"""


from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

from jinja2 import TemplateError

from nemo_rl.data.errors import ApiError
from nemo_rl.models.generation.vllm.chat import (
    ChatTemplateTokenizer,
    InvalidChatRequest,
    SamplingRequest,
    TailRenderError,
    TemplateProbeError,
    assistant_reply,
    build_chat_completion,
    chat_tools,
    derive_turn_end,
    get_tool_call_parser,
    new_request_id,
    normalize_messages,
    parses_tool_calls,
    render_root_prompt,
    render_token_in_tail,
    sampled_turn_close,
    sampling_from_body,
)
from nemo_rl.models.generation.vllm.custody import CustodyCore, GenerationResultLike
from nemo_rl.models.generation.vllm.engine import (
    EngineFailedError,
    GenerationTimeoutError,
    RefitGateTimeoutError,
)
from nemo_rl.models.generation.vllm.custody_state import PrefixCache
from nemo_rl.data.calls import RequestFieldError, ServedCall, check_chat_request
from nemo_rl.utils import instrumentation  # opt-in per-call cost (benchmarks/capture_ab.py)

LOGGER = logging.getLogger(__name__)


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
        tool_call_parser: str,
        custody: CustodyCore | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 1")
        self._engine = engine
        self._tokenizer = tokenizer
        get_tool_call_parser(tool_call_parser)  # an unknown name fails here, at construction
        self._tool_call_parser = tool_call_parser
        # The template's end-of-turn text, probed once; if the template hides it, every token-in
        # call is capture_failed (plain and ROOT calls are unaffected).
        try:
            self._turn_end: str | None = derive_turn_end(tokenizer)
            self._turn_end_error: str | None = None
        except TemplateProbeError as e:
            self._turn_end, self._turn_end_error = None, str(e)
            LOGGER.error("token-in tails cannot be rendered for this model: %s", e)
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
    def capture_failures(self) -> list[dict]:
        return list(self.custody.capture_failures) if self.custody is not None else []

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.custody.prefix_cache if self.custody is not None else None

    @property
    def capture(self) -> Any:
        """The custody core's capture (Gym's `RolloutTokenCapture`, possibly wrapped); None when off."""
        return self.custody.capture if self.custody is not None else None

    def install_token_capture(self, capture: Any) -> None:
        """Swap the custody core's capture (`instrumentation.time_capture_calls` wraps it)."""
        if self.custody is None:
            raise RuntimeError("install_token_capture on a ChatService without custody (token capture is off)")
        self.custody.install_token_capture(capture)

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
        return self._tool_call_parser

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

    def served_rollouts_pending(self) -> int:
        return self.custody.served_rollouts_pending() if self.custody is not None else 0

    def render_tail(self, messages: list[dict], tools: list[dict] | None, prefix: list[int]) -> list[int]:
        """The token-in tail after `prefix` (`TailRenderError` when it cannot be exact; a template refusal is 400)."""
        if self._turn_end is None:
            raise TailRenderError(f"no end-of-turn marker: {self._turn_end_error}")
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

    def tokenize(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise ApiError("invalid_request", "request body must be a JSON object", param="body")
        try:
            if "messages" in body:
                check_chat_request({"messages": body["messages"], "tools": body.get("tools")}, max_model_len=self._max_model_len)
                ids = self.render_root(normalize_messages(body["messages"]), chat_tools(body.get("tools")))
            elif isinstance(body.get("prompt"), str):
                ids = self._tokenizer.encode(body["prompt"], add_special_tokens=False)
            else:
                raise RequestFieldError("messages", "tokenize needs `messages` (chat) or `prompt` (a string)")
        except RequestFieldError as e:
            raise ApiError("invalid_request", e.message, param=e.field) from e
        except InvalidChatRequest as e:
            raise ApiError("invalid_request", str(e)) from e
        return {"tokens": ids, "count": len(ids)}

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
            self._tokenizer, result.token_ids, parser=self._tool_call_parser, parse_tools=parse_tools
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

