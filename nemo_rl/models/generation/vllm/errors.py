"""The vLLM worker's error classes, by the layer that raises them (a leaf: imports only `nemo_rl.data.errors`).

Every layer of the worker (`engine`, `chat`, `custody`, `serving`, `http`, `worker`) and the
driver's side (`client`) imports its errors from here, so no lower layer imports the actor
module and the driver never imports the worker. The recoverable/fatal split of each class is
docs/design-docs/errors.md's (`models.generation` table).
"""

from __future__ import annotations

from nemo_rl.data.errors import FatalError, RecoverableError

# --- the engine (ids in, ids out) -----------------------------------------------------------


class InvalidChatRequest(RecoverableError, ValueError):
    """The request body is not a chat-completions request this worker can serve (HTTP 400)."""


class EngineError(FatalError, RuntimeError):
    """The vLLM engine failed to start or answered outside its contract (vLLM's `EngineDeadError`
    side): the engine cannot be trusted to serve."""


class EngineFailedError(EngineError):
    """The engine is in the terminal `failed` state; the message names why (an engine that died,
    or a reload that timed out or raised: the weights are unknown)."""


class EngineRequestError(RecoverableError, RuntimeError):
    """One request or one refit attempt failed and the engine serves on (vLLM's
    `EngineGenerateError` side): the caller answers it (503) or keeps the previous weights."""


class GenerationTimeoutError(EngineRequestError):
    """One generation outlived `generation.vllm.generate_timeout_s` and was aborted."""


class RefitGateTimeoutError(EngineRequestError):
    """A request waited longer than the refit deadlines allow for the refit gate to reopen."""


class RefitAbortedError(EngineRequestError):
    """The refit was aborted before any weight changed: the engine serves its previous version."""


# --- chat (render, parse, reply and chunk builders) -----------------------------------------


class TailRenderError(RecoverableError, ValueError):
    """The conversation cannot be split into exact parent prefix + newly rendered tail."""


class TemplateProbeError(RecoverableError, ValueError):
    """The chat template does not mark the end of an assistant turn in a way that can be found."""


class StreamConsistencyError(FatalError, RuntimeError):
    """The content already streamed is not a prefix of the finished reply's content (a bug)."""


# --- custody (the parent prefix) ------------------------------------------------------------


class PrefixError(RecoverableError, RuntimeError):
    """The parent prefix could not be resolved."""


class PrefixMismatchError(PrefixError):
    """Staged records do not form the chain the admission names."""


# --- the worker, as the driver sees it ------------------------------------------------------


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
