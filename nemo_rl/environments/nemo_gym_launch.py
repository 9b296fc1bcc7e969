"""How our Gym servers are launched: global config, commands, environment, ports, logs, stopping.

Three Gym servers (the gate, the resources server, the agent) run as plain subprocesses of the
current interpreter on 127.0.0.1, without Ray, Gym's per-server venvs or Gym's head server; each
gets the whole resolved global config (`build_global_config`, pure) and its own key. Promises:
with capture wiring the config carries exactly the contract's `token_id_capture` block and the
gate's input limits, without it Gym's legacy token echo; inherited `NEMO_GYM_*` variables never
reach a server; every server dies with its launching process (`parent_watch`).
Refuses config values containing `${` (OmegaConf interpolation). `terminate_processes` signals
only the process groups it is handed, SIGTERM then SIGKILL after the deadline.
See docs/design-docs/gym-environment.md, "How the servers are launched".
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nemo_rl.environments.gate.setup import GATE_GUARD_KEY, GateGuardConfig
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.utils import instrumentation

LOOPBACK = "127.0.0.1"
GATE = "policy_model"
GATE_MODULE = "responses_api_models.vllm_model.app"
CAPTURE_GATE_MODULE = "nemo_rl.environments.gate.app"
AGENT_MODULE = "responses_api_agents.simple_agent.app"
COMPACTING_AGENT_MODULE = "nemo_rl.environments.agents.compacting_agent"
# Runs a Gym agent module named in its env so its model calls carry the rollout prefix (flavours).
ROLLOUT_SCOPED_MODULE = "nemo_rl.environments.agents.rollout_scoped"
ROLLOUT_SCOPED_MODULE_ENV = "NRL_ROLLOUT_SCOPED_MODULE"
# Agents this package ships; every other `env.agent` is a Gym agent package launched by name.
OUR_AGENT_MODULES = {"compacting_agent": COMPACTING_AGENT_MODULE}
GYM_AGENTS_PACKAGE = "responses_api_agents"
PARENT_WATCH_MODULE = "nemo_rl.environments.parent_watch"
CONFIG_DICT_ENV = "NEMO_GYM_CONFIG_DICT"
CONFIG_PATH_ENV = "NEMO_GYM_CONFIG_PATH"
_GYM_ENV_PREFIX = "NEMO_GYM_"


@dataclass(frozen=True)
class ResourcesServer:
    """The resources server of one run and the agent wired to it (names as Gym's global config keys)."""

    name: str  # top-level key of the resources server instance
    package: str  # key under `resources_servers`
    module: str  # launched as `python -m <module>`
    block: Mapping[str, Any]  # its config keys besides host/port (entrypoint, domain, server keys)
    agent_name: str  # top-level key of the agent instance
    agent_block: Mapping[str, Any] = field(default_factory=dict)  # extra agent keys (no wiring)


@dataclass(frozen=True)
class ServerPorts:
    gate: int
    resources: int
    agent: int

    def __post_init__(self) -> None:
        ports = (self.gate, self.resources, self.agent)
        if any(not (0 < p < 65536) for p in ports) or len(set(ports)) != 3:
            raise ValueError(f"ServerPorts needs three distinct ports in 1..65535, got {ports}")


@dataclass(frozen=True)
class CaptureWiring:
    """Where the gate keeps its ledger and which variable holds the control bearer."""

    ledger_dir: Path
    control_token_env: str

    def __post_init__(self) -> None:
        if not self.ledger_dir.is_absolute():
            raise ValueError(f"CaptureWiring.ledger_dir must be absolute (Gym rejects relative), got {self.ledger_dir}")
        if not self.control_token_env:
            raise ValueError("CaptureWiring.control_token_env must name an environment variable")


@dataclass(frozen=True)
class ServerSpec:
    name: str
    module: str
    port: int


def check_worker_base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(
            f"worker_base_url={url!r} is not an http URL with host and port; "
            "pass the worker's OpenAI root, e.g. http://127.0.0.1:<port>/v1"
        )
    return url


def gate_base_url(urls: str | Sequence[str]) -> str | list[str]:
    """The gate's `base_url`: one worker as a string (unchanged config), several as a list.

    Gym's `vllm_model` spreads sessions over a list of base URLs; any worker can continue any
    rollout on the capture path because parents' ids come from TransferQueue, not from memory.
    """
    if isinstance(urls, str):
        return check_worker_base_url(urls)
    checked = [check_worker_base_url(url) for url in urls]
    if not checked or len(set(checked)) != len(checked):
        raise ValueError(f"worker base URLs must be a non-empty list of distinct URLs, got {list(urls)}")
    return checked[0] if len(checked) == 1 else checked


def capture_block(wiring: CaptureWiring) -> dict[str, Any]:
    """The gate's `token_id_capture` block (contract note section 1)."""
    return {
        "enabled": True,
        "external_staging": True,
        "external_staging_backend": "vllm_worker",
        "rebuild_response": False,
        "dir": str(wiring.ledger_dir),
        "control_auth_token_env": wiring.control_token_env,
    }


def build_global_config(
    cfg: NemoGymConfig,
    *,
    worker_base_url: str | Sequence[str],
    ports: ServerPorts,
    capture: CaptureWiring | None,
    resources_server: ResourcesServer,
    gate_guard: GateGuardConfig = GateGuardConfig(),
) -> dict[str, Any]:
    """The resolved Gym global config shared by all three servers."""
    gate = {
        "entrypoint": "app.py",
        "host": LOOPBACK,
        "port": ports.gate,
        "base_url": gate_base_url(worker_base_url),
        "api_key": cfg.worker_api_key,
        "model": cfg.model_name,
        "return_token_id_information": capture is None,
        "uses_reasoning_parser": False,
    }
    rs = resources_server
    resources = {**rs.block, "host": LOOPBACK, "port": ports.resources}
    agent: dict[str, Any] = {
        "entrypoint": "app.py",
        **rs.agent_block,
        "host": LOOPBACK,
        "port": ports.agent,
        "resources_server": {"type": "resources_servers", "name": rs.name},
        "model_server": {"type": "responses_api_models", "name": GATE},
        "max_steps": cfg.agent_max_steps,
    }
    config: dict[str, Any] = {
        "head_server": {"host": LOOPBACK, "port": 0},
        "dry_run": False,
        GATE: {"responses_api_models": {"vllm_model": gate}},
        rs.name: {"resources_servers": {rs.package: resources}},
        rs.agent_name: {"responses_api_agents": {agent_package(cfg.agent): agent}},
    }
    if cfg.agent == "compacting_agent":
        agent["compact_after_tool_results"] = cfg.compact_after_tool_results
    if capture is not None:
        agent["token_id_capture"] = True
        config["token_id_capture"] = capture_block(capture)
        config[GATE_GUARD_KEY] = gate_guard.model_dump()
    _reject_interpolation(config, "")
    return config


def _reject_interpolation(node: Any, where: str) -> None:
    # Gym resolves the config with OmegaConf, which would read `${...}` in a path or URL as a reference.
    if isinstance(node, dict):
        for key, value in node.items():
            _reject_interpolation(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, str) and "${" in node:
        raise ValueError(f"Gym config value {where}={node!r} contains '${{', which OmegaConf would interpolate; rename it")


def gate_module(capture: CaptureWiring | None) -> str:
    """Our capture gate (Gym's gate plus our ledger policy) with capture wiring, Gym's own gate without."""
    return CAPTURE_GATE_MODULE if capture is not None else GATE_MODULE


def server_specs(
    ports: ServerPorts,
    capture: CaptureWiring | None = None,
    agent: str = "simple_agent",
    *,
    resources_server: ResourcesServer,
) -> tuple[ServerSpec, ...]:
    return (
        ServerSpec(GATE, gate_module(capture), ports.gate),
        ServerSpec(resources_server.name, resources_server.module, ports.resources),
        ServerSpec(resources_server.agent_name, agent_module(agent), ports.agent),
    )


def agent_package(agent: str) -> str:
    """The Gym package of `env.agent` (`langgraph_agent/reflection_agent` -> `langgraph_agent`)."""
    return agent.partition("/")[0]


def agent_module(agent: str) -> str:
    """The module `env.agent` launches: ours by name, else Gym's `responses_api_agents.<agent>.app`."""
    return OUR_AGENT_MODULES.get(agent, f"{GYM_AGENTS_PACKAGE}.{agent}.app")


def server_command(python: str, spec: ServerSpec, launcher_pid: int | None = None) -> list[str]:
    """`python -m <module>` (or an instrumentation hook's runner around it when a benchmark opts in),
    wrapped by `parent_watch` so the server dies with `launcher_pid`."""
    argv = instrumentation.server_module_argv(spec.module)  # opt-in byte counting (benchmarks/capture_ab.py)
    if launcher_pid is None:
        return [python, "-m", *argv]
    return [python, "-m", PARENT_WATCH_MODULE, str(launcher_pid), *argv]


def server_env(
    base_env: Mapping[str, str],
    *,
    config_json: str,
    spec: ServerSpec,
    import_root: Path,
    extra: Mapping[str, str],
) -> dict[str, str]:
    """The child's environment: ours minus `NEMO_GYM_*`, plus Gym's config and `extra`."""
    env = {k: v for k, v in base_env.items() if not k.startswith(_GYM_ENV_PREFIX)}
    inherited_path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(import_root) + (os.pathsep + inherited_path if inherited_path else "")
    env["PYTHONUNBUFFERED"] = "1"
    env[CONFIG_DICT_ENV] = config_json
    env[CONFIG_PATH_ENV] = spec.name
    env.update(extra)
    return env


def pick_free_ports(count: int) -> list[int]:
    """`count` distinct ports the OS picked on the loopback (held open together while picking)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def read_log_tail(path: Path, lines: int) -> str:
    if not path.exists():
        return f"<no log file at {path}>"
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 64 * 1024))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def start_server(
    spec: ServerSpec, *, python: str, env: Mapping[str, str], cwd: Path, log_path: Path
) -> subprocess.Popen:
    """Start one server in its own session, stdout and stderr appended to `log_path` (after a line
    naming the interpreter and module it runs)."""
    command = server_command(python, spec, os.getpid())
    with log_path.open("ab") as log:
        log.write(f"[nemo_rl] starting {spec.name}: {python} -m {spec.module}\n".encode())
        log.flush()
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # Only while the leader is unreaped: its pid (== our session's group id) cannot be reused.
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def terminate_processes(procs: Mapping[str, subprocess.Popen], timeout_s: float) -> dict[str, int]:
    """SIGTERM every process group, SIGKILL what is left after `timeout_s`; returns exit codes."""
    for proc in procs.values():
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
    return {name: proc.returncode for name, proc in procs.items()}
