"""The `nemo_gym` environment section and the named errors of the Gym environment.

Contract:
- `NemoGymConfig` is the only home of the Gym environment's defaults (frozen, extra="forbid",
  strict types). Capture settings that the whole recipe shares (on/off, the manifest deadline,
  the name of the bearer's environment variable) are not repeated here: they come from
  `nemo_rl.token_capture.config.TokenCaptureConfig`.
- Every failure of the environment is a subclass of `NemoGymError` whose message names the
  server, the value and the fix; server start failures carry the tail of that server's log.
"""

from __future__ import annotations

from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class NemoGymConfig(BaseModel):
    """How the Gym servers of one run are started and called."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    startup_timeout_s: float = Field(
        default=120.0,
        gt=0,
        allow_inf_nan=False,
        description=(
            "Deadline for all Gym servers to answer their health route; Gym's imports alone take "
            "5-15 s per process on a busy 2-core machine."
        ),
    )
    run_timeout_s: float = Field(
        default=600.0, gt=0, allow_inf_nan=False, description="Deadline for one agent /run (a whole rollout)."
    )
    stop_timeout_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="Grace period between SIGTERM and SIGKILL when stopping the servers.",
    )
    health_poll_interval_s: float = Field(default=0.1, gt=0, allow_inf_nan=False)
    agent_max_steps: int = Field(
        default=4, ge=1, description="Model calls the agent may make per rollout before it stops."
    )
    agent: Literal["simple_agent", "compacting_agent"] = Field(
        default="simple_agent",
        description=(
            "The agent harness: Gym's `simple_agent`, or our `compacting_agent` (simple_agent that "
            "replaces its history with a summary after every `compact_after_tool_results` tool "
            "results, so later calls start new chains)."
        ),
    )
    compact_after_tool_results: int = Field(
        default=1, ge=1, description="With agent=compacting_agent: tool results between two compactions."
    )
    model_name: str = Field(
        default="policy",
        min_length=1,
        description="The `model` the gate puts on every request to the worker.",
    )
    worker_api_key: str = Field(
        default="EMPTY",
        min_length=1,
        description="API key the gate sends to the worker's OpenAI endpoint (not the control bearer).",
    )
    log_tail_lines: int = Field(default=40, ge=1, description="Server-log lines quoted in a start error.")


class NemoGymError(RuntimeError):
    """Base class of every Gym environment failure."""


class GymServerStartError(NemoGymError):
    """A Gym server exited or did not become healthy within its deadline."""

    def __init__(self, server: str, reason: str, log_path: Path, log_tail: str) -> None:
        self.server = server
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(
            f"Gym server `{server}` failed to start: {reason}. Log {log_path} ends with:\n{log_tail}"
        )


class GymNotStartedError(NemoGymError):
    """The environment was used before `start()` or after `stop()`."""


class CaptureModeError(NemoGymError):
    """A call needs the other capture mode (e.g. a manifest with capture off)."""


class InvalidRolloutIdError(NemoGymError, ValueError):
    """A rollout id that Gym's capture paths and ledger file names cannot carry."""


class GymRunError(NemoGymError):
    """The agent's /run answered with an error status."""


class GymRunTimeoutError(NemoGymError):
    """The agent's /run did not answer within `run_timeout_s`."""


class ManifestError(NemoGymError):
    """Fetching a rollout manifest from the gate failed."""


class ManifestAuthError(ManifestError):
    """The gate rejected the control bearer (HTTP 401)."""


class ManifestRequestError(ManifestError):
    """The gate rejected the request itself (HTTP 400, e.g. an invalid rollout id)."""


class ManifestServerError(ManifestError):
    """The gate answered with an unexpected status (5xx or other) or an invalid manifest."""


class ManifestTimeoutError(ManifestError):
    """The gate did not answer the manifest request within the deadline."""
