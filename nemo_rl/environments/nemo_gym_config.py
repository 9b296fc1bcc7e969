"""The `nemo_gym` environment section and the named errors of the Gym environment.

`NemoGymConfig` is the only home of the Gym environment's defaults (frozen, extra="forbid",
strict types); recipe-wide capture settings come from `TokenCaptureConfig`, not from here.
`env.gym` (`GymEnvironmentConfig`) names a Gym environment as Gym names it (package, config
YAML, dataset, reward key); unset, the run uses the task `env.task` names. The agent is
`env.agent` in both cases. Every set-up or usage failure is a `NemoGymError` (fatal) naming the
server, the value and the fix; its `kind` (`NemoGymKind`) says which failure; start failures
carry the tail of that server's log. A failed call for one rollout (/run, manifest) is a
`GymCallError` (recoverable: a placeholder).
"""

from __future__ import annotations

import typing
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nemo_rl.data.errors import FatalError, Kinded, RecoverableError
from nemo_rl.environments.gate.setup import GateGuardConfig

# A Gym package name is one Python identifier (it is imported as `resources_servers.<name>.app`).
_PACKAGE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# `env.agent`: a package, or `<package>/<flavour>` as Gym names a flavour (nemo_rl.environments.gym_agents).
_AGENT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*)?$"
# `env.task`: a dotted module path, a colon, an attribute name.
_TASK_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
DEFAULT_TASK = "examples.arith.gym_task:TASK"
PACKAGE_DATASET_PREFIX = "package:"
# Server keys the launcher sets itself (see nemo_gym_launch.build_global_config).
WIRING_KEYS = frozenset(
    {"host", "port", "resources_server", "model_server", "token_id_capture", "datasets", "max_steps"}
)


class GymEnvironmentConfig(BaseModel):
    """One shipped (or installed) Gym environment, by name (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    resources_server: str = Field(
        pattern=_PACKAGE_PATTERN,
        description="Package under Gym's `resources_servers/`, e.g. `example_multi_step` (launched as "
        "`python -m resources_servers.<name>.app`).",
    )
    config_path: str | None = Field(
        default=None,
        min_length=1,
        description="Gym config YAML relative to the package; null means `configs/<resources_server>.yaml`. "
        "Its resources-server block (entrypoint, domain, server keys) and the simple_agent block wired to "
        "it (minus `datasets`) become the servers' config.",
    )
    dataset: str = Field(
        default="package:data/example.jsonl",
        min_length=1,
        description="Prompt rows in Gym's format (`responses_create_params` + verifier fields): "
        "`package:<path relative to the resources server package>` or an absolute path.",
    )
    reward_key: str = Field(
        default="reward", min_length=1, description="The key of Gym's verify result that is the training reward."
    )
    resources_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Keys set on top of the YAML's resources-server block."
    )
    agent_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Keys set on top of the YAML's agent block (wiring keys excluded)."
    )

    @field_validator("config_path")
    @classmethod
    def _relative_config(cls, value: str | None) -> str | None:
        if value is not None and (Path(value).is_absolute() or ".." in Path(value).parts):
            raise ValueError(
                f"env.gym.config_path={value!r} must be a path inside the resources server package "
                "(e.g. configs/<name>.yaml), without '..'"
            )
        return value

    @field_validator("dataset")
    @classmethod
    def _dataset_form(cls, value: str) -> str:
        if value.startswith(PACKAGE_DATASET_PREFIX):
            rel = Path(value[len(PACKAGE_DATASET_PREFIX):])
            if not rel.parts or rel.is_absolute() or ".." in rel.parts:
                raise ValueError(
                    f"env.gym.dataset={value!r}: after 'package:' give a path inside the package, "
                    "e.g. package:data/example.jsonl"
                )
        elif not Path(value).is_absolute():
            raise ValueError(
                f"env.gym.dataset={value!r} is neither 'package:<relative path>' nor an absolute path; "
                "relative paths would depend on the working directory"
            )
        return value

    @field_validator("resources_overrides", "agent_overrides")
    @classmethod
    def _no_wiring_keys(cls, value: dict[str, Any], info: Any) -> dict[str, Any]:
        wired = sorted(set(value) & WIRING_KEYS)
        if wired:
            raise ValueError(
                f"env.gym.{info.field_name} sets {wired}, which the launcher owns (loopback ports, the "
                "gate/resources references, capture opt-in; max_steps is env.agent_max_steps); remove them"
            )
        return value

    @property
    def config_relpath(self) -> str:
        return self.config_path if self.config_path is not None else f"configs/{self.resources_server}.yaml"


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
    agent: str = Field(
        default="simple_agent",
        pattern=_AGENT_PATTERN,
        description=(
            "The agent harness, as Gym names it: any installed Gym agent package under "
            "`responses_api_agents/` (`simple_agent`, `simple_agent_with_compaction`, ...) or one of "
            "a package's flavours as `<package>/<flavour>` (`langgraph_agent/reflection_agent`); an "
            "agent whose requirements.txt adds packages runs in a venv of its own built from it "
            "(spec-hashed, first use builds it); or our `compacting_agent` (simple_agent "
            "that replaces its history with a summary after every `compact_after_tool_results` tool "
            "results, so later calls start new chains). Capture works with any agent built on "
            "Gym's base agent class, which carries the rollout identity on every model call."
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
    gym: GymEnvironmentConfig | None = Field(
        default=None,
        description="A NeMo-Gym environment by name; null runs the task `task` names.",
    )
    task: str = Field(
        default=DEFAULT_TASK,
        pattern=_TASK_PATTERN,
        description=(
            "With env.gym null: the task whose resources server and prompt rows the run uses, as "
            "`<module>:<attribute>` (an object with `resources_server` and `rows(seed, count, sampling)`, "
            "see nemo_rl.environments.task.GymTask); the default is the example arithmetic task."
        ),
    )
    gate_guard: GateGuardConfig = Field(
        default_factory=GateGuardConfig,
        description="Input limits and deadlines of our capture gate (body size, rollout id length, the context probe's "
                    "deadline, a streamed call's read deadline).",
    )
    arith_problem_pool: int | None = Field(
        default=None,
        ge=1,
        description=(
            "The `env.task` environment only (env.gym null): null draws fresh problems every step; N "
            "draws a fixed pool of N problems once (from grpo.seed) and walks it in shuffled epochs "
            "like a dataset, so each problem comes back every N / num_prompts_per_step steps."
        ),
    )

    @model_validator(mode="after")
    def _pool_needs_arith(self) -> "NemoGymConfig":
        if self.gym is not None and self.arith_problem_pool is not None:
            raise ValueError(
                f"env.arith_problem_pool={self.arith_problem_pool} applies to the built-in arithmetic "
                f"environment, but env.gym names {self.gym.resources_server!r}, whose prompts come from "
                "its dataset (fix: drop env.arith_problem_pool, or unset env.gym)"
            )
        return self


NemoGymKind = Literal[
    "env_not_found",
    "task_load",
    "not_started",
    "call_order",
    "client_closed",
    "client_loop",
    "capture_mode",
    "server_start",
    "requirements",
    "dataset",
    "invalid_rollout_id",
    "platform",
]
"""What is wrong: `env.gym` names a package, config YAML, block or dataset that does not exist;
`env.task` names no usable task (see `nemo_rl.environments.task.load_task`); the environment was
used before `start()` or after `stop()` (or names a server that was not started); `start()` twice
or `restart()` of a live server; a request
through the environment's HTTP client after `aclose()` / `stop()` closed it; that client was used
from an event loop other than the one it was made in; a call needs the other capture mode (e.g. a
manifest with capture off); a prompt dataset file or row is unusable (the message names the file
and line); a rollout id Gym's capture paths and ledger file names cannot carry, or a `run()` that
passes none with capture on; a host that cannot tie a server's life to its launcher's
(`parent_watch`: no Linux `PR_SET_PDEATHSIG`); and, each with its own class (fields): a Gym
server that did not start (`GymServerStartError`), packages a server needs (`GymRequirementsError`)."""


class NemoGymError(Kinded, FatalError, RuntimeError):
    """The Gym environment cannot be set up or was used wrongly (config, servers, datasets, call
    order): the run stops. A failed call for one rollout is a `GymCallError` instead."""

    KINDS = typing.get_args(NemoGymKind)
    OWN_CLASS = MappingProxyType({"server_start": "GymServerStartError", "requirements": "GymRequirementsError"})
    kind: NemoGymKind

    def __init__(self, message: str, *, kind: NemoGymKind) -> None:
        super().__init__(message, kind=kind)


class GymServerStartError(NemoGymError):
    """A Gym server exited or did not become healthy within its deadline."""

    def __init__(self, server: str, reason: str, log_path: Path, log_tail: str) -> None:
        self.server = server
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(
            f"Gym server `{server}` failed to start: {reason}. Log {log_path} ends with:\n{log_tail}",
            kind="server_start",
        )


class GymRequirementsError(NemoGymError):
    """A Gym resources server or agent needs packages that are not installed in this venv."""

    def __init__(
        self, server: str, requirements_path: Path, missing: list[str], field: str = "env.gym.resources_server"
    ) -> None:
        self.server = server
        self.missing = list(missing)
        what = "agent" if field == "env.agent" else "resources server"
        super().__init__(
            f"Gym {what} `{server}` needs packages this venv does not have: {', '.join(missing)} "
            f"(from {requirements_path}). Fix: add them to the project's dependencies (pyproject.toml) "
            f"and `uv sync`, or pick another {field}",
            kind="requirements",
        )


class GymCallError(RecoverableError, RuntimeError):
    """One call to a Gym server for one rollout failed (its /run, or its manifest from the gate):
    the rollout manager records a placeholder for that rollout and the run goes on."""


class GymRunError(GymCallError):
    """The agent's /run answered with an error status."""


class GymRunTimeoutError(GymCallError):
    """The agent's /run did not answer within `run_timeout_s`."""


ManifestKind = Literal["auth", "request", "server", "timeout"]
"""Why the gate's manifest for one rollout could not be had: it rejected the control bearer
(HTTP 401/403), it rejected the request itself (HTTP 400, e.g. an invalid rollout id), it answered
another status or a body that is not a valid manifest (or the connection failed), or it did not
answer within `token_capture.manifest_timeout_s`."""


class ManifestError(Kinded, GymCallError):
    """Fetching a rollout manifest from the gate failed (`kind` says how): the judge fails that
    rollout closed (a placeholder)."""

    KINDS = typing.get_args(ManifestKind)
    kind: ManifestKind

    def __init__(self, message: str, *, kind: ManifestKind) -> None:
        super().__init__(message, kind=kind)
