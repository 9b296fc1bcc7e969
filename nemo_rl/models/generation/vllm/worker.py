"""The async vLLM generation worker: a Ray actor hosting a real `AsyncLLM` and its HTTP endpoint.

A thin actor shell: vLLM stays in `engine.py`, request logic in `serving.py`, the transport in
`server.py`; every failure becomes a `WorkerError` before it crosses the Ray boundary.
Promises: start-up is `bind` (port open, every route 503 `worker_starting`), `start_engine`,
then `serve`, which builds the custody core before letting requests through, so no request is
served uncaptured; a refit that cannot drain keeps the old weights, one that fails leaves the
worker failed (every route 503 `worker_failed`, every driver call `WorkerFailedError`), never
wedged. Control routes need the per-run bearer token, which is never logged.
Invariant: every sample carries the weight version it ran under.
Driver calls and `capture_stats()` counters: docs/design-docs/vllm-worker-capture.md,
"The actor shell".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from nemo_rl.data.errors import FatalError, RecoverableError
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig
from nemo_rl.distributed.shared_fs import SharedDirError, SharedDirProbe, check_probe, require_dir
from nemo_rl.distributed.topology import http_base_url, listen_host
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.server import Endpoint
from nemo_rl.token_capture.config import TokenCaptureConfig
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


def _load_tokenizer(model_dir: Path):  # -> a transformers tokenizer (blocking: file reads, imports)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


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
        self._custody = None  # custody.TQCustody once `serve` built it (capture on)
        self.base_url: str | None = None

    async def start_engine(self) -> None:
        """Start the vLLM engine (the slow part: vLLM imports, model load); serves nothing yet."""
        from nemo_rl.models.generation.vllm.engine import VllmEngine, wait_ready

        t0 = time.monotonic()
        try:
            require_dir(self._model_dir, "model.path", self._where())
        except SharedDirError as e:
            raise WorkerError(str(e)) from e
        try:
            # Off the loop too (transformers' import and the tokenizer's files take a second or more).
            tokenizer = await asyncio.to_thread(_load_tokenizer, self._model_dir)
            # Built off the event loop (vLLM starts its loop tasks lazily then), so the open port keeps
            # answering 503 worker_starting at once instead of hanging while vLLM loads (~60 s on CPU).
            self._engine = await asyncio.to_thread(VllmEngine.start, self._model_dir, self._gen.vllm, tokenizer.eos_token_id)
            await wait_ready(self._engine, self._gen.vllm.startup_timeout_s)
        except Exception as e:
            raise WorkerError(f"vLLM engine failed to start from {self._model_dir}: {type(e).__name__}: {e}") from e
        self._tokenizer = tokenizer
        engine = self._engine
        self._endpoint.engine_failure = lambda: engine.failure
        self._endpoint.engine_state = lambda: engine.state.value
        self._endpoint.status = lambda: {
            "worker_index": self._worker_index,
            "weight_version": engine.weight_version,
            "inflight": engine.inflight,
        }
        LOGGER.warning("vLLM engine for %s up after %.1fs", self._model_dir.name, time.monotonic() - t0)

    def _node_ip(self) -> str:
        import ray.util

        return ray.util.get_node_ip_address()  # in an actor: the IP of the node Ray runs it on

    def _where(self) -> str:
        return f"vLLM worker {self._worker_index} on node {self._node_ip()}"

    async def bind(self, control_token: str) -> str:
        """Open the HTTP endpoint (503 until `serve`); returns `http://<host>:<port>/v1`, where host
        is 127.0.0.1 (`generation.vllm.bind=loopback`) or this node's IP (`node_ip`).

        `control_token` is the run's bearer for the control routes (minted by the launcher)."""
        from nemo_rl.models.generation.vllm.server import build_app, serve

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
            from nemo_rl.utils import instrumentation

            self._service = await self._build_service()
            instrumentation.time_capture_calls(self._service)  # opt-in per-call capture timing (benchmarks/capture_ab.py)
            self._endpoint.service = self._service
        return self.base_url

    async def _build_service(self):  # -> ChatService (imported here: the vLLM venv only)
        from nemo_rl.models.generation.vllm.custody import build_tq_custody, duplicate_wait_bound_s
        from nemo_rl.models.generation.vllm.serving import ChatService

        custody = None
        if self._capture_cfg.enabled:
            if self._dp_cfg is None:
                raise WorkerError("token_capture.enabled=true needs a data plane config for the TQ staging sink")
            engine = self._engine
            try:
                # Awaited, not `ray.get`: no blocking call runs on (or for) the actor's event loop.
                self._client = await DataPlaneClient.attach_async(self._dp_cfg)
                self._custody = build_tq_custody(
                    self._client,
                    self._capture_cfg,
                    weight_version_fn=lambda: engine.weight_version,
                    vocab_size=len(self._tokenizer),
                    max_admitted_calls=self._gen.vllm.max_admitted_calls,
                    worker_index=self._worker_index,
                    duplicate_wait_s=duplicate_wait_bound_s(
                        self._gen.vllm.generate_timeout_s, self._capture_cfg.stage_timeout_s
                    ),
                )
            except Exception as e:  # converted before it crosses the Ray boundary
                raise WorkerError(f"installing token capture failed: {type(e).__name__}: {e}") from e
            custody = self._custody.core
        service = ChatService(
            self._engine,
            self._tokenizer,
            model_name=self._gen.model_name,
            default_max_tokens=self._gen.max_new_tokens,
            max_model_len=self._gen.vllm.max_model_len,
            tool_call_parser=self._gen.tool_call_parser,
            custody=custody,
        )
        return service

    def _require_healthy(self, op: str) -> None:
        """A failed worker refuses every driver call, naming why (the run must not go on silently)."""
        failure = self._endpoint.failure()
        if failure is not None:
            raise WorkerFailedError(f"vLLM worker {self._worker_index} is failed, {op} refused: {failure}")

    async def update_weights(self, weights_dir: str, version: int) -> int:
        from nemo_rl.models.generation.vllm.engine import RefitAbortedError

        if self._engine is None:
            raise WorkerError("update_weights called before start")
        self._require_healthy("update_weights")
        try:
            # Before the engine drains: a folder this node cannot see is a deployment error, not a
            # failed reload, so the worker keeps serving its current weights.
            require_dir(Path(weights_dir), "grpo.refit_dir", self._where())
        except SharedDirError as e:
            raise WorkerError(str(e)) from e
        try:
            await self._engine.reload_weights(Path(weights_dir), version)
        except RefitAbortedError as e:
            raise RefitAbortedWorkerError(f"vLLM worker {self._worker_index}: {e}") from e
        except Exception as e:  # converted before it crosses the Ray boundary; a reload error also fails the engine
            raise WorkerError(
                f"vLLM worker {self._worker_index}: refit to version {version} from {weights_dir} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        return self._engine.weight_version

    def venv_info(self) -> dict:
        """The venv this actor runs in, measured in the actor: prefix, folder, marker spec hash."""
        return running_venv_info()

    def engine_core_processes(self) -> list[dict]:
        """This worker's vLLM engine-core processes (`ChildProcess.to_wire`), for the component watch.

        Answers in the failed state too: a dead engine core is what the watch must be able to name."""
        from nemo_rl.models.generation.vllm.engine import EngineError

        if self._engine is None:
            raise WorkerError("engine_core_processes called before start_engine")
        try:
            return [child.to_wire() for child in self._engine.core_processes()]
        except EngineError as e:  # converted before it crosses the Ray boundary
            raise WorkerError(f"vLLM worker {self._worker_index}: {e}") from e

    def weight_version(self) -> int:
        if self._engine is None:
            raise WorkerError("weight_version called before start")
        self._require_healthy("weight_version")
        return self._engine.weight_version

    def engine_records(self, request_ids: list[str]) -> dict[str, dict]:
        """What the engine itself sampled, per request id (the audit trail for exactness checks)."""
        if self._engine is None:
            raise WorkerError("engine_records called before start")
        self._require_healthy("engine_records")
        return {rid: vars(rec) for rid, rec in self._engine.records(request_ids).items()}

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        if self._engine is None:
            raise WorkerError("prompt_logprobs called before start")
        from nemo_rl.models.generation.vllm.engine import EngineError, EngineRequestError

        self._require_healthy("prompt_logprobs")
        try:
            return await self._engine.prompt_logprobs(token_ids)
        # Both sides of the engine's split (a dead engine, or a gate/deadline miss of this call):
        # converted before they cross the Ray boundary.
        except (EngineError, EngineRequestError) as e:
            raise WorkerError(f"vLLM worker {self._worker_index}: prompt_logprobs failed: {type(e).__name__}: {e}") from e

    async def take_served(self, rollout_ids: list[str]) -> list[dict]:
        """Pop what this worker served for `rollout_ids`, as `ServedCall` wire dicts.

        Under write-behind staging it first waits (off the event loop, bounded by
        `token_capture.stage_timeout_s`) for the rollouts' staged rows to be written.
        """
        if self._service is None:
            raise WorkerError("take_served called before start")
        self._require_healthy("take_served")
        calls = await asyncio.to_thread(self._service.take_served, list(rollout_ids))
        return [call.to_wire() for call in calls]

    def capture_stats(self) -> dict:
        if self._service is None:
            raise WorkerError("capture_stats called before start")
        self._require_healthy("capture_stats")
        cache = self._service.prefix_cache
        return {
            "worker_index": self._worker_index,
            "served_calls": self._service.stats["served_calls"],
            # None only for a service without an engine (a test's stand-in): `serve` needs one
            "engine_timing": dataclasses.asdict(self._engine.timing()) if self._engine is not None else None,
            "served_rollouts_pending": self._service.served_rollouts_pending(),
            "calls": dict(self._service.stats),
            "capture_failures": list(self._service.capture_failures),
            "prefix_cache_fetched_keys": cache.fetched_keys if cache else 0,
            "prefix_cache_fetched_tokens": cache.fetched_tokens if cache else 0,
            "prefix_cache_seeded_keys": cache.seeded_keys if cache else 0,
            "prefix_cache_seed_rejected": cache.seed_rejected if cache else 0,
            "prefix_cache_tokens": cache.cached_tokens if cache else 0,
            **(self._custody.stats() if self._custody else {"prefix_fetch_missing_waits": 0, "stage_writer": None}),
        }

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
        # The writer's join and the client's close wait on threads: off the actor's event loop.
        if self._custody is not None and self._custody.writer is not None:
            await asyncio.to_thread(self._custody.writer.close, self._capture_cfg.stage_timeout_s)  # before its client
        self._custody = None
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
            self._client = None
