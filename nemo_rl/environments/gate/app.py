"""Our capture gate: Gym's `vllm_model` server with our ledger policy and request normalisation.

Launched as `python -m nemo_rl.environments.gate.app` with Gym's config variables and a
`token_id_capture` block (`enabled`, `external_staging`, `dir`); it refuses to start with capture
off, with a configured `lineage_store` (it would win over ours) or with `num_workers > 1`.
Owns what changes at the gate: `BranchingCaptureLedger` (identical siblings resolve to one,
a rewritten history opens a `text` branch instead of poisoning), request normalisation (with a
null `required_prefix_token_ids` dropped: gate/required_prefix.py), the
input guard, worker-error mapping (4xx and 503 keep the worker's status and body, anything else
is 502 `upstream_error`; FastAPI's 422 for a body Gym's model refuses is a named 400) and the
streamed paths (`stream: true` relayed as the worker generates: chat in gate/streaming.py, the
Responses API in gate/responses_stream.py). Gym's installed code is never edited.
Invariant: every relaxation keeps the staged ids exactly what the engine saw; a request the
guard and normaliser let through reaches Gym with its lineage unchanged.
Why each relaxation is safe: docs/design-docs/token-capture-receipts.md, "Our gate policy".
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

import aiohttp
from aiohttp.client_exceptions import ClientResponseError
from fastapi import Body, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from omegaconf import DictConfig, OmegaConf
from pydantic import PrivateAttr, ValidationError

from nemo_gym.anthropic_utils import NeMoGymAnthropicMessageCreateParamsNonStreaming
from nemo_gym.base_responses_api_model import _ANTHROPIC_CONVERTER, _request_messages, _validate_chat_params
from nemo_gym.chat_streaming import sanitize_streaming_chat_body
from nemo_gym.global_config import get_global_config_dict
from nemo_gym.responses_streaming import (
    NamespaceMap,
    restore_namespace_tool_calls,
    sanitize_streaming_responses_body,
    validate_streaming_responses_params,
)
from nemo_gym.openai_utils import (
    NeMoGymChatCompletion,
    NeMoGymChatCompletionCreateParamsNonStreaming,
    NeMoGymResponseCreateParamsNonStreaming,
)
from nemo_gym.token_id_capture.config import token_id_capture_config
from nemo_gym.token_id_capture.protocols import install_lineage_store
from nemo_gym.token_id_capture.sink import current_capture_context, register_call_intent, resolve_parent
from nemo_rl.data.errors import ApiError, FatalError
from nemo_rl.data.calls import RequestFieldError
from nemo_rl.environments.gate.ingress import (
    GATE_GUARD_KEY,
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    GateGuardConfig,
    GateGuardMiddleware,
    WorkerContextLimit,
    answer_error,
    loc_field,
    normalize_chat_body,
    normalize_chat_request,
)
from nemo_rl.environments.gate.ledger import BranchingCaptureLedger
from nemo_rl.environments.gate.required_prefix import drop_empty_required_prefix_bytes
from nemo_rl.environments.gate.responses_fields import normalize_responses_body
from nemo_rl.environments.gate.responses_stream import ResponsesEvents, relay_responses_stream, responses_sse
from nemo_rl.environments.gate.streaming import StreamRelayError, error_event, relay_stream
from responses_api_models.vllm_model.app import _PROPAGATE_CONTEXT_ERROR_ATTRIBUTE, VLLMModel

CHAT_PATH_SUFFIX = "/chat/completions"
RESPONSES_PATH_SUFFIX = "/responses"


class CaptureGateConfigError(FatalError, ValueError):
    """The global config cannot run our capture gate."""


def ledger_dir_from_config(global_config: Any) -> Path:
    """The capture ledger directory of an external-staging `token_id_capture` block (pure)."""
    settings = token_id_capture_config(global_config)
    block = settings.token_id_capture
    if not (block.enabled and block.external_staging):
        raise CaptureGateConfigError(
            "capture_gate needs token_id_capture.enabled and external_staging; "
            "run responses_api_models.vllm_model.app when capture is off"
        )
    if block.lineage_store is not None:
        raise CaptureGateConfigError(
            f"token_id_capture.lineage_store={block.lineage_store!r} would replace the gate's BranchingCaptureLedger"
        )
    ledger_dir = settings.resolved_dir()
    if ledger_dir is None:
        raise CaptureGateConfigError("token_id_capture.dir is required: it is the capture ledger directory")
    return ledger_dir


def guard_config_from(global_config: Any) -> GateGuardConfig:
    """The gate's `GateGuardConfig` from the global config's `nrl_gate_guard` block (pure)."""
    block = global_config.get(GATE_GUARD_KEY) if isinstance(global_config, Mapping) else None
    if block is None:
        raise CaptureGateConfigError(
            f"the global config has no {GATE_GUARD_KEY!r} block (nemo_gym_launch.build_global_config writes it)"
        )
    try:
        return GateGuardConfig.model_validate(block)
    except ValidationError as e:
        raise CaptureGateConfigError(f"{GATE_GUARD_KEY} is invalid: {e}") from e


def control_token_from(global_config: Any, environ: Mapping[str, str]) -> str:
    """The control bearer, read from the variable the capture block names (never from the config)."""
    name = token_id_capture_config(global_config).token_id_capture.control_auth_token_env
    token = environ.get(name)
    if not token:
        raise CaptureGateConfigError(f"the control bearer variable ${name} is empty or unset in the gate's environment")
    return token


def upstream_error_answer(status: int, content: bytes) -> tuple[int, Any]:
    """(status, JSON body) the gate answers for a worker error (see the module contract; pure)."""
    text = content.decode("utf-8", errors="replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        body = None
    passes = 400 <= status < 500 or status == 503
    if passes and isinstance(body, dict) and isinstance(body.get("error"), dict):
        return status, body
    quoted = text if len(text) <= 2000 else text[:2000] + "...<cut>"
    err_type = "upstream_error" if not passes else "upstream_rejected"
    out_status = status if passes else 502
    message = f"the vLLM worker answered HTTP {status}: {quoted}"
    return out_status, {"error": {"message": message, "type": err_type, "param": None, "code": out_status}}


def request_validation_answer(errors: list[dict]) -> ApiError:
    """FastAPI's 422 for a body Gym's request model refuses, as the gate's named 400 (pure)."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "the request body is invalid"}
    loc = tuple(first.get("loc") or ())
    field = loc_field(loc[1:] if loc[:1] == ("body",) else loc)
    return ApiError("invalid_request", f"the request does not match Gym's request model: {field}: {first.get('msg')}",
                    field)


def _with_content_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode("ascii")))
    return {**scope, "headers": headers}


def normalize_chat_post(raw: bytes) -> bytes:
    """A chat body after `normalize_chat_body`, without a null or [] `required_prefix_token_ids`."""
    return drop_empty_required_prefix_bytes(normalize_chat_body(raw))


def normalize_responses_post(raw: bytes) -> bytes:
    """A Responses body after `normalize_responses_body`, without a null or [] `required_prefix_token_ids`."""
    return drop_empty_required_prefix_bytes(normalize_responses_body(raw))


def body_normalizer(scope: Scope) -> Callable[[bytes], bytes] | None:
    """The body rewrite of a POST to a chat or Responses route (None for any other request; pure)."""
    if scope.get("type") != "http" or str(scope.get("method") or "").upper() != "POST":
        return None
    path = str(scope.get("path") or "")
    if path.endswith(CHAT_PATH_SUFFIX):
        return normalize_chat_post
    if path.endswith(RESPONSES_PATH_SUFFIX):
        return normalize_responses_post
    return None


class NormalizeChatRequestMiddleware:
    """Pure ASGI middleware: `body_normalizer(scope)` on chat and Responses POST bodies.

    A refused Responses field (`RequestFieldError`) is answered 400 naming it; the guard outside
    refuses it first, so this only holds when the normaliser runs without the guard.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        normalize = body_normalizer(scope)
        if normalize is None:
            await self.app(scope, receive, send)
            return
        received: list[Message] = []
        while True:
            message = await receive()
            received.append(message)
            if message.get("type") != "http.request" or not message.get("more_body", False):
                break
        # A disconnect before the full body is replayed as it came; the app handles it.
        if received[-1].get("type") == "http.request":
            raw = b"".join(m.get("body", b"") or b"" for m in received)
            try:
                normalized = normalize(raw)
            except RequestFieldError as e:
                await answer_error(send, ApiError("invalid_request", e.message, e.field))
                return
            if normalized is not raw:
                received = [{"type": "http.request", "body": normalized, "more_body": False}]
                scope = _with_content_length(scope, len(normalized))

        async def replay() -> Message:
            if received:
                return received.pop(0)
            return await receive()

        await self.app(scope, replay, send)


Relay = Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]  # the worker's SSE bytes -> the client's events


def _skeleton_completion(first: dict) -> dict:
    """The empty completion Gym's converter turns into the in-progress response of a stream."""
    return {"id": first["id"], "created": first["created"], "model": first["model"], "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]}


def streamed_responses_params(body: dict) -> tuple[NeMoGymResponseCreateParamsNonStreaming, NamespaceMap]:
    """A `stream: true` Responses body as Gym's streaming dialect maps it, and the namespace tools it
    flattened (raises ValidationError)."""
    cleaned, namespaces = sanitize_streaming_responses_body(body)
    return validate_streaming_responses_params(cleaned), namespaces


class CaptureGateModel(VLLMModel):
    """Gym's `VLLMModel` with the normalisation middleware outside Gym's capture middleware, and a
    streamed chat path that relays the worker's chunks as they come (`gate.streaming`)."""

    _stream_read_timeout_s: float | None = PrivateAttr(default=None)

    def get_session_middleware_key(self) -> str:
        # Same session cookie and log prefix as Gym's own gate.
        return f"{VLLMModel.__name__}___{self.config.name}"

    def setup_webserver(self):
        if self.config.num_workers and self.config.num_workers > 1:
            raise CaptureGateConfigError(
                f"capture_gate needs num_workers <= 1 (got {self.config.num_workers}): uvicorn workers "
                "import Gym's vllm_model app by entrypoint and would run without BranchingCaptureLedger"
            )
        app = super().setup_webserver()
        # Added last, so Starlette puts it outside Gym's capture middleware, which resolves lineage
        # from the request body, and outside FastAPI's request validation, which answers 422.
        app.add_middleware(NormalizeChatRequestMiddleware)
        # Outside the normaliser: oversized bodies are refused before anything buffers them.
        global_config = _plain(self.server_client.global_config_dict)
        guard = guard_config_from(global_config)
        self._stream_read_timeout_s = guard.stream_read_timeout_s
        app.add_middleware(
            GateGuardMiddleware,
            config=guard,
            control_token=control_token_from(global_config, os.environ),
            to_chat=self.chat_request_for,
            context_limit=WorkerContextLimit(list(self.config.base_url), guard.context_probe_timeout_s),
        )
        return app

    def chat_request_for(self, kind: str, body: dict) -> dict | None:
        """The chat request the worker would get for this route's body (the guard checks it).

        Raises pydantic's ValidationError (Gym's request model refuses the body) or the error
        Gym's converter raises; a streamed Responses body is first mapped from the streaming dialect
        by Gym's own functions (as the streamed path serves it); None for a streamed Messages request.
        """
        if kind == "chat":
            if body.get("stream") is True:  # Gym's own mapping of the streaming dialect onto its model
                body, _ = sanitize_streaming_chat_body(body)
            normalized = normalize_chat_request(body)
            NeMoGymChatCompletionCreateParamsNonStreaming.model_validate(normalized)
            return normalized
        if kind == "responses" and body.get("stream") is True:
            params, _ = streamed_responses_params(body)
        elif body.get("stream") is True:
            return None
        elif kind == "responses":
            params = NeMoGymResponseCreateParamsNonStreaming.model_validate(body)
        else:
            NeMoGymAnthropicMessageCreateParamsNonStreaming.model_validate(body)
            params = _ANTHROPIC_CONVERTER.anthropic_request_to_responses(body)
        chat = self._converter.responses_to_chat_completion_create_params(params)
        return chat.model_dump(exclude_unset=True, mode="json")

    async def chat_completions_dispatch(self, request: Request, body: dict = Body()):
        """Gym's dispatch, except `stream: true`: the worker streams and the gate relays (no buffering)."""
        if body.get("stream") is not True:
            return await super().chat_completions_dispatch(request, body)
        cleaned, include_usage = sanitize_streaming_chat_body(body)
        params = _validate_chat_params(cleaned)  # Gym's own 422 for a body its model refuses
        if current_capture_context() is not None:  # Gym's steps before dispatch, in Gym's order
            await resolve_parent(_request_messages(params))
            await register_call_intent()
        upstream_body = self._preprocess_chat_completion_create_params(request, params.model_dump(exclude_unset=True))
        upstream_body["stream"] = True
        if include_usage:
            upstream_body["stream_options"] = {"include_usage": True}

        def relay(upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            return relay_stream(upstream, self._commit_streamed)

        return await self._relay(self._resolve_client(request), upstream_body, relay, error_event)

    async def responses_dispatch(self, request: Request, body: dict = Body()):
        """Gym's dispatch, except `stream: true`: Responses events built from the worker's chat stream
        as it comes (`gate.responses_stream`), the call committed as Gym commits a whole one."""
        if body.get("stream") is not True:
            return await super().responses_dispatch(request, body)
        try:
            params, namespaces = streamed_responses_params(body)  # Gym's own mapping of the streaming dialect
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e
        if current_capture_context() is not None:  # Gym's steps before dispatch, in Gym's order
            await resolve_parent(_request_messages(params))
            await register_call_intent()
        chat_params = self._converter.responses_to_chat_completion_create_params(params)
        params.model = self.config.model  # as Gym's responses() does
        upstream_body = self._preprocess_chat_completion_create_params(request, chat_params.model_dump(exclude_unset=True))
        upstream_body["stream"] = True
        upstream_body["stream_options"] = {"include_usage": True}  # the final response carries usage
        events = ResponsesEvents(lambda first: self._response_of(params, _skeleton_completion(first), {}),
                                 message_id=f"msg_{uuid4().hex}", namespaces=namespaces)

        def to_response(completion: dict) -> dict:
            if self._external_capture_handler is not None:
                self._external_capture_handler.prepare_response(completion)  # takes ng_commit_coords off
            return self._response_of(params, completion, namespaces)

        def relay(upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            return relay_responses_stream(upstream, events, to_response, self._finalize_served_response)

        def failed(message: str) -> bytes:
            return responses_sse(events.failed(message))

        return await self._relay(self._resolve_client(request), upstream_body, relay, failed)

    def _response_of(self, params: NeMoGymResponseCreateParamsNonStreaming, completion: dict,
                     namespaces: NamespaceMap) -> dict:
        """Gym's conversion of a chat completion to the Responses object (as its streamed path serves it:
        namespace tools' calls under their client-visible names)."""
        response = self._converter.chat_completion_to_response(
            responses_create_params=params, chat_completion=NeMoGymChatCompletion.model_validate(completion),
            preserve_envelope_id=self._preserve_envelope_id())
        out = response.model_dump(mode="json", by_alias=True)
        return {**out, "output": restore_namespace_tool_calls(out.get("output") or [], namespaces)}

    async def _relay(self, client: Any, upstream_body: dict, relay: Relay, broke_off: Callable[[str], bytes]) -> Any:
        """POST the streamed request to the worker; `relay(worker bytes)` is the client's events."""
        assert self._stream_read_timeout_s is not None  # set by setup_webserver
        deadline = self._stream_read_timeout_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=deadline, sock_read=deadline)
        session = aiohttp.ClientSession(timeout=timeout)
        headers = {**client.default_headers, "Authorization": f"Bearer {client.api_key}"}
        try:
            upstream = await session.post(f"{client.base_url}/chat/completions", json=upstream_body, headers=headers)
            if upstream.status != 200:
                status, payload = upstream_error_answer(upstream.status, await upstream.read())
                await session.close()
                return JSONResponse(content=payload, status_code=status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            await session.close()
            message = f"the vLLM worker at {client.base_url} did not start the stream: {type(e).__name__}: {e}"
            return JSONResponse(content={"error": {"message": message, "type": "upstream_unavailable", "param": None,
                                                   "code": 502}}, status_code=502)

        async def events():
            try:
                async for event in relay(upstream.content.iter_any()):
                    yield event
            except (StreamRelayError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                yield broke_off(f"the vLLM worker's stream broke off: {type(e).__name__}: {e}; not committed")
            finally:
                upstream.release()
                await session.close()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _commit_streamed(self, completion: dict) -> None:
        """Gym's commit of a finished call, from the completion the stream added up to."""
        if self._external_capture_handler is not None:
            self._external_capture_handler.prepare_response(completion)  # takes ng_commit_coords off
        await self._finalize_served_response(NeMoGymChatCompletion.model_validate(completion))

    def setup_exception_middleware(self, app) -> None:
        async def refused_by_gyms_model(request: Request, error: RequestValidationError) -> JSONResponse:
            answer = request_validation_answer(list(error.errors()))
            return JSONResponse(content=answer.body(), status_code=answer.status)

        # Gym validates some bodies in its handlers (FastAPI's {"detail": ...} 422): answer them as the gate does.
        app.add_exception_handler(RequestValidationError, refused_by_gyms_model)

        @app.middleware("http")
        async def upstream_error_middleware(request: Request, call_next):
            # Registered before Gym's handlers, so it is inside them and sees the worker's error first.
            try:
                return await call_next(request)
            except ClientResponseError as error:
                if getattr(error, _PROPAGATE_CONTEXT_ERROR_ATTRIBUTE, False) or not hasattr(error, "response_content"):
                    raise  # Gym's own handling (context-overflow passthrough, its assertion)
                status, body = upstream_error_answer(error.status, error.response_content)
                return JSONResponse(content=body, status_code=status)

        super().setup_exception_middleware(app)


def _plain(config: Any) -> Any:
    return OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config


def main() -> None:
    ledger_dir = ledger_dir_from_config(_plain(get_global_config_dict()))
    install_lineage_store(BranchingCaptureLedger(ledger_dir))
    CaptureGateModel.run_webserver()


if __name__ == "__main__":
    main()
