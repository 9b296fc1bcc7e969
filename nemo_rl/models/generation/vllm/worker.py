"""The vLLM worker's process-facing shell: its Ray actor, its HTTP transport, the driver's served report.

`VllmGenerationWorker` hosts a real `AsyncLLM` (`engine.py`) behind `ChatService` (`serving.py`);
start-up and tear-down are `lifecycle.py`'s, refit `refit.py`'s, the probes `diagnostics.py`'s
(its control methods delegate). Start-up is `bind` (port open, every route 503
`worker_starting`), `start_engine`, then `serve`, which builds the custody core before letting
requests through, so no request is served uncaptured. `build_app` (aiohttp) only reads the body
(strict JSON, at most `max_request_bytes`), calls the service and is the one place an `ApiError`
becomes an HTTP response; any other exception is a bug: 500 `internal_error`, the worker failed
(every route 503 `worker_failed`, every driver call `WorkerFailedError`), never wedged. Control
routes need the per-run bearer, never logged. `ServedReporter` is the driver's per-rollout handle
(`take_served_async`). Invariant: every failure crossing the Ray boundary is a `WorkerError` or
`WorkerFailedError`. See docs/design-docs/vllm-worker-capture.md ("The actor shell").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from aiohttp import web

from nemo_rl.data.calls import RequestFieldError, ServedCall, bearer_status, parse_json_body
from nemo_rl.data.errors import ApiError, FatalError, RecoverableError, error_name
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig
from nemo_rl.distributed.actor_call import (
    ActorCallError,
    ActorCallTimeoutError,
    ActorDiedError,
    ActorRaisedError,
    await_with_deadline,
)
from nemo_rl.distributed.shared_fs import SharedDirError, SharedDirProbe, check_probe, require_dir
from nemo_rl.distributed.topology import http_base_url, listen_host
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.lifecycle import (
    attach_capture,
    chat_service,
    close_capture,
    start_engine,
    wait_ready,
)
from nemo_rl.models.generation.vllm.engine import VllmEngine
from nemo_rl.models.generation.vllm.serving import ChatService
from nemo_rl.models.generation.vllm.tokenize_route import tokenize as tokenize_body
from nemo_rl.models.generation.vllm.streaming import open_chat_stream, stream_sse
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.utils import instrumentation  # opt-in body/latency counters (benchmarks/capture_ab.py)
from nemo_rl.utils.venvs import running_venv_info

LOGGER = logging.getLogger(__name__)


class WorkerError(RecoverableError, RuntimeError):
    """A generation-worker operation failed (the message names the operation and cause); the
    worker itself may serve on, so the caller decides (a missing served report, a skipped refit)."""


class RefitAbortedWorkerError(WorkerError):
    """A refit drained past `generation.vllm.refit_drain_timeout_s` and was aborted: the worker
    serves on with its previous weights and version (the async loop tolerates it and reads versions)."""


class WorkerFailedError(FatalError, RuntimeError):
    """The worker is in its terminal failed state (engine failed, or a bug hit a route): it serves
    nothing more, so the run must stop; the message carries the reason (a bug's traceback). Not a
    `WorkerError`: a caller that handles both names both."""


# --- the HTTP transport ---------------------------------------------------------------------

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
            return await stream_sse(request, await open_chat_stream(service(), body))
        return web.json_response(await service().chat_completions(body))

    async def tokenize(request: web.Request) -> web.Response:
        out = tokenize_body(service(), await _json_body(request, max_request_bytes), max_model_len=max_model_len)
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


# --- the actor ------------------------------------------------------------------------------


class VllmGenerationWorker:
    def __init__(
        self,
        model_dir: str,
        generation_cfg: dict,
        token_capture_cfg: dict,
        data_plane_cfg: dict | None,
        *,
        worker_index: int = 0,
    ) -> None:
        self._model_dir = Path(model_dir)
        self._worker_index = worker_index
        self._gen = GenerationConfig.model_validate(generation_cfg)
        self._capture_cfg = TokenCaptureConfig.model_validate(token_capture_cfg)
        self._dp_cfg = DataPlaneConfig.model_validate(data_plane_cfg) if data_plane_cfg is not None else None
        self._engine = None
        self._tokenizer = None
        self._service = None  # the ChatService, built by `serve`
        self._endpoint = Endpoint()  # what the HTTP routes serve from (starting until `serve`)
        self._runner = None
        self._client: DataPlaneClient | None = None
        self._custody = None  # lifecycle.TQCustody once `serve` built it (capture on)
        self.base_url: str | None = None

    async def start_engine(self) -> None:
        """Start the vLLM engine (the slow part: vLLM imports, model load); serves nothing yet."""
        t0 = time.monotonic()
        try:
            require_dir(self._model_dir, "model.path", self._where())
        except SharedDirError as e:
            raise WorkerError(str(e)) from e
        try:
            tokenizer, self._engine = await start_engine(self._model_dir, self._gen.vllm)
            await wait_ready(self._engine, self._gen.vllm.startup_timeout_s)
        except Exception as e:
            raise WorkerError(f"vLLM engine failed to start from {self._model_dir}: {error_name(e)}: {e}") from e
        self._tokenizer = tokenizer
        engine = self._engine
        self._endpoint.engine_failure = lambda: engine.failure
        self._endpoint.engine_state = lambda: engine.state.value
        self._endpoint.status = lambda: {
            "worker_index": self._worker_index,
            "weight_version": engine.weight_version,
            "inflight": engine.inflight,
        }
        print(f"[vllm] engine for {self._model_dir.name} up after {time.monotonic() - t0:.1f}s", flush=True)

    def _node_ip(self) -> str:
        import ray.util

        return ray.util.get_node_ip_address()  # in an actor: the IP of the node Ray runs it on

    def _where(self) -> str:
        return f"vLLM worker {self._worker_index} on node {self._node_ip()}"

    async def bind(self, control_token: str) -> str:
        """Open the HTTP endpoint (503 until `serve`); returns `http://<host>:<port>/v1`, where host
        is 127.0.0.1 (`generation.vllm.bind=loopback`) or this node's IP (`node_ip`).

        `control_token` is the run's bearer for the control routes (minted by the launcher)."""
        if self.base_url is not None:
            return self.base_url
        bind = self._gen.vllm.bind
        host = listen_host(bind, self._node_ip() if bind == "node_ip" else "")
        app = build_app(
            self._endpoint,
            model_name=self._gen.model_name,
            max_model_len=self._gen.vllm.max_model_len,
            max_request_bytes=self._gen.vllm.max_request_bytes,
            control_token=control_token,
        )
        try:
            self._runner, port = await serve(app, host)
        except OSError as e:
            raise WorkerError(
                f"vLLM worker {self._worker_index} could not open its HTTP port on {host} "
                f"(generation.vllm.bind={bind}): {e}"
            ) from e
        self.base_url = http_base_url(host, port)
        return self.base_url

    def check_shared_dir(self, probe: SharedDirProbe, knob: str) -> None:
        """Raise `WorkerError` unless this worker reads the driver's probe (the folder is shared)."""
        try:
            check_probe(probe, knob, self._where())
        except SharedDirError as e:
            raise WorkerError(str(e)) from e

    async def serve(self) -> str:
        """Build the chat service (with token capture when enabled; the data plane must be up), then
        let requests through; returns the base URL. Capture is in place before the first request."""
        if self._engine is None or self.base_url is None:
            raise WorkerError("serve called before bind and start_engine")
        if self._endpoint.service is None:
            self._service = await self._build_service()
            instrumentation.time_capture_calls(self._service)  # opt-in per-call capture timing (benchmarks/capture_ab.py)
            self._endpoint.service = self._service
        return self.base_url

    async def _build_service(self) -> ChatService:
        custody = None
        if self._capture_cfg.enabled:
            if self._dp_cfg is None:
                raise WorkerError("token_capture.enabled=true needs a data plane config for the TQ staging sink")
            engine = self._engine
            try:
                self._client, self._custody = await attach_capture(
                    self._dp_cfg, self._capture_cfg, self._gen, weight_version_fn=lambda: engine.weight_version,
                    vocab_size=len(self._tokenizer), worker_index=self._worker_index,
                )
            except Exception as e:  # converted before it crosses the Ray boundary
                raise WorkerError(f"installing token capture failed: {error_name(e)}: {e}") from e
            custody = self._custody.core
        return chat_service(self._engine, self._tokenizer, self._gen, custody)

    def _require_healthy(self, op: str) -> None:
        """A failed worker refuses every driver call, naming why (the run must not go on silently)."""
        failure = self._endpoint.failure()
        if failure is not None:
            raise WorkerFailedError(f"vLLM worker {self._worker_index} is failed, {op} refused: {failure}")

    def _engine_for(self, op: str) -> VllmEngine:
        """The engine a driver call `op` needs: started, and the worker not failed."""
        if self._engine is None:
            raise WorkerError(f"{op} called before start")
        self._require_healthy(op)
        return self._engine

    def _service_for(self, op: str) -> ChatService:
        """The chat service a driver call `op` needs: built by `serve`, and the worker not failed."""
        if self._service is None:
            raise WorkerError(f"{op} called before start")
        self._require_healthy(op)
        return self._service

    # Refit and the probes run off the rollout path, in `refit` and `diagnostics` (imported on
    # first use: both import this module's errors).
    async def update_weights(self, weights_dir: str, version: int) -> int:
        from nemo_rl.models.generation.vllm import refit

        engine = self._engine_for("update_weights")
        return await refit.update_weights(engine, Path(weights_dir), version, worker_index=self._worker_index,
                                          where=self._where())

    def venv_info(self) -> dict:
        """The venv this actor runs in, measured in the actor: prefix, folder, marker spec hash."""
        return running_venv_info()

    def engine_core_processes(self) -> list[dict]:
        """This worker's vLLM engine-core processes, for the component watch (in the failed state too)."""
        from nemo_rl.models.generation.vllm import diagnostics

        if self._engine is None:
            raise WorkerError("engine_core_processes called before start_engine")
        return diagnostics.core_process_wires(self._engine, self._worker_index)

    def weight_version(self) -> int:
        return self._engine_for("weight_version").weight_version

    def engine_records(self, request_ids: list[str]) -> dict[str, dict]:
        from nemo_rl.models.generation.vllm import diagnostics

        return diagnostics.engine_records(self._engine_for("engine_records"), request_ids)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        from nemo_rl.models.generation.vllm import diagnostics

        return await diagnostics.prompt_logprobs(self._engine_for("prompt_logprobs"), token_ids, self._worker_index)

    async def take_served(self, rollout_ids: list[str]) -> list[dict]:
        """Pop what this worker served for `rollout_ids`, as `ServedCall` wire dicts.

        Under write-behind staging it first waits (off the event loop, bounded by
        `token_capture.stage_timeout_s`) for the rollouts' staged rows to be written.
        """
        service = self._service_for("take_served")
        calls = await asyncio.to_thread(service.take_served, list(rollout_ids))
        return [call.to_wire() for call in calls]

    def capture_stats(self) -> dict:
        from nemo_rl.models.generation.vllm import diagnostics

        service = self._service_for("capture_stats")
        return diagnostics.capture_stats(service, self._engine, self._custody, self._worker_index)

    async def shutdown(self) -> None:
        self._endpoint.stopping = True  # requests arriving from now on get 503 worker_stopping
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._engine is not None:
            # Joins the engine-core processes (bounded by vLLM's shutdown timeout): off the event loop.
            # vLLM hands the loop-bound part (its sockets and output task) back to this loop itself.
            await asyncio.to_thread(self._engine.shutdown)
            self._engine = None
        custody, client, self._custody, self._client = self._custody, self._client, None, None
        await close_capture(custody, client, self._capture_cfg.stage_timeout_s)


# --- the driver's side: the per-rollout served report ---------------------------------------

WORKERS = "vLLM workers"  # the actor name `ActorCallError`s of group calls carry


def raise_worker_error(
    failure: ActorCallTimeoutError | ActorDiedError | ActorRaisedError, timeout_s: float
) -> NoReturn:
    """A failed group call as a `WorkerError`; what a worker raised itself stays as it is (a
    `WorkerError` such as a refit failure, a `WorkerFailedError`, or a bug)."""
    if isinstance(failure, ActorRaisedError):
        assert failure.cause is not None
        raise failure.cause from None
    if isinstance(failure, ActorCallTimeoutError):
        raise WorkerError(f"vLLM worker {failure.op} exceeded its {timeout_s:.0f}s deadline") from failure
    raise WorkerError(f"vLLM worker died during {failure.op}: {failure.cause}") from failure


def merge_served(parts: list[list[dict]]) -> list[ServedCall]:
    """Every worker's `take_served` answer (wire dicts), in worker order, as `ServedCall`s.

    Nothing is dropped or deduplicated: each record is one completion a worker produced.
    A malformed record raises `RecordInvariantError` (`served_call`: a worker/driver version mismatch).
    """
    return [ServedCall.from_wire(record) for part in parts for record in part]


@dataclasses.dataclass(frozen=True)
class ServedReporter:
    """The driver's served-call report over the worker actors (`launcher.WorkerGroup.served`)."""

    handles: list[Any]
    call_timeout_s: float

    async def take_served_async(self, rollout_ids: list[str]) -> list[ServedCall]:
        """Pop what every worker served for `rollout_ids`; awaits the refs, never blocks the event loop."""
        refs = [h.take_served.remote(list(rollout_ids)) for h in self.handles]
        try:
            parts = await await_with_deadline(refs, actor=WORKERS, op="take_served", timeout_s=self.call_timeout_s)
        except ActorCallError as e:
            raise_worker_error(e, self.call_timeout_s)
        return merge_served(parts)
