"""The NeMo-Gym environment: start Gym's servers on loopback and dispatch rollouts to them.

Owns `NemoGymEnvironment`: resolves the resources server (a Gym environment or a task) before
anything is launched; `start()` runs the gate, the resources server and the agent as
subprocesses on 127.0.0.1 with OS-picked ports; `run`, `manifest`, `retire`, `probes`,
`restart`, `aclose` (`stop` for sync callers). Capture mode follows `TokenCaptureConfig.enabled`
(on: external staging, a per-run bearer for the gate's control routes, a ledger dir; off: Gym's
legacy token echo). Promises: every call is bounded and fails with a named error; all requests
share one aiohttp session (`GymHttpClient`); teardown stops only the processes it started,
idempotently, and `aclose()` never blocks the event loop.
Invariant: with capture on each attempt needs a fresh rollout id (Gym appends to a ledger).
See docs/design-docs/gym-environment.md, "`NemoGymEnvironment`".
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
from typing import Any

import aiohttp
from pydantic import ValidationError

from nemo_gym.token_id_capture.staging.records import RolloutManifest
from nemo_rl.data import request_rules
from nemo_rl.distributed.component_watch import Probe, Role, process_probe
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gym_servers import check_agent, resolve_gym_environment
from nemo_rl.environments.nemo_gym_config import (
    GymRunError,
    GymRunTimeoutError,
    GymServerStartError,
    InvalidRolloutIdError,
    ManifestAuthError,
    ManifestRequestError,
    ManifestServerError,
    ManifestTimeoutError,
    NemoGymConfig,
    NemoGymError,
)
from nemo_rl.utils import venvs
from nemo_rl.environments.task import RowSampling, load_task
from nemo_rl.token_capture.config import TokenCaptureConfig

__all__ = [
    "NemoGymConfig",
    "NemoGymEnvironment",
    "NemoGymError",
    "RowSampling",
    "check_rollout_id",
    "ledger_files",
    "manifest_path",
]

ROLLOUT_ID_FIELD = "_ng_rollout_id"
REWARD_FIELD = "reward"
VERIFIER_REWARD_FIELD = "verifier_reward"
# Gym's control route (nemo_gym.token_id_capture.control_routes.CONTROL_ROUTE_PREFIX); importing
# that module pulls in FastAPI, so the path is spelled here and pinned by a unit test.
_MANIFEST_ROUTE = "/training-token-capture/control/rollouts/{rollout_id}/manifest"
# Per-rollout files Gym's FileLineageStore / TokenCaptureStore may create in the ledger dir.
_LEDGER_SUFFIXES = (
    ".lineage.jsonl",
    ".tokens.intents",
    ".tokens.lock",
    ".tokens.jsonl",
    ".tokens.incomplete",
    ".tokens.state.json",
)
_BODY_QUOTE_CHARS = 2000
# Idle pooled connections are dropped after this; below the 30 s keep-alive Gym's uvicorn servers
# keep (nemo_gym.server_utils), so the client never reuses a connection the server is closing.
_KEEPALIVE_S = 15.0


def check_rollout_id(rollout_id: str) -> str:
    """The one rollout-id rule (`nemo_rl.data.request_rules`) at its ceiling, as a named error."""
    try:
        return request_rules.check_rollout_id(rollout_id, request_rules.MAX_ROLLOUT_ID_CHARS)
    except request_rules.RolloutIdError as e:
        raise InvalidRolloutIdError(
            f"rollout_id={rollout_id!r} is not usable by Gym's capture paths and ledger files ({e.problem}); "
            "use only ASCII letters, digits, '.', '_' and '-', starting with a letter or digit, at most "
            f"{request_rules.MAX_ROLLOUT_ID_CHARS} characters"
        ) from e


def manifest_path(rollout_id: str) -> str:
    return _MANIFEST_ROUTE.format(rollout_id=check_rollout_id(rollout_id))


def ledger_files(ledger_dir: Path, rollout_id: str) -> list[Path]:
    rid = check_rollout_id(rollout_id)
    return [ledger_dir / f"{rid}{suffix}" for suffix in _LEDGER_SUFFIXES]


def apply_reward_key(result: Mapping[str, Any], reward_key: str) -> dict[str, Any]:
    """The verify result with `reward` taken from `reward_key` (see the module docstring)."""
    out = dict(result)
    if reward_key == REWARD_FIELD:
        return out
    if REWARD_FIELD in out:
        out[VERIFIER_REWARD_FIELD] = out.pop(REWARD_FIELD)
    if reward_key in out:
        out[REWARD_FIELD] = out[reward_key]
    return out


def _quote(text: str) -> str:
    return text if len(text) <= _BODY_QUOTE_CHARS else text[:_BODY_QUOTE_CHARS] + "...<cut>"


class NemoGymEnvironment:
    """Gym's gate, the resources server and the agent for one run (see module doc)."""

    def __init__(
        self,
        config: NemoGymConfig,
        token_capture: TokenCaptureConfig,
        *,
        worker_base_url: str | Sequence[str],
        log_dir: Path,
    ) -> None:
        self._cfg = config
        self._capture_cfg = token_capture
        self._worker_base_url = launch.gate_base_url(worker_base_url)
        self._log_dir = Path(log_dir).resolve()
        self._agent = check_agent(config.agent)
        resources = (
            resolve_gym_environment(config.gym, config.agent)
            if config.gym is not None
            else load_task(config.task).resources_server
        )
        # A flavour's own keys (its entrypoint, ...) under the environment's agent keys and overrides.
        self._resources = replace(resources, agent_block={**self._agent.block, **resources.agent_block})
        self._pythons: dict[str, str] = {}
        self._reward_key = config.gym.reward_key if config.gym is not None else REWARD_FIELD
        self._procs: dict[str, subprocess.Popen] = {}
        self._specs: dict[str, launch.ServerSpec] = {}
        self._envs: dict[str, dict[str, str]] = {}
        self._log_paths: dict[str, Path] = {}
        self._ports: launch.ServerPorts | None = None
        self._bearer: str | None = None
        self._http = GymHttpClient()
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
    async def start(self) -> None:
        if self._procs:
            raise NemoGymError("NemoGymEnvironment.start() called twice; stop() it first", kind="call_order")
        if self._http.closed:  # started again after a stop: a fresh client for this run of the servers
            self._http = GymHttpClient()
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
            async with self._http.session().get(
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

        Blocks up to about `stop_timeout_s` per server: from a coroutine, `await aclose()`. The
        HTTP client's session is closed on its own loop (`GymHttpClient.close_soon`)."""
        atexit.unregister(self.stop)
        self._http.close_soon()
        codes = launch.terminate_processes(self._procs, self._cfg.stop_timeout_s)
        self._procs = {}
        self._ports = None
        self._bearer = None
        return codes

    async def aclose(self) -> dict[str, int]:
        """`stop()` from a coroutine: the HTTP session closes on this loop, and the servers' teardown
        (SIGTERM, then SIGKILL after `stop_timeout_s`: bounded by `terminate_processes`) runs on a
        worker thread, so the loop keeps serving meanwhile."""
        await self._http.aclose()
        return await asyncio.to_thread(self.stop)

    async def __aenter__(self) -> "NemoGymEnvironment":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _server_state(self, name: str) -> str:
        proc = self._procs.get(name)
        if proc is None:
            return f"`{name}` is not running"
        code = proc.poll()
        if code is None:
            return f"`{name}` is alive (log {self._log_paths[name]})"
        tail = launch.read_log_tail(self._log_paths[name], self._cfg.log_tail_lines)
        return f"`{name}` exited with code {code}; its log ends with:\n{tail}"

    # --- rollouts -------------------------------------------------------------------------
    async def run(self, rollout_id: str | None, row: Mapping[str, Any]) -> dict[str, Any]:
        """One rollout through the agent's /run; returns Gym's verify result."""
        if ROLLOUT_ID_FIELD in row:
            raise InvalidRolloutIdError(
                f"row already carries {ROLLOUT_ID_FIELD}={row[ROLLOUT_ID_FIELD]!r}; pass the id as run(rollout_id, row)"
            )
        body = dict(row)
        if self.capture:
            if rollout_id is None:
                raise InvalidRolloutIdError(
                    "token capture is on: run() needs a fresh rollout_id per attempt (Gym appends to a reused ledger)"
                )
            body[ROLLOUT_ID_FIELD] = check_rollout_id(rollout_id)
        agent_url = self.agent_url
        status, text = await self._http.request(
            "POST",
            f"{agent_url}/run",
            self._cfg.run_timeout_s,
            on_timeout=lambda: GymRunTimeoutError(
                f"rollout {rollout_id!r}: agent /run did not answer within run_timeout_s={self._cfg.run_timeout_s}; "
                f"{self._server_state(self._resources.agent_name)}"
            ),
            on_client_error=lambda e: GymRunError(
                f"rollout {rollout_id!r}: agent /run at {agent_url} failed: {e!r}; {self._server_state(self._resources.agent_name)}"
            ),
            json_body=body,
        )
        if status != 200:
            raise GymRunError(
                f"rollout {rollout_id!r}: agent /run answered HTTP {status}: {_quote(text)} "
                f"(gate log {self._log_paths[launch.GATE]}, agent log {self._log_paths[self._resources.agent_name]})"
            )
        try:
            result = json.loads(text)
        except json.JSONDecodeError as e:
            raise GymRunError(f"rollout {rollout_id!r}: agent /run answered non-JSON: {_quote(text)}") from e
        if not isinstance(result, dict):
            raise GymRunError(f"rollout {rollout_id!r}: agent /run answered a {type(result).__name__}, not an object")
        return apply_reward_key(result, self._reward_key)

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The gate's ledger manifest for one rollout (empty if the gate never saw it)."""
        if not self.capture:
            raise NemoGymError(
                "manifest() needs token_capture.enabled=true; the legacy gate keeps no ledger",
                kind="capture_mode",
            )
        url = f"{self.gate_url}{manifest_path(rollout_id)}"
        timeout_s = self._capture_cfg.manifest_timeout_s
        status, text = await self._http.request(
            "GET",
            url,
            timeout_s,
            on_timeout=lambda: ManifestTimeoutError(
                f"rollout {rollout_id!r}: manifest not answered within token_capture.manifest_timeout_s={timeout_s}; "
                f"{self._server_state(launch.GATE)}"
            ),
            on_client_error=lambda e: ManifestServerError(
                f"rollout {rollout_id!r}: manifest GET {url} failed: {e!r}; {self._server_state(launch.GATE)}"
            ),
            headers={"Authorization": f"Bearer {self._bearer}"},
        )
        if status in (401, 403):
            raise ManifestAuthError(
                f"rollout {rollout_id!r}: the gate rejected the control bearer (HTTP 401: {_quote(text)}); the gate "
                f"reads it from ${self._capture_cfg.control_token_env}, set per run by this environment"
            )
        if status == 400:
            raise ManifestRequestError(f"rollout {rollout_id!r}: the gate rejected the request (HTTP 400: {_quote(text)})")
        if status != 200:
            raise ManifestServerError(f"rollout {rollout_id!r}: manifest answered HTTP {status}: {_quote(text)}")
        return _parse_manifest(rollout_id, text)

    def ledger_file_count(self) -> int:
        """Ledger files in the ledger dir now (0 once every rollout was retired)."""
        ledger_dir = self.ledger_dir
        return sum(1 for path in ledger_dir.iterdir() if path.is_file()) if ledger_dir.exists() else 0

    def retire(self, rollout_ids: Iterable[str]) -> list[Path]:
        """Delete the ledger files of committed rollouts; returns the paths removed."""
        ledger_dir = self.ledger_dir
        removed: list[Path] = []
        for rollout_id in rollout_ids:
            for path in ledger_files(ledger_dir, rollout_id):
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                removed.append(path)
        return removed


class GymHttpClient:
    """One aiohttp session (one connection pool) for every request of one Gym environment.

    The session is made lazily, in the running loop, on first use, and belongs to that loop: a
    request from another loop raises a `NemoGymError` of kind `client_loop`. `aclose()` (in that
    loop) or `close_soon()` (sync) ends it for good; a request afterwards raises one of kind
    `client_closed`.
    Every request carries its own deadline (`aiohttp.ClientTimeout(total=timeout_s)`).
    """

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._closing: set[asyncio.Task] = set()  # close tasks scheduled by close_soon (kept alive)

    @property
    def closed(self) -> bool:
        return self._closed

    def session(self) -> aiohttp.ClientSession:
        """The session, made on first use in the running loop (call from a coroutine)."""
        if self._closed:
            raise NemoGymError(
                "the Gym environment's HTTP client is closed (aclose() or stop() ran); start() the environment again",
                kind="client_closed",
            )
        loop = asyncio.get_running_loop()
        if self._session is None:
            # limit=0: no cap on open connections. Every rollout in flight holds one for its whole
            # /run, so aiohttp's default limit of 100 would silently queue rollouts beyond the 100th.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
            self._loop = loop
        elif loop is not self._loop:
            raise NemoGymError(
                "the Gym environment's HTTP client belongs to the event loop that made its first request; "
                "use the environment from that loop only (or aclose() it there and start() it again here)",
                kind="client_loop",
            )
        return self._session

    async def request(
        self,
        method: str,
        url: str,
        timeout_s: float,
        *,
        on_timeout: Callable[[], Exception],
        on_client_error: Callable[[aiohttp.ClientError], Exception],
        json_body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, str]:
        """(status, body text) of one request bounded by timeout_s; transport failures raise the caller's errors."""
        session = self.session()
        try:
            async with session.request(
                method, url, json=json_body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status, await resp.text()
        except asyncio.TimeoutError as e:
            raise on_timeout() from e
        except aiohttp.ClientError as e:
            raise on_client_error(e) from e

    async def aclose(self) -> None:
        """Close the session (idempotent); from its own loop it is awaited, from any other, `close_soon`."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._session is not None and running is self._loop:
            self._closed = True
            session, self._session = self._session, None
            await session.close()
        else:
            self.close_soon()

    def close_soon(self) -> None:
        """Close the session from sync code (idempotent), never touching it off its own loop.

        On the loop's own thread the close is a task of that loop (it runs at the loop's next
        step); from another thread it is handed to that loop while it runs; a loop that is not
        running is driven to close it here. A closed loop took its sockets with it: nothing to close.
        """
        self._closed = True
        session, loop, self._session = self._session, self._loop, None
        if session is None or session.closed or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task = loop.create_task(session.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(session.close(), loop)
        elif running is None:
            loop.run_until_complete(session.close())
        # else: this thread runs another loop, which must not drive the session's; its loop is
        # stopped but not closed, so the session closes with whoever runs or closes that loop.


def _parse_manifest(rollout_id: str, text: str) -> RolloutManifest:
    try:
        manifest = RolloutManifest.model_validate_json(text)
    except ValidationError as e:
        raise ManifestServerError(
            f"rollout {rollout_id!r}: the gate's manifest is not a valid RolloutManifest ({e}); body: {_quote(text)}"
        ) from e
    # A manifest naming another rollout is returned as is: the judge alone decides its verdict.
    return manifest
