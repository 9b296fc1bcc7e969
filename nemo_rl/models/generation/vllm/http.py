"""The vLLM worker's HTTP transport: the only aiohttp code of the worker.

`build_app` serves the OpenAI-compatible routes (`/v1/chat/completions`, whole or `stream=true`;
`/tokenize`; `/v1/models`; `/health`) and the bearer-protected control route over an `Endpoint`
(what the actor owns and updates as it starts, fails, stops), and `serve` opens it on a port the
OS picks. A handler only reads the body (strict JSON, at most `max_request_bytes`) and calls the
`serving.ChatService`; this module is the one place an `ApiError` becomes an HTTP response. Any
other exception is a bug: 500 `internal_error`, the worker failed (every route 503
`worker_failed`), never wedged. Before `serve` lets requests through every route answers 503
`worker_starting`; control routes need the per-run bearer, never logged. `stream_sse` writes a
streamed call's events: a failure before the first event is a JSON error, one after it a
terminal SSE error event, and a client gone mid-stream closes the events (which aborts and
records the call). See docs/design-docs/vllm-worker-capture.md ("The actor shell", "The streamed path").
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from nemo_rl.data.calls import RequestFieldError, bearer_status, parse_json_body
from nemo_rl.data.errors import ApiError, error_name
from nemo_rl.models.generation.vllm.chat import SSE_DONE, sse_event
from nemo_rl.models.generation.vllm.serving import ChatService
from nemo_rl.utils import instrumentation  # opt-in body/latency counters (benchmarks/capture_ab.py)

LOGGER = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.05  # how often a stream with no event due checks that its client is still there
CONTROL_PREFIX = "/control/"
_AUTH_MESSAGES = {
    401: ("control_auth_required", "control routes need an Authorization: Bearer <control token> header"),
    403: ("control_auth_invalid", "the control bearer token is not this run's"),
}


class Endpoint:
    """What the routes serve from; the worker actor owns it and updates it as it starts, fails, stops."""

    def __init__(self) -> None:
        self.service: ChatService | None = None  # None while starting
        self.stopping = False
        # Set by the worker once its engine exists (until then: no failure, nothing to report).
        self.engine_failure: Callable[[], str | None] = lambda: None
        self.engine_state: Callable[[], str] = lambda: "serving"
        self.status: Callable[[], dict[str, Any]] = lambda: {}
        self._bug: str | None = None

    def failure(self) -> str | None:
        """Why the worker is failed: the first bug a route hit, else the engine's failure."""
        return self._bug or self.engine_failure()

    def report_bug(self, where: str, error: BaseException) -> None:
        if self._bug is None:
            trace = "".join(traceback.format_exception(error)).rstrip()
            self._bug = f"internal error in {where}: {error_name(error)}: {error}\n{trace}"

    def state(self) -> str:
        if self.stopping:
            return "stopping"
        if self.failure() is not None:
            return "failed"
        if self.service is None:
            return "starting"
        return self.engine_state()  # serving or refitting


def _error(e: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=headers)


async def _json_body(request: web.Request, max_request_bytes: int) -> object:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise ApiError(
            "request_too_large",
            f"request body exceeds generation.vllm.max_request_bytes={max_request_bytes} bytes",
            param="body",
        ) from e
    try:
        return parse_json_body(raw)
    except RequestFieldError as e:
        raise ApiError("invalid_json", e.message, param=e.field) from e


def _unavailable(endpoint: Endpoint) -> ApiError | None:
    if endpoint.stopping:
        return ApiError("worker_stopping", "the vLLM worker is shutting down")
    failure = endpoint.failure()
    if failure is not None:
        first_line = failure.splitlines()[0]
        return ApiError("worker_failed", f"the vLLM worker is failed and serves nothing: {first_line}")
    if endpoint.service is None:
        return ApiError("worker_starting", "the vLLM worker is still starting; retry once /health answers 200")
    return None


def build_app(
    endpoint: Endpoint, *, model_name: str, max_model_len: int, max_request_bytes: int, control_token: str
) -> web.Application:
    if not control_token:
        raise ValueError("build_app needs the run's control bearer token (control routes are never open)")

    def service() -> ChatService:
        assert endpoint.service is not None  # the availability middleware let the request through
        return endpoint.service

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await _json_body(request, max_request_bytes)
        if isinstance(body, dict) and body.get("stream") is True:
            return await stream_sse(request, await service().chat_completions_stream(body))
        return web.json_response(await service().chat_completions(body))

    async def tokenize(request: web.Request) -> web.Response:
        out = service().tokenize(await _json_body(request, max_request_bytes), max_model_len=max_model_len)
        return web.json_response({**out, "max_model_len": max_model_len})

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "nemo-rl", "max_model_len": max_model_len}]}
        )

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def control_state(_: web.Request) -> web.Response:
        return web.json_response({**endpoint.status(), "state": endpoint.state(), "failure": endpoint.failure()})

    @web.middleware
    async def errors(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return _error(e)
        except web.HTTPException:
            raise  # aiohttp's own answers (404, 405): the caller's mistake, already a response
        except Exception as e:  # a bug in our code: loud, and the worker stops serving (see the contract)
            LOGGER.exception("internal error serving %s %s; the worker is now failed", request.method, request.path)
            endpoint.report_bug(f"{request.method} {request.path}", e)
            return _error(
                ApiError("internal_error", f"internal error ({type(e).__name__}); the worker is now failed, see its log")
            )

    @web.middleware
    async def gate(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith(CONTROL_PREFIX):
            status = bearer_status(request.headers.get("Authorization"), control_token)
            if status is not None:
                err_type, message = _AUTH_MESSAGES[status]
                headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
                return _error(ApiError(err_type, message, param="Authorization"), headers)
            return await handler(request)
        unavailable = _unavailable(endpoint)
        if unavailable is not None:
            return _error(unavailable)
        return await handler(request)

    app = web.Application(client_max_size=max_request_bytes, middlewares=[*instrumentation.aiohttp_middlewares(), errors, gate])
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/health", health)
    app.router.add_get(CONTROL_PREFIX + "state", control_state)
    return app


async def serve(app: web.Application, host: str = "127.0.0.1") -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the bound port only here
    return runner, port


# --- SSE on the wire ---------------------------------------------------------------------------


async def stream_sse(request: web.Request, events: AsyncIterator[bytes]) -> web.StreamResponse:
    """Write `events` as they come, then `data: [DONE]`. The response starts with the first event
    (generation under way): a failure before it is a JSON error, one after it a terminal SSE error
    event (no `[DONE]`). A client gone mid-stream (a write fails, or the connection closes
    while no event is due: checked every `DISCONNECT_POLL_S`) closes `events`, which aborts and
    records the call (`serving.ChatService`'s part), and the handler ends quietly."""
    try:
        first = await anext(events)  # generation started: a failure before it is still a JSON error
    except BaseException:
        await events.aclose()
        raise
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    step: asyncio.Future | None = None
    try:
        await response.prepare(request)
        await response.write(first)
        while True:
            step = asyncio.ensure_future(anext(events, None))
            event = await _step_or_gone(request, step)
            if event is None:
                break
            await response.write(event)
        await response.write(SSE_DONE)
    except ApiError as e:
        await response.write(sse_event(e.body()))
    except ConnectionResetError:
        LOGGER.info("client went away mid-stream on %s", request.path)
        return response
    finally:
        if step is not None and not step.done():  # the handler was cancelled (aiohttp: the client went away)
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)  # the step's own cleanup aborts the generation
        await events.aclose()
    await response.write_eof()
    return response


async def _step_or_gone(request: web.Request, step: asyncio.Future) -> bytes | None:
    """The step's event (None at the end); `ConnectionResetError` once the client's connection is
    closed while the step is still waiting (the step is then cancelled by the caller)."""
    while True:
        done, _ = await asyncio.wait({step}, timeout=DISCONNECT_POLL_S)
        if done:
            return step.result()
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the client closed the connection mid-stream")
