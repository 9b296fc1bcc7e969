"""OpenAI-compatible HTTP transport over `ChatService` (aiohttp, bound to 127.0.0.1).

Routes: POST /v1/chat/completions, POST /tokenize (and /v1/tokenize), GET /v1/models,
GET /health. Handlers only parse JSON, call the service and map `HttpError` to its status with
an OpenAI-style error body; any other exception is a 500 that names its type.

The port can be opened before the engine is up (so the Gym servers can be pointed at it while
vLLM loads): until `get_service()` returns a service, every route answers 503 `worker_starting`
and nothing is generated.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from aiohttp import web

from nemo_rl.models.generation.vllm.serving import ChatService, HttpError

LOGGER = logging.getLogger(__name__)


async def _json_body(request: web.Request) -> object:
    try:
        return await request.json(loads=json.loads)
    except json.JSONDecodeError as e:
        raise HttpError(400, "invalid_json", f"request body is not JSON: {e}") from e


def _error(e: HttpError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


_STARTING = HttpError(503, "worker_starting", "the vLLM worker is still starting; retry once /health answers 200")


def build_app(
    get_service: Callable[[], ChatService | None], *, model_name: str, max_model_len: int
) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        try:
            return web.json_response(await get_service().chat_completions(await _json_body(request)))
        except HttpError as e:
            return _error(e)
        except Exception as e:
            LOGGER.exception("chat completion failed")
            return _error(HttpError(500, "engine_error", f"{type(e).__name__}: {e}"))

    async def tokenize(request: web.Request) -> web.Response:
        try:
            out = get_service().tokenize(await _json_body(request))
        except HttpError as e:
            return _error(e)
        return web.json_response({**out, "max_model_len": max_model_len})

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "nemo-rl", "max_model_len": max_model_len}]}
        )

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    @web.middleware
    async def starting_gate(request: web.Request, handler) -> web.StreamResponse:
        # One gate for every route: nothing is served before the service is let through.
        if get_service() is None:
            return _error(_STARTING)
        return await handler(request)

    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[starting_gate])
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/health", health)
    return app


async def serve(app: web.Application, host: str = "127.0.0.1") -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the bound port only here
    return runner, port
