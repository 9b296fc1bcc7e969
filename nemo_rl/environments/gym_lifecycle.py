"""The Gym servers' lifecycle: start, health waits, restart and stop (off the rollout path).

Owns `GymServers`: resolves the resources server (a Gym environment or a task) before anything
is launched; `start()` runs the gate, the resources server and the agent as subprocesses on
127.0.0.1 with OS-picked ports and waits until each answers `/health`; `probes`, `pids`,
`restart` (a dead server, same port and environment), `stop` / `aclose`, the servers' URLs, log
paths and state. With capture on it makes the ledger dir and mints the per-run bearer that only
the gate receives. Promises: every wait is bounded and fails with a named error quoting the
server's log; teardown stops only the processes it started, idempotently.
The rollout client (`gym_client.NemoGymEnvironment`) holds one and lends it its HTTP session.
See docs/design-docs/gym-environment.md, "`GymServers`".
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import aiohttp

from nemo_rl.distributed.component_watch import Probe, Role, process_probe
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gym_servers import check_agent, resolve_gym_environment
from nemo_rl.environments.nemo_gym_config import GymServerStartError, NemoGymConfig, NemoGymError
from nemo_rl.environments.task import load_task
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.utils import venvs

__all__ = ["GymServers"]


class GymServers:
    """Gym's gate, the resources server and the agent for one run (see module doc)."""

    def __init__(
        self,
        config: NemoGymConfig,
        token_capture: TokenCaptureConfig,
        *,
        worker_base_url: str | Sequence[str],
        log_dir: Path,
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self._cfg = config
        self._capture_cfg = token_capture
        self._worker_base_url = launch.gate_base_url(worker_base_url)
        self._log_dir = Path(log_dir).resolve()
        self._session = session
        self._agent = check_agent(config.agent)
        resources = (
            resolve_gym_environment(config.gym, config.agent)
            if config.gym is not None
            else load_task(config.task).resources_server
        )
        # A flavour's own keys (its entrypoint, ...) under the environment's agent keys and overrides.
        self._resources = replace(resources, agent_block={**self._agent.block, **resources.agent_block})
        self._pythons: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._specs: dict[str, launch.ServerSpec] = {}
        self._envs: dict[str, dict[str, str]] = {}
        self._log_paths: dict[str, Path] = {}
        self._ports: launch.ServerPorts | None = None
        self._bearer: str | None = None
        self.startup_seconds: float | None = None

    # --- properties -----------------------------------------------------------------------
    @property
    def capture(self) -> bool:
        return self._capture_cfg.enabled

    @property
    def ledger_dir(self) -> Path:
        if not self.capture:
            raise NemoGymError("ledger_dir exists only with token_capture.enabled=true", kind="capture_mode")
        return self._log_dir / "gym_ledger"

    @property
    def resources_server(self) -> launch.ResourcesServer:
        return self._resources

    @property
    def log_paths(self) -> Mapping[str, Path]:
        return dict(self._log_paths)

    @property
    def bearer(self) -> str | None:
        """The gate's control bearer for this run of the servers (None: not started or capture off)."""
        return self._bearer

    def _url(self, port: int) -> str:
        return f"http://{launch.LOOPBACK}:{port}"

    def _require_ports(self) -> launch.ServerPorts:
        if self._ports is None:
            raise NemoGymError(
                "NemoGymEnvironment is not running; await start() first (and not after stop())",
                kind="not_started",
            )
        return self._ports

    @property
    def gate_url(self) -> str:
        return self._url(self._require_ports().gate)

    @property
    def agent_url(self) -> str:
        return self._url(self._require_ports().agent)

    @property
    def resources_url(self) -> str:
        return self._url(self._require_ports().resources)

    # --- lifecycle ------------------------------------------------------------------------
    def check_stopped(self) -> None:
        """Raise a `call_order` `NemoGymError` while the servers run (start() twice)."""
        if self._procs:
            raise NemoGymError("NemoGymEnvironment.start() called twice; stop() it first", kind="call_order")

    async def start(self) -> None:
        self.check_stopped()
        agent_python = await self._agent_python()  # a first build takes minutes: before the start deadline
        began = time.monotonic()
        ports = launch.ServerPorts(*launch.pick_free_ports(3))
        wiring = None
        gate_extra: dict[str, str] = {}
        if self.capture:
            self.ledger_dir.mkdir(parents=True, exist_ok=True)
            wiring = launch.CaptureWiring(self.ledger_dir, self._capture_cfg.control_token_env)
            self._bearer = secrets.token_urlsafe(32)
            gate_extra[wiring.control_token_env] = self._bearer
        config_json = json.dumps(
            launch.build_global_config(
                self._cfg,
                worker_base_url=self._worker_base_url,
                ports=ports,
                capture=wiring,
                resources_server=self._resources,
                gate_guard=self._cfg.gate_guard,
            )
        )
        # The bearer reaches only the gate, and only as minted for this run.
        inherited_env = {k: v for k, v in os.environ.items() if k != self._capture_cfg.control_token_env}
        cwd = self._log_dir / "gym_cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        import_root = Path(__file__).resolve().parents[2]
        self._ports = ports
        # A trainer that exits without stop() must not leave servers behind (they run in their own sessions).
        atexit.register(self.stop)
        try:
            # A flavour's model calls drop the rollout prefix: on the capture path it runs under our
            # runner that carries it (agents.rollout_scoped), with the flavour's module in its env.
            scoped = self._agent.flavour is not None and wiring is not None
            agent_module = launch.ROLLOUT_SCOPED_MODULE if scoped else self._agent.module
            specs = tuple(
                replace(spec, module=agent_module) if spec.name == self._resources.agent_name else spec
                for spec in launch.server_specs(ports, wiring, self._cfg.agent, resources_server=self._resources)
            )
            for spec in specs:
                log_path = self._log_dir / f"gym_{spec.name}.log"
                env = launch.server_env(
                    inherited_env,
                    config_json=config_json,
                    spec=spec,
                    import_root=import_root,
                    extra=gate_extra if spec.name == launch.GATE else {},
                )
                is_agent = spec.name == self._resources.agent_name
                if is_agent and self._agent.import_dir is not None:
                    env["PYTHONPATH"] = str(self._agent.import_dir) + os.pathsep + env["PYTHONPATH"]
                if is_agent and scoped:
                    env[launch.ROLLOUT_SCOPED_MODULE_ENV] = self._agent.module
                self._log_paths[spec.name] = log_path
                self._specs[spec.name] = spec
                self._envs[spec.name] = env
                self._pythons[spec.name] = agent_python if is_agent else sys.executable
                self._procs[spec.name] = launch.start_server(
                    spec, python=self._pythons[spec.name], env=env, cwd=cwd, log_path=log_path
                )
            await self._wait_healthy(specs, began + self._cfg.startup_timeout_s)
        except BaseException:
            await self.aclose()
            raise
        self.startup_seconds = time.monotonic() - began

    async def _agent_python(self) -> str:
        """This interpreter, or the agent's own venv's (built once per spec, with progress output)."""
        agent = self._agent
        if not agent.own_venv:
            return sys.executable
        assert agent.requirements_file is not None  # GymAgent checks it
        spec = venvs.gym_agent_spec(agent.package, agent.requirements_file)
        venv = await asyncio.to_thread(venvs.ensure_venv, spec, builder=venvs.resolving_uv_builder)
        return str(venvs.venv_python(venv))

    async def _wait_healthy(self, specs: Iterable[launch.ServerSpec], deadline: float) -> None:
        pending = {spec.name: spec for spec in specs}
        while pending:
            for name, spec in list(pending.items()):
                code = self._procs[name].poll()
                if code is not None:
                    raise self._start_error(name, f"the process exited with code {code} before becoming healthy")
                if await self._healthy(spec.port, deadline):
                    del pending[name]
            if not pending:
                return
            if time.monotonic() >= deadline:
                name = sorted(pending)[0]
                raise self._start_error(
                    name,
                    f"no healthy answer on {self._url(pending[name].port)}/health within "
                    f"startup_timeout_s={self._cfg.startup_timeout_s}; raise it if the machine is slow",
                )
            await asyncio.sleep(self._cfg.health_poll_interval_s)

    async def _healthy(self, port: int, deadline: float) -> bool:
        budget = max(0.05, min(1.0, deadline - time.monotonic()))
        try:
            async with self._session().get(
                f"{self._url(port)}/health", timeout=aiohttp.ClientTimeout(total=budget)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            # Not listening yet: the caller re-checks the process and the deadline.
            return False

    def _start_error(self, name: str, reason: str) -> GymServerStartError:
        log_path = self._log_paths[name]
        return GymServerStartError(name, reason, log_path, launch.read_log_tail(log_path, self._cfg.log_tail_lines))

    @staticmethod
    def component_name(server: str) -> str:
        return "gate" if server == launch.GATE else server

    def probes(self) -> list[Probe]:
        """A liveness probe per running server (rollout path: every rollout goes through each)."""
        return [
            process_probe(self.component_name(name), Role.ROLLOUT_PATH, proc, f"Gym server {name}")
            for name, proc in self._procs.items()
        ]

    def pids(self) -> dict[str, int]:
        """Pid of every server process by component name."""
        return {self.component_name(name): proc.pid for name, proc in self._procs.items()}

    def server_for(self, component: str) -> str | None:
        """The server name behind a component name of `probes()` (None: not one of ours)."""
        return next((name for name in self._procs if self.component_name(name) == component), None)

    async def restart(self, name: str) -> float:
        """Start server `name` again on its port with its environment; seconds until healthy."""
        proc = self._procs.get(name)
        if proc is None:
            raise NemoGymError(
                f"no server named {name!r} was started (servers: {sorted(self._procs)})",
                kind="not_started",
            )
        if proc.poll() is None:
            raise NemoGymError(
                f"server {name!r} (pid {proc.pid}) is alive; restart() is for a dead server", kind="call_order"
            )
        began = time.monotonic()
        spec = self._specs[name]
        cwd = self._log_dir / "gym_cwd"
        self._procs[name] = launch.start_server(
            spec, python=self._pythons[name], env=self._envs[name], cwd=cwd, log_path=self._log_paths[name]
        )
        await self._wait_healthy([spec], began + self._cfg.startup_timeout_s)
        return time.monotonic() - began

    def stop(self) -> dict[str, int]:
        """Terminate the servers this object started; returns their exit codes (sync callers).

        Blocks up to about `stop_timeout_s` per server: from a coroutine, `await aclose()`."""
        atexit.unregister(self.stop)
        codes = launch.terminate_processes(self._procs, self._cfg.stop_timeout_s)
        self._procs = {}
        self._ports = None
        self._bearer = None
        return codes

    async def aclose(self) -> dict[str, int]:
        """`stop()` from a coroutine: the teardown (SIGTERM, then SIGKILL after `stop_timeout_s`:
        bounded by `terminate_processes`) runs on a worker thread, so the loop keeps serving meanwhile."""
        return await asyncio.to_thread(self.stop)

    def state(self, name: str) -> str:
        """What server `name` is doing now, for an error message (its log's tail if it exited)."""
        proc = self._procs.get(name)
        if proc is None:
            return f"`{name}` is not running"
        code = proc.poll()
        if code is None:
            return f"`{name}` is alive (log {self._log_paths[name]})"
        tail = launch.read_log_tail(self._log_paths[name], self._cfg.log_tail_lines)
        return f"`{name}` exited with code {code}; its log ends with:\n{tail}"
