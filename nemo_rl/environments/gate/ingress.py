"""The gate's ingress: what checks and rewrites a request before Gym's handler sees it.

`GateGuardMiddleware` (pure ASGI, outside Gym's middlewares, Gym's code untouched) checks rollout
ids, the control routes' bearer (never logged or echoed), body size, JSON and the chat request
rules (`data.calls`, with the worker's `max_model_len`, read once), the Responses field rules
(`responses_fields`) and `required_prefix_token_ids` (`required_prefix`); a refusal is a named 4xx
JSON error (type and field), so nothing is ledgered and nothing reaches the worker; a request it
lets through is replayed byte for byte. `BodyLimitMiddleware` is the body limit alone.
`normalize_chat_request` (pure) drops the response-only and echoed-null fields the `openai`
client puts in assistant turns (sets derived from the installed SDK's types at import); it
returns `body` itself when nothing changes. Invariant: nothing Gym's lineage fingerprint or
context digest reads is touched (`content: null` is kept). Docs: token-capture-reliability.md,
"The gate guard"; token-capture-receipts.md, "Request normalisation".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any
from urllib.parse import unquote

import aiohttp
from openai.types.chat import ChatCompletionAssistantMessageParam, ChatCompletionMessage
from openai.types.chat.chat_completion_message_custom_tool_call import ChatCompletionMessageCustomToolCall
from openai.types.chat.chat_completion_message_custom_tool_call_param import (
    ChatCompletionMessageCustomToolCallParam,
)
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_message_function_tool_call_param import (
    ChatCompletionMessageFunctionToolCallParam,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_rl.data import calls
from nemo_rl.data.errors import ApiError
from nemo_rl.environments.gate.required_prefix import check_required_prefix, drop_empty_required_prefix
from nemo_rl.data.calls import (
    DEFAULT_MAX_ROLLOUT_ID_CHARS,
    MAX_ROLLOUT_ID_CHARS,
    RequestFieldError,
    RolloutIdError,
    bearer_status,
    check_chat_request,
    check_sampling_fields,
    parse_json_body,
    show,
)
from nemo_rl.environments.gate.responses_fields import normalize_responses_request

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GATE_GUARD_KEY = "nrl_gate_guard"  # top-level key of Gym's global config that carries GateGuardConfig
ROLLOUT_PREFIX = b"/ng-rollout/"
CONTROL_PREFIX = "/training-token-capture/control/"
MANIFEST_PREFIX = CONTROL_PREFIX + "rollouts/"
CAPTURE_SEGMENT = "training-token-capture"
GENERATING_ROUTES = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}
# The token-count fields of each route's own dialect (checked on the body as the client sent it).
PREFIX_ROUTES = ("chat", "responses")  # routes that accept a null `required_prefix_token_ids` (required_prefix)
TOKEN_FIELDS = {"chat": ("max_tokens", "max_completion_tokens"), "responses": ("max_output_tokens",), "messages": ("max_tokens",)}


class GateGuardConfig(BaseModel):
    """Limits of the gate's input validation (the only home of their defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="Largest request body the gate reads on a generating route; larger is 413 before forwarding.",
    )
    max_rollout_id_chars: int = Field(
        default=DEFAULT_MAX_ROLLOUT_ID_CHARS,
        ge=1,
        le=MAX_ROLLOUT_ID_CHARS,
        description="Longest rollout id the gate accepts (ids become ledger file names; 200 keeps them under 255 bytes).",
    )
    context_probe_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Deadline of one GET <worker>/v1/models that reads the worker's max_model_len.",
    )
    stream_read_timeout_s: float = Field(
        default=600.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Deadline to connect to the worker and between two reads of a streamed (stream=true) reply.",
    )


def check_rollout_id(rollout_id: str, max_chars: int) -> None:
    """Raise `ApiError` 400 `invalid_rollout_id` unless the id is usable (`nemo_rl.data.calls`)."""
    try:
        calls.check_rollout_id(rollout_id, max_chars)
    except RolloutIdError as e:
        raise ApiError("invalid_rollout_id", str(e), "rollout_id") from e


def split_rollout_path(raw_path: bytes) -> tuple[str | None, str]:
    """(rollout id or None, the route after the prefix), split on the RAW path so an encoded
    `%2F` stays inside the id (and is then refused) instead of moving the route. The id is
    returned decoded: that is what Gym keys its ledger by."""
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


class WorkerContextLimit:
    """The workers' `max_model_len`, read once from `GET <base_url>/models` (first worker that answers)."""

    def __init__(self, base_urls: Sequence[str], timeout_s: float) -> None:
        self._base_urls = [url.rstrip("/") for url in base_urls]
        self._timeout_s = timeout_s
        self._value: int | None = None
        self._lock = asyncio.Lock()

    async def __call__(self) -> int:
        if self._value is not None:
            return self._value
        async with self._lock:
            if self._value is None:
                self._value = await self._probe()
        return self._value

    async def _probe(self) -> int:
        reasons = []
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for url in self._base_urls:
                try:
                    async with session.get(f"{url}/models") as resp:
                        if resp.status != 200:
                            text = (await resp.text())[:300]
                            reasons.append(f"{url}/models answered HTTP {resp.status}: {text}")
                            continue
                        payload = await resp.json()
                except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
                    reasons.append(f"{url}/models: {type(e).__name__}: {e}")
                    continue
                value = (payload.get("data") or [{}])[0].get("max_model_len") if isinstance(payload, dict) else None
                if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                    raise ApiError(
                        "upstream_error", f"{url}/models names no usable max_model_len (got {show(value)})", None
                    )
                return value
        raise ApiError(
            "upstream_unavailable",
            f"no vLLM worker answered its model list within {self._timeout_s:g} s ({'; '.join(reasons)}); the workers "
            "are still starting or are down",
            None,
        )


# (route kind, request body) -> the chat request the worker will get, or None when the route's body
# cannot be converted before Gym's own handling (a streamed Responses/Messages request).
ToChat = Callable[[str, dict], "dict | None"]


class GateGuardMiddleware:
    """Pure ASGI middleware implementing the module contract."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: GateGuardConfig,
        control_token: str,
        to_chat: ToChat,
        context_limit: Callable[[], Awaitable[int]],
    ) -> None:
        if not control_token:
            raise ValueError("GateGuardMiddleware needs the run's control bearer token")
        self.app = app
        self._cfg = config
        self._token = control_token
        self._to_chat = to_chat
        self._context_limit = context_limit

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
            raise ApiError(
                "invalid_rollout_id",
                f"{route} is the capture route without its rollout prefix; send it as "
                f"/ng-rollout/<rollout id>/{CAPTURE_SEGMENT}/...",
                "path",
            )
        if rollout_id is not None:
            check_rollout_id(rollout_id, self._cfg.max_rollout_id_chars)
        kind = GENERATING_ROUTES.get(route)
        if kind is None or str(scope.get("method") or "").upper() != "POST":
            return None
        raw, received = await self._read_body(scope, receive)
        await self._check_body(kind, raw)

        async def replay() -> Message:
            if received:
                return received.pop(0)
            return await receive()

        return replay

    def _check_control(self, scope: Scope, route: str) -> None:
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        authorization = headers.get(b"authorization")
        status = bearer_status(authorization.decode("latin-1") if authorization else None, self._token)
        if status == 401:
            raise ApiError(
                "control_auth_required", "control routes need an Authorization: Bearer <control token> header",
                "Authorization",
            )
        if status == 403:
            raise ApiError("control_auth_invalid", "the control bearer token is not this run's", "Authorization")
        if route.startswith(MANIFEST_PREFIX):
            rollout_id = route[len(MANIFEST_PREFIX) :].split("/", 1)[0]
            check_rollout_id(rollout_id, self._cfg.max_rollout_id_chars)

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, list[Message]]:
        limit = self._cfg.max_body_bytes
        too_large = ApiError(
            "request_too_large",
            f"request body exceeds the gate's limit of {limit} bytes (nrl_gate_guard.max_body_bytes); "
            "nothing was forwarded",
            "body",
        )
        for key, value in scope.get("headers") or []:
            if key.lower() == b"content-length" and value.strip().isdigit() and int(value) > limit:
                raise too_large
        received: list[Message] = []
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message.get("type") != "http.request":
                break  # a disconnect: replayed as it came, the app handles it
            size += len(message.get("body", b"") or b"")
            if size > limit:
                raise too_large
            if not message.get("more_body", False):
                break
        raw = b"".join(m.get("body", b"") or b"" for m in received if m.get("type") == "http.request")
        return raw, received

    async def _check_body(self, kind: str, raw: bytes) -> None:
        try:
            body = parse_json_body(raw)
        except RequestFieldError as e:
            raise ApiError("invalid_json", e.message, e.field) from e
        if not isinstance(body, dict):
            raise ApiError("invalid_request", f"request body must be a JSON object, got {show(body)}", "body")
        max_model_len = await self._context_limit()
        try:
            # The client's own dialect first (precise field names), then Gym's model and conversion.
            if kind in PREFIX_ROUTES:
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
        except (ValueError, TypeError, KeyError, NotImplementedError) as e:  # how Gym's converters refuse input
            raise ApiError(
                "invalid_request",
                f"the {kind} request cannot be converted to a chat request: {type(e).__name__}: {e}",
                "body",
            ) from e
        if chat is None:
            return
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
        error = ApiError(
            "request_too_large", f"request body exceeds {self._limit} bytes ({self._knob})", "body"
        )
        for key, value in scope.get("headers") or []:
            if key.lower() == b"content-length" and value.strip().isdigit() and int(value) > self._limit:
                await answer_error(send, error)
                return
        received: list[Message] = []
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message.get("type") != "http.request":
                break
            size += len(message.get("body", b"") or b"")
            if size > self._limit:
                await answer_error(send, error)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if received:
                return received.pop(0)
            return await receive()

        await self.app(scope, replay, send)


async def answer_error(send: Send, error: ApiError) -> None:
    body = error.encoded()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii"))]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# --- request normalisation: assistant turns echoed by the official `openai` client ---------


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
ECHOED_NULL_MESSAGE_FIELDS = echoed_null_fields(ChatCompletionMessage, ChatCompletionAssistantMessageParam) - {
    "content"
}
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
    """`body` without the response-only fields the openai client echoes (see the module contract)."""
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
    """The raw request bytes after `normalize_chat_request`; the same object when nothing changed.

    Bytes that are not JSON are returned unchanged, and Gym answers them as it would.
    """
    try:
        body = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return raw
    normalized = normalize_chat_request(body)
    if normalized is body:
        return raw
    return json.dumps(normalized, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
