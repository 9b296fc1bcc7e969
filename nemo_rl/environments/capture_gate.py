"""Our capture gate: Gym's `vllm_model` server with our ledger policy and request normalisation.

Launch: `python -m nemo_rl.environments.capture_gate` with Gym's config variables set
(`NEMO_GYM_CONFIG_DICT`, `NEMO_GYM_CONFIG_PATH`, see `nemo_gym_launch.server_env`) and a
`token_id_capture` block with `enabled`, `external_staging` and a `dir`. With capture off the
launcher runs Gym's own module instead, and this one refuses to start.

What it changes, and why each relaxation is safe:
- Ledger: `BranchingCaptureLedger(dir)` is installed with Gym's `install_lineage_store`.
  Gym's `install_model_call_capture` uses it as the capture ledger because no `lineage_store`
  is configured (configuring one would win over ours, so that is refused). It reads and writes
  the same files as Gym's default `FileLineageStore(dir)`, so the manifest route and retention
  are unchanged.
- Identical siblings (an identical retry leaves two rows with one fingerprint): the
  continuation resolves to the first committed sibling instead of being poisoned as ambiguous.
  This is safe because the worker serves the child from that sibling's staged ids, and the
  request echoes that sibling's exact text. So the child's tokens are what the engine saw and
  sampled. The other sibling is a dead branch in the manifest, which verification already
  tolerates.
- Rewritten history (compaction, stripped reasoning, re-serialised tool calls, a sub-agent):
  the call becomes a new `text` root (a branch) in the same rollout instead of being poisoned.
  This is safe because a text call has no parent ids: the worker renders the whole
  conversation, so earlier generated text is prompt (masked) and the row holds exactly what
  the engine saw. Nothing claims a lineage that was not proven.
- Request normalisation (`gate_normalize.normalize_chat_request`), an outer ASGI middleware on
  POST `.../chat/completions`: it drops null response-only fields that the official `openai`
  client echoes on assistant messages (`annotations`, and null `refusal` / `audio` /
  `function_call` / `tool_calls`). It runs before Gym's capture middleware and request
  validation. This is safe because Gym's fingerprint and context digest read only role,
  content, tool calls and tool results, so lineage is unchanged. Bodies that need no change, or
  are not JSON, pass through byte for byte.
- Multi-worker gates (`num_workers > 1`) are refused: uvicorn workers import Gym's module by
  entrypoint, so they would run without this policy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nemo_gym.global_config import get_global_config_dict
from nemo_gym.token_id_capture.config import token_id_capture_config
from nemo_gym.token_id_capture.protocols import install_lineage_store
from nemo_rl.environments.gate_ledger import BranchingCaptureLedger
from nemo_rl.environments.gate_normalize import normalize_chat_body
from responses_api_models.vllm_model.app import VLLMModel

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CHAT_PATH_SUFFIX = "/chat/completions"


class CaptureGateConfigError(ValueError):
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


def _with_content_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode("ascii")))
    return {**scope, "headers": headers}


class NormalizeChatRequestMiddleware:
    """Pure ASGI middleware: `normalize_chat_body` on POST bodies whose path ends with `/chat/completions`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_chat_post = (
            scope.get("type") == "http"
            and str(scope.get("method") or "").upper() == "POST"
            and str(scope.get("path") or "").endswith(CHAT_PATH_SUFFIX)
        )
        if not is_chat_post:
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
            normalized = normalize_chat_body(raw)
            if normalized is not raw:
                received = [{"type": "http.request", "body": normalized, "more_body": False}]
                scope = _with_content_length(scope, len(normalized))

        async def replay() -> Message:
            if received:
                return received.pop(0)
            return await receive()

        await self.app(scope, replay, send)


class CaptureGateModel(VLLMModel):
    """Gym's `VLLMModel` with the normalisation middleware outside Gym's capture middleware."""

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
        return app


def _plain(config: Any) -> Any:
    return OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config


def main() -> None:
    ledger_dir = ledger_dir_from_config(_plain(get_global_config_dict()))
    install_lineage_store(BranchingCaptureLedger(ledger_dir))
    CaptureGateModel.run_webserver()


if __name__ == "__main__":
    main()
