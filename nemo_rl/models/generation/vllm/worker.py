"""The vLLM worker's Ray actor shell: `VllmGenerationWorker`, and nothing else.

It hosts a real `AsyncLLM` (`engine.py`) behind `serving.ChatService`, served over `http.py`;
start-up and tear-down are `lifecycle.py`'s, refit `refit.py`'s, the probes `diagnostics.py`'s
(its control methods delegate). Start-up is `bind` (port open, every route 503
`worker_starting`), `start_engine`, then `serve`, which builds the custody core before letting
requests through, so no request is served uncaptured. A route that hit a bug leaves the worker
failed (`http.Endpoint`): every driver call then raises `WorkerFailedError`. The driver's side
of these calls is `client.py`. Invariant: every failure crossing the Ray boundary is a
`WorkerError` or `WorkerFailedError` (`errors.py`).
See docs/design-docs/vllm-worker-capture.md ("The actor shell").
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from nemo_rl.data.errors import error_name
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig
from nemo_rl.distributed.shared_fs import SharedDirError, SharedDirProbe, check_probe, require_dir
from nemo_rl.distributed.topology import http_base_url, listen_host
from nemo_rl.models.generation.vllm import diagnostics, refit
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.engine import VllmEngine
from nemo_rl.models.generation.vllm.errors import WorkerError, WorkerFailedError
from nemo_rl.models.generation.vllm.http import Endpoint, build_app, serve
from nemo_rl.models.generation.vllm.lifecycle import attach_capture, close_capture, start_engine, wait_ready
from nemo_rl.models.generation.vllm.serving import ChatService, chat_service
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.utils import instrumentation  # opt-in per-call capture timing (benchmarks/capture_ab.py)
from nemo_rl.utils.venvs import running_venv_info



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

    # Refit and the probes run off the rollout path, in `refit` and `diagnostics`.
    async def update_weights(self, weights_dir: str, version: int) -> int:
        engine = self._engine_for("update_weights")
        return await refit.update_weights(engine, Path(weights_dir), version, worker_index=self._worker_index,
                                          where=self._where())

    def venv_info(self) -> dict:
        """The venv this actor runs in, measured in the actor: prefix, folder, marker spec hash."""
        return running_venv_info()

    def engine_core_processes(self) -> list[dict]:
        """This worker's vLLM engine-core processes, for the component watch (in the failed state too)."""
        if self._engine is None:
            raise WorkerError("engine_core_processes called before start_engine")
        return diagnostics.core_process_wires(self._engine, self._worker_index)

    def weight_version(self) -> int:
        return self._engine_for("weight_version").weight_version

    def engine_records(self, request_ids: list[str]) -> dict[str, dict]:
        return diagnostics.engine_records(self._engine_for("engine_records"), request_ids)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
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
