"""The worker's chat-completions core: honours `ng_capture` admissions over an exact-id engine.

Contract (the transport, `server.py`, is a thin shell over `ChatService`):
- No admission: render the whole conversation, generate, and echo tokens when asked
  (`return_token_ids` -> `prompt_token_ids` + choice `token_ids`; `logprobs` -> `token_id:N`).
- ROOT (`mode="text"`): same prompt, plus custody: the delta `prompt + generated` is staged
  through Gym's `RolloutTokenCapture` before the response is returned with `ng_commit_coords`.
- token-in: the prompt is the parent's exact ids (inline `required_prefix_token_ids`, or the
  `staging_chain` resolved through the bounded `PrefixCache`; an empty inline list never counts
  as "no prefix") followed by the newly rendered tail only.
- Never a silently uncaptured success: if custody fails after generation (tail cannot be
  rendered exactly, staging fails or times out), the reply carries `capture_failed` coords and
  the reason is counted and kept in `capture_failures`.
- Caller errors are `HttpError`s with a status and a named type: 400 for an invalid request or
  admission, 503 when the staged prefix cannot be fetched, 409 when it does not match the
  admission. Generation never starts from an unverified prefix.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from nemo_gym.token_id_capture.staging import CaptureAdmission, CaptureError, RolloutTokenCapture
from nemo_rl.models.generation.vllm.chat import (
    ChatTemplateTokenizer,
    InvalidChatRequest,
    SamplingRequest,
    TailRenderError,
    build_chat_completion,
    chat_tools,
    generated_text,
    new_request_id,
    normalize_messages,
    parse_tool_calls,
    render_root_prompt,
    render_token_in_tail,
    sampling_from_body,
)
from nemo_rl.models.generation.vllm.prefix_cache import PrefixCache, PrefixError, PrefixMismatchError

LOGGER = logging.getLogger(__name__)


class HttpError(Exception):
    def __init__(self, status: int, err_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.message = message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "code": self.status}}


class GenerationResultLike(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class Generator(Protocol):
    weight_version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> GenerationResultLike: ...


@dataclass(frozen=True)
class _Plan:
    admission: CaptureAdmission | None
    prefix: list[int] | None
    prompt_ids: list[int]
    tail_error: str | None


class ChatService:
    def __init__(self, engine: Generator, tokenizer: ChatTemplateTokenizer, *, model_name: str, default_max_tokens: int) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._default_max_tokens = default_max_tokens
        self.capture: RolloutTokenCapture | None = None
        self.prefix_cache: PrefixCache | None = None
        self.stats: Counter[str] = Counter()
        self.capture_failures: deque[dict] = deque(maxlen=1000)

    # Gym's `install_capture(serving_layer, ...)` seam.
    def install_token_capture(self, capture: RolloutTokenCapture) -> None:
        self.capture = capture

    def install_prefix_cache(self, cache: PrefixCache) -> None:
        self.prefix_cache = cache

    async def chat_completions(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise HttpError(400, "invalid_request", "request body must be a JSON object")
        try:
            if body.get("stream"):
                raise InvalidChatRequest("stream=true is not supported: token custody needs complete responses")
            messages = normalize_messages(body.get("messages"))
            tools = chat_tools(body.get("tools"))
            sampling = sampling_from_body(body, default_max_tokens=self._default_max_tokens)
        except InvalidChatRequest as e:
            raise HttpError(400, "invalid_request", str(e)) from e
        raw_admission = body.get("ng_capture")
        if raw_admission is None:
            return await self._serve_plain(messages, tools, sampling)
        plan = await self._plan_admitted(raw_admission, body, messages, tools)
        return await self._serve_admitted(plan, sampling)

    def tokenize(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise HttpError(400, "invalid_request", "request body must be a JSON object")
        try:
            if "messages" in body:
                ids = render_root_prompt(self._tokenizer, normalize_messages(body["messages"]), chat_tools(body.get("tools")))
            elif isinstance(body.get("prompt"), str):
                ids = self._tokenizer.encode(body["prompt"], add_special_tokens=False)
            else:
                raise InvalidChatRequest("tokenize needs `messages` (chat) or `prompt` (text)")
        except InvalidChatRequest as e:
            raise HttpError(400, "invalid_request", str(e)) from e
        return {"tokens": ids, "count": len(ids)}

    async def _serve_plain(self, messages: list[dict], tools: list[dict] | None, sampling: SamplingRequest) -> dict:
        prompt_ids = render_root_prompt(self._tokenizer, messages, tools)
        result = await self._generate(prompt_ids, sampling)
        self.stats["plain_calls"] += 1
        return self._response(result, include_logprobs=sampling.logprobs, include_token_ids=sampling.return_token_ids)

    async def _plan_admitted(self, raw: Any, body: dict, messages: list[dict], tools: list[dict] | None) -> _Plan:
        if self.capture is None:
            raise HttpError(
                400,
                "capture_not_installed",
                "request carries ng_capture but token capture is not installed on this worker "
                "(set token_capture.enabled=true, or point the gate at a capture-off worker)",
            )
        try:
            admission = CaptureAdmission.model_validate(raw)
        except ValidationError as e:
            raise HttpError(400, "invalid_capture_admission", f"ng_capture is not a valid CaptureAdmission: {e}") from e
        if admission.mode == "text":
            prefix = None
            prompt_ids, tail_error = render_root_prompt(self._tokenizer, messages, tools), None
        else:
            prefix = await self._resolve_prefix(admission, body)
            try:
                tail = render_token_in_tail(
                    self._tokenizer, messages, tools, prefix_ends_with_eos=bool(prefix) and prefix[-1] == self._tokenizer.eos_token_id
                )
                prompt_ids, tail_error = prefix + tail, None
            except TailRenderError as e:
                # Serve the turn from the re-rendered conversation, but never as captured.
                prompt_ids, tail_error = render_root_prompt(self._tokenizer, messages, tools), f"tail_render_failed: {e}"
        try:
            self.capture.begin_call(admission, prefix_token_ids=prefix, stream=False, weight_version=0)
        except CaptureError as e:
            raise HttpError(400, "invalid_capture_admission", str(e)) from e
        return _Plan(admission=admission, prefix=prefix, prompt_ids=prompt_ids, tail_error=tail_error)

    async def _resolve_prefix(self, admission: CaptureAdmission, body: dict) -> list[int]:
        if admission.staging_chain:
            if self.prefix_cache is None:
                raise HttpError(503, "staging_unavailable", "no staging source is configured to resolve staging_chain")
            try:
                return await asyncio.to_thread(
                    self.prefix_cache.resolve, list(admission.staging_chain), admission.prev_len, admission.parent_chain_hash
                )
            except PrefixMismatchError as e:
                raise HttpError(409, "prefix_mismatch", f"staging_chain of call {admission.model_call_id}: {e}") from e
            except PrefixError as e:
                raise HttpError(503, "staging_unavailable", f"staging_chain of call {admission.model_call_id}: {e}") from e
            except Exception as e:  # the source's own named errors (missing key, deadline) end here
                raise HttpError(503, "staging_unavailable", f"staging_chain of call {admission.model_call_id}: {type(e).__name__}: {e}") from e
        inline = list(admission.required_prefix_token_ids)
        top = body.get("required_prefix_token_ids")
        if top not in (None, []) and list(top) != inline:
            raise HttpError(400, "invalid_capture_admission", "top-level required_prefix_token_ids disagree with ng_capture")
        return inline

    async def _serve_admitted(self, plan: _Plan, sampling: SamplingRequest) -> dict:
        assert self.capture is not None and plan.admission is not None
        result = await self._generate(plan.prompt_ids, sampling)
        call = self.capture.begin_call(plan.admission, prefix_token_ids=plan.prefix, stream=False, weight_version=result.weight_version)
        native = self._response(result, include_logprobs=True, include_token_ids=True)
        if plan.tail_error is not None:
            coords = self.capture.fail_call(call, reason=plan.tail_error)
            reason = plan.tail_error
        else:
            coords = await asyncio.to_thread(self.capture.complete_call_from_response, call, native)
            reason = None if coords.disposition == "staged" else "staging_failed (see worker log)"
        self.stats[f"{plan.admission.mode}_calls"] += 1
        if reason is not None:
            self.stats["capture_failed"] += 1
            self.capture_failures.append(
                {"rollout_id": plan.admission.rollout_id, "model_call_id": plan.admission.model_call_id, "reason": reason}
            )
            LOGGER.error("capture_failed rollout=%s call=%s: %s", plan.admission.rollout_id, plan.admission.model_call_id, reason)
        native["ng_commit_coords"] = coords.model_dump(mode="json")
        return native

    async def _generate(self, prompt_ids: list[int], sampling: SamplingRequest) -> GenerationResultLike:
        try:
            return await self._engine.generate(prompt_ids, sampling, new_request_id())
        except InvalidChatRequest as e:
            raise HttpError(400, "invalid_request", str(e)) from e

    def _response(self, result: GenerationResultLike, *, include_logprobs: bool, include_token_ids: bool) -> dict:
        parsed = parse_tool_calls(generated_text(self._tokenizer, result.token_ids))
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
        )
