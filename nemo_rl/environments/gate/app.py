"""Our capture gate's server: Gym's `vllm_model` server with our ingress checks, normalisation and error mapping.

Run as `python -m nemo_rl.environments.gate.app` (set-up, and refusals to start: `gate.setup`); Gym's
code is never edited. Outermost, `GateGuardMiddleware` checks the rollout id, the control routes'
bearer (never logged or echoed), body size, JSON and the request rules (`data.calls`, with the
worker's `max_model_len`): a refusal is a named 4xx JSON error, so nothing is ledgered and nothing
reaches the worker. Inside it `NormalizeChatRequestMiddleware` drops the response-only and
echoed-null fields the `openai` client puts in assistant turns (sets derived from the SDK's types).
A worker error keeps its 4xx or 503 status and body, else is 502 `upstream_error`; FastAPI's 422 is
a named 400. `stream: true` is relayed by `gate.streaming` (chat), `gate.responses` and
`gate.messages`. Invariant: nothing Gym's lineage fingerprint or context digest reads is touched
(`content: null` is kept).
Docs: token-capture-reliability.md, "The gate guard"; token-capture-receipts.md, "Our gate policy".
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any
from urllib.parse import unquote

from aiohttp.client_exceptions import ClientResponseError
from fastapi import Body, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from openai.types.chat import ChatCompletionAssistantMessageParam, ChatCompletionMessage
from openai.types.chat.chat_completion_message_custom_tool_call import ChatCompletionMessageCustomToolCall
from openai.types.chat.chat_completion_message_custom_tool_call_param import ChatCompletionMessageCustomToolCallParam
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_message_function_tool_call_param import (
    ChatCompletionMessageFunctionToolCallParam,
)
from pydantic import BaseModel, PrivateAttr, ValidationError

from nemo_gym.chat_streaming import sanitize_streaming_chat_body
from nemo_gym.global_config import get_global_config_dict
from nemo_gym.openai_utils import NeMoGymChatCompletionCreateParamsNonStreaming
from nemo_rl.data import calls
from nemo_rl.data.errors import ApiError, error_name
from nemo_rl.data.calls import (
    RequestFieldError,
    RolloutIdError,
    bearer_status,
    check_chat_request,
    check_sampling_fields,
    parse_json_body,
    show,
)
from nemo_rl.environments.gate.required_prefix import FIELD as REQUIRED_PREFIX
from nemo_rl.environments.gate.required_prefix import (
    check_required_prefix,
    drop_empty_required_prefix,
    drop_empty_required_prefix_bytes,
)
from nemo_rl.environments.gate.messages import streamed_messages
from nemo_rl.environments.gate.responses import CONVERTER_ERRORS, responses_chat_request, streamed_responses
from nemo_rl.environments.gate.responses_fields import normalize_responses_post, normalize_responses_request
from nemo_rl.environments.gate.setup import (
    CaptureGateConfigError,
    GateGuardConfig,
    WorkerContextLimit,
    control_token_from,
    guard_config_from,
    plain_config,
    run_gate,
)
from nemo_rl.environments.gate.streaming import WorkerStream, streamed_chat
from responses_api_models.vllm_model.app import _PROPAGATE_CONTEXT_ERROR_ATTRIBUTE, VLLMModel

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ROLLOUT_PREFIX = b"/ng-rollout/"
CONTROL_PREFIX = "/training-token-capture/control/"
MANIFEST_PREFIX = CONTROL_PREFIX + "rollouts/"
CAPTURE_SEGMENT = "training-token-capture"
GENERATING_ROUTES = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}
CHAT_PATH_SUFFIX = "/chat/completions"
RESPONSES_PATH_SUFFIX = "/responses"
PREFIX_ROUTES = ("chat", "responses")  # routes that accept a null `required_prefix_token_ids` (required_prefix)
# The token-count fields of each route's own dialect (checked on the body as the client sent it).
TOKEN_FIELDS = {"chat": ("max_tokens", "max_completion_tokens"), "responses": ("max_output_tokens",), "messages": ("max_tokens",)}


# --- pure rules: paths, rollout ids, error answers --------------------------------------------------


def check_rollout_id(rollout_id: str, max_chars: int) -> None:
    """Raise `ApiError` 400 `invalid_rollout_id` unless the id is usable (`nemo_rl.data.calls`)."""
    try:
        calls.check_rollout_id(rollout_id, max_chars)
    except RolloutIdError as e:
        raise ApiError("invalid_rollout_id", str(e), "rollout_id") from e


def split_rollout_path(raw_path: bytes) -> tuple[str | None, str]:
    """(rollout id or None, the route after the prefix), split on the RAW path so an encoded `%2F` stays
    inside the id (and is then refused); the id is returned decoded, as Gym keys its ledger."""
    if not raw_path.startswith(ROLLOUT_PREFIX):
        return None, unquote(raw_path.decode("latin-1"))
    rest = raw_path[len(ROLLOUT_PREFIX) :]
    rollout_id, slash, route = rest.partition(b"/")
    route_text = "/" + unquote(route.decode("latin-1")) if slash else "/"
    if route_text.startswith("/" + CAPTURE_SEGMENT + "/"):
        route_text = route_text[len(CAPTURE_SEGMENT) + 1 :]
    return unquote(rollout_id.decode("latin-1"), errors="replace"), route_text


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _is_union_tag(part: str) -> bool:
    # pydantic names the union member it tried (`NeMoGym...Param`, `str`, `function-after[...]`) in `loc`;
    # those are not fields of the request.
    return part[:1].isupper() or part in _TYPE_TAGS or ("[" in part and part.endswith("]"))


def loc_field(loc: Sequence[Any]) -> str:
    """A pydantic error location as the request's JSON path (`messages[0].content`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
            out += f".{part}" if out else str(part)
    return out or "body"


def validation_error(e: ValidationError, what: str) -> ApiError:
    first = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
    field = loc_field(first.get("loc", ()))
    return ApiError("invalid_request", f"{what}: {field}: {first.get('msg')}", field)


def request_validation_answer(errors: list[dict]) -> ApiError:
    """FastAPI's 422 for a body Gym's request model refuses, as the gate's named 400 (pure)."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "the request body is invalid"}
    loc = tuple(first.get("loc") or ())
    field = loc_field(loc[1:] if loc[:1] == ("body",) else loc)
    return ApiError("invalid_request", f"the request does not match Gym's request model: {field}: {first.get('msg')}",
                    field)


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


# --- ASGI plumbing: read a body within a limit, replay it, answer an error --------------------------


async def read_body(scope: Scope, receive: Receive, limit: int | None = None,
                    too_large: ApiError | None = None) -> list[Message]:
    """The request's messages up to its last (or a disconnect, kept for the app to handle); raises
    `too_large` once the body exceeds `limit` bytes (by `Content-Length`, or as it streams in)."""
    for key, value in scope.get("headers") or []:
        if limit is not None and key.lower() == b"content-length" and value.strip().isdigit() and int(value) > limit:
            raise too_large
    received: list[Message] = []
    size = 0
    while True:
        message = await receive()
        received.append(message)
        if message.get("type") != "http.request":
            break
        size += len(message.get("body", b"") or b"")
        if limit is not None and size > limit:
            raise too_large
        if not message.get("more_body", False):
            break
    return received


def body_of(received: list[Message]) -> bytes:
    return b"".join(m.get("body", b"") or b"" for m in received if m.get("type") == "http.request")


def replaying(received: list[Message], receive: Receive) -> Receive:
    """A `receive` that hands out `received` first, then the client's own messages."""

    async def replay() -> Message:
        if received:
            return received.pop(0)
        return await receive()

    return replay


async def answer_error(send: Send, error: ApiError) -> None:
    body = error.encoded()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii"))]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# --- request normalisation: assistant turns echoed by the official `openai` client -------------------


def _request_keys(typed_dict: type) -> frozenset[str]:
    return frozenset(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def response_only_fields(response_model: type[BaseModel], request_typed_dict: type) -> frozenset[str]:
    """Fields the SDK parses from a response but does not declare for a request."""
    return frozenset(response_model.model_fields) - _request_keys(request_typed_dict)


def echoed_null_fields(response_model: type[BaseModel], request_typed_dict: type) -> frozenset[str]:
    """Shared fields that the response model defaults to null, so `model_dump()` echoes them as null."""
    shared = frozenset(response_model.model_fields) & _request_keys(request_typed_dict)
    return frozenset(name for name in shared if response_model.model_fields[name].default is None)


RESPONSE_ONLY_MESSAGE_FIELDS = response_only_fields(ChatCompletionMessage, ChatCompletionAssistantMessageParam)
# `content: null` is the canonical tool-call-only turn (Gym's own echo keeps it), so it is never dropped.
ECHOED_NULL_MESSAGE_FIELDS = echoed_null_fields(ChatCompletionMessage, ChatCompletionAssistantMessageParam) - {"content"}
RESPONSE_ONLY_TOOL_CALL_FIELDS: dict[str, frozenset[str]] = {
    "function": response_only_fields(ChatCompletionMessageFunctionToolCall, ChatCompletionMessageFunctionToolCallParam),
    "custom": response_only_fields(ChatCompletionMessageCustomToolCall, ChatCompletionMessageCustomToolCallParam),
}


def _is_empty(value: Any) -> bool:
    return value is None or value == []


def _normalize_tool_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    drop = {k for k in RESPONSE_ONLY_TOOL_CALL_FIELDS.get(call.get("type"), ()) if k in call and _is_empty(call[k])}
    return {k: v for k, v in call.items() if k not in drop} if drop else call


def _normalize_assistant(message: dict) -> dict:
    drop = {k for k in RESPONSE_ONLY_MESSAGE_FIELDS if k in message and _is_empty(message[k])}
    drop |= {k for k in ECHOED_NULL_MESSAGE_FIELDS if k in message and message[k] is None}
    out = {k: v for k, v in message.items() if k not in drop} if drop else message
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        new_calls = [_normalize_tool_call(call) for call in calls]
        if any(new is not old for new, old in zip(new_calls, calls)):
            out = {**out, "tool_calls": new_calls}
    return out


def normalize_chat_request(body: Any) -> Any:
    """`body` without the response-only fields the openai client echoes; `body` itself when nothing changes."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return body
    messages = body["messages"]
    normalized = [
        _normalize_assistant(m) if isinstance(m, dict) and m.get("role") == "assistant" else m for m in messages
    ]
    if all(new is old for new, old in zip(normalized, messages)):
        return body
    return {**body, "messages": normalized}


def normalize_chat_body(raw: bytes) -> bytes:
    """The raw bytes after `normalize_chat_request`; `raw` itself when nothing changed or it is not JSON."""
    return calls.rewrite_json_body(raw, normalize_chat_request)


def normalize_chat_post(raw: bytes) -> bytes:
    """A chat body after `normalize_chat_body`, without a null or [] `required_prefix_token_ids`."""
    normalized = normalize_chat_body(raw)
    return drop_empty_required_prefix_bytes(normalized) if REQUIRED_PREFIX.encode() in normalized else normalized


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


def _with_content_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode("ascii")))
    return {**scope, "headers": headers}


class NormalizeChatRequestMiddleware:
    """Pure ASGI: `body_normalizer(scope)` on chat and Responses POST bodies; a refused Responses field
    is answered 400 naming it (the guard outside refuses it first)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        normalize = body_normalizer(scope)
        if normalize is None:
            await self.app(scope, receive, send)
            return
        received = await read_body(scope, receive)
        # A disconnect before the full body is replayed as it came; the app handles it.
        if received[-1].get("type") == "http.request":
            raw = body_of(received)
            try:
                normalized = normalize(raw)
            except RequestFieldError as e:
                await answer_error(send, ApiError("invalid_request", e.message, e.field))
                return
            if normalized is not raw:
                received = [{"type": "http.request", "body": normalized, "more_body": False}]
                scope = _with_content_length(scope, len(normalized))
        await self.app(scope, replaying(received, receive), send)


# --- the guard ----------------------------------------------------------------------------------


# (route kind, request body) -> the chat request the worker will get.
ToChat = Callable[[str, dict], dict]


class GateGuardMiddleware:
    """Pure ASGI middleware: the checks of the module contract; a request it lets through is replayed byte for byte."""

    def __init__(self, app: ASGIApp, *, config: GateGuardConfig, control_token: str, to_chat: ToChat,
                 context_limit: Callable[[], Awaitable[int]]) -> None:
        if not control_token:
            raise ValueError("GateGuardMiddleware needs the run's control bearer token")
        self.app = app
        self._cfg = config
        self._token = control_token
        self._to_chat = to_chat
        self._context_limit = context_limit
        self._max_model_len: int | None = None  # probed once by `context_limit`, then held here

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        try:
            replay = await self._check(scope, receive)
        except ApiError as e:
            await answer_error(send, e)
            return
        await self.app(scope, replay or receive, send)

    async def _check(self, scope: Scope, receive: Receive) -> Receive | None:
        raw_path = scope.get("raw_path") or str(scope.get("path") or "").encode("utf-8")
        rollout_id, route = split_rollout_path(raw_path)
        if route.startswith(CONTROL_PREFIX):  # with or without a rollout prefix (Gym strips it first)
            self._check_control(scope, route)
        elif rollout_id is None and route.startswith("/" + CAPTURE_SEGMENT + "/"):
            # Gym would answer a bare 404: say what the capture route needs (a client that collapses
            # `/ng-rollout/../` dot segments sends exactly this).
            raise ApiError("invalid_rollout_id", f"{route} is the capture route without its rollout prefix; send it "
                           f"as /ng-rollout/<rollout id>/{CAPTURE_SEGMENT}/...", "path")
        if rollout_id is not None:
            check_rollout_id(rollout_id, self._cfg.max_rollout_id_chars)
        kind = GENERATING_ROUTES.get(route)
        if kind is None or str(scope.get("method") or "").upper() != "POST":
            return None
        limit = self._cfg.max_body_bytes
        received = await read_body(scope, receive, limit, ApiError(
            "request_too_large",
            f"request body exceeds the gate's limit of {limit} bytes (nrl_gate_guard.max_body_bytes); "
            "nothing was forwarded",
            "body",
        ))
        await self._check_body(kind, body_of(received))
        return replaying(received, receive)

    def _check_control(self, scope: Scope, route: str) -> None:
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        authorization = headers.get(b"authorization")
        status = bearer_status(authorization.decode("latin-1") if authorization else None, self._token)
        if status == 401:
            raise ApiError("control_auth_required", "control routes need an Authorization: Bearer <control token> "
                           "header", "Authorization")
        if status == 403:
            raise ApiError("control_auth_invalid", "the control bearer token is not this run's", "Authorization")
        if route.startswith(MANIFEST_PREFIX):
            rollout_id = route[len(MANIFEST_PREFIX) :].split("/", 1)[0]
            check_rollout_id(rollout_id, self._cfg.max_rollout_id_chars)

    async def _check_body(self, kind: str, raw: bytes) -> None:
        try:
            body = parse_json_body(raw)
        except RequestFieldError as e:
            raise ApiError("invalid_json", e.message, e.field) from e
        if not isinstance(body, dict):
            raise ApiError("invalid_request", f"request body must be a JSON object, got {show(body)}", "body")
        if self._max_model_len is None:
            self._max_model_len = await self._context_limit()
        max_model_len = self._max_model_len
        try:
            # The client's own dialect first (precise field names), then Gym's model and conversion.
            if kind in PREFIX_ROUTES and REQUIRED_PREFIX in body:  # Gym's compaction agent's field
                check_required_prefix(body)
                body = drop_empty_required_prefix(body)  # the normaliser drops it before Gym's model too
            if kind == "chat":
                check_chat_request(body, max_model_len=max_model_len)
            else:
                check_sampling_fields(body, TOKEN_FIELDS[kind], max_model_len)
                body = normalize_responses_request(body) if kind == "responses" else body
        except RequestFieldError as e:
            raise ApiError("invalid_request", e.message, e.field) from e
        try:
            chat = self._to_chat(kind, body)
        except ValidationError as e:
            raise validation_error(e, f"the {kind} request does not match Gym's request model") from e
        except CONVERTER_ERRORS as e:  # how Gym's converters refuse input
            raise ApiError("invalid_request", f"the {kind} request cannot be converted to a chat request: "
                           f"{error_name(e)}: {e}", "body") from e
        try:
            check_chat_request(chat, max_model_len=max_model_len)
        except RequestFieldError as e:
            raise ApiError("invalid_request", e.message, e.field) from e


class BodyLimitMiddleware:
    """Pure ASGI: any HTTP request whose body exceeds `max_body_bytes` (by `Content-Length`, or as it
    streams in) is answered 413 `request_too_large` without reaching the app; smaller bodies are
    replayed unchanged. For servers without the gate's route rules (our resources server)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, knob: str) -> None:
        self.app = app
        self._limit = max_body_bytes
        self._knob = knob

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        error = ApiError("request_too_large", f"request body exceeds {self._limit} bytes ({self._knob})", "body")
        try:
            received = await read_body(scope, receive, self._limit, error)
        except ApiError as e:
            await answer_error(send, e)
            return
        await self.app(scope, replaying(received, receive), send)


# --- the server ---------------------------------------------------------------------------------


class CaptureGateModel(VLLMModel):
    """Gym's `VLLMModel` with our guard and normaliser outside Gym's capture middleware, worker errors
    mapped, and `stream: true` relayed as the worker generates (`gate.streaming`, `gate.responses`,
    `gate.messages`)."""

    _stream: WorkerStream | None = PrivateAttr(default=None)

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
        global_config = plain_config(self.server_client.global_config_dict)
        guard = guard_config_from(global_config)
        self._stream = WorkerStream(guard.stream_read_timeout_s, upstream_error_answer)
        app.add_middleware(
            GateGuardMiddleware,
            config=guard,
            control_token=control_token_from(global_config, os.environ),
            to_chat=self.chat_request_for,
            context_limit=WorkerContextLimit(list(self.config.base_url), guard.context_probe_timeout_s),
        )
        return app

    def chat_request_for(self, kind: str, body: dict) -> dict:
        """The chat request the worker would get for this route's body (the guard checks it); raises
        pydantic's ValidationError when Gym's request model refuses it. Other routes: `gate.responses`."""
        if kind != "chat":
            return responses_chat_request(self, kind, body)
        if body.get("stream") is True:  # Gym's own mapping of the streaming dialect onto its model
            body, _ = sanitize_streaming_chat_body(body)
        normalized = normalize_chat_request(body)
        NeMoGymChatCompletionCreateParamsNonStreaming.model_validate(normalized)
        return normalized

    async def chat_completions_dispatch(self, request: Request, body: dict = Body()):
        """Gym's dispatch, except `stream: true`: the worker streams and the gate relays (`gate.streaming`)."""
        if body.get("stream") is not True:
            return await super().chat_completions_dispatch(request, body)
        assert self._stream is not None  # set by setup_webserver
        return await streamed_chat(self, request, body, self._stream)

    async def responses_dispatch(self, request: Request, body: dict = Body()):
        """Gym's dispatch, except `stream: true`: Responses events from the worker's stream (`gate.responses`)."""
        if body.get("stream") is not True:
            return await super().responses_dispatch(request, body)
        assert self._stream is not None  # set by setup_webserver
        return await streamed_responses(self, request, body, self._stream)

    async def messages(self, request: Request, body: dict = Body()):
        """Gym's Messages route, except `stream: true`: Anthropic events from the worker's stream (`gate.messages`)."""
        if body.get("stream") is not True:
            return await super().messages(request, body)
        assert self._stream is not None  # set by setup_webserver
        return await streamed_messages(self, request, body, self._stream)

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


if __name__ == "__main__":
    run_gate(get_global_config_dict(), CaptureGateModel.run_webserver)
