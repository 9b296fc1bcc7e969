"""The Gym client on the rollout path: the `/run` bodies, `/run`, the manifest, the ledger files.

`PromptSource.batch(step, n)` gives step `step`'s agent `/run` bodies, deterministic in
(seed, step), each a fresh deep copy carrying the recipe's `RowSampling` (`PromptDataset` walks
its rows in seeded epochs, every row once before any repeats; `TaskPromptSource` draws from a
`GymTask`). `NemoGymEnvironment` runs rollouts: `run` (POST the agent's `/run`), `manifest` (GET
the gate's ledger manifest), `retire` (delete committed rollouts' ledger files); it holds the
servers' lifecycle (`servers`, a `gym_lifecycle.GymServers`) and lends it its one aiohttp
session (`GymHttpClient`). Promises: every request has a deadline and fails with a named error.
Invariants: the dataloader position is the step (resume is exact); with capture on each attempt
needs a fresh rollout id (Gym appends to a ledger). Set-up (reading and checking datasets) is
`datasets`. See docs/design-docs/gym-environment.md, "`NemoGymEnvironment`".
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from pydantic import ValidationError

from nemo_gym.token_id_capture.staging.records import RolloutManifest
from nemo_rl.data import calls
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gym_lifecycle import GymServers
from nemo_rl.environments.nemo_gym_config import (
    GymRunError,
    GymRunTimeoutError,
    ManifestError,
    NemoGymConfig,
    NemoGymError,
)
from nemo_rl.environments.task import GymTask, RowSampling
from nemo_rl.token_capture.config import TokenCaptureConfig

__all__ = [
    "GymHttpClient",
    "NemoGymEnvironment",
    "PromptDataset",
    "PromptSource",
    "TaskPromptSource",
    "apply_sampling",
    "check_rollout_id",
    "ledger_files",
    "manifest_path",
]

PARAMS_FIELD = "responses_create_params"
TASK_STEP_STRIDE = 100_003
_EPOCH_STRIDE = 1_000_003
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
    """The one rollout-id rule (`nemo_rl.data.calls`) at its ceiling, as a named error."""
    try:
        return calls.check_rollout_id(rollout_id, calls.MAX_ROLLOUT_ID_CHARS)
    except calls.RolloutIdError as e:
        raise NemoGymError(
            f"rollout_id={rollout_id!r} is not usable by Gym's capture paths and ledger files ({e.problem}); "
            "use only ASCII letters, digits, '.', '_' and '-', starting with a letter or digit, at most "
            f"{calls.MAX_ROLLOUT_ID_CHARS} characters",
            kind="invalid_rollout_id",
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


# --- the /run bodies of a step ------------------------------------------------------------
class PromptSource(Protocol):
    def batch(self, step: int, n: int) -> list[dict[str, Any]]: ...


def _check_step(step: int, n: int) -> None:
    if step < 1 or n < 1:
        raise ValueError(f"batch(step={step}, n={n}): step is 1-based and n must be >= 1")


def apply_sampling(row: Mapping[str, Any], sampling: RowSampling) -> dict[str, Any]:
    """A deep copy of `row` whose `responses_create_params` carries the recipe's sampling."""
    out = copy.deepcopy(dict(row))
    out[PARAMS_FIELD] = {
        **out[PARAMS_FIELD],
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_output_tokens": sampling.max_output_tokens,
    }
    return out


class PromptDataset:
    """Rows walked epoch by epoch (see the module docstring; `datasets.load_jsonl` reads a file)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], seed: int, sampling: RowSampling, source: str = "<rows>") -> None:
        if not rows:
            raise NemoGymError(f"{source}: the dataset has no rows", kind="dataset")
        self._rows = tuple(copy.deepcopy(dict(r)) for r in rows)
        self._seed = seed
        self._sampling = sampling
        self.source = source
        self._orders: dict[int, list[int]] = {}

    def with_rows(self, rows: Sequence[Mapping[str, Any]]) -> "PromptDataset":
        """The same seed, sampling and source over other rows (e.g. after a length filter)."""
        return PromptDataset(rows, self._seed, self._sampling, self.source)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> tuple[dict[str, Any], ...]:
        return self._rows

    def epoch_order(self, epoch: int) -> list[int]:
        """The row order of one epoch (a permutation of all row indices)."""
        if epoch not in self._orders:
            order = list(range(len(self._rows)))
            random.Random(self._seed * _EPOCH_STRIDE + epoch).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def batch(self, step: int, n: int) -> list[dict[str, Any]]:
        _check_step(step, n)
        size = len(self._rows)
        picks = [self.epoch_order(pos // size)[pos % size] for pos in range((step - 1) * n, step * n)]
        return [apply_sampling(self._rows[i], self._sampling) for i in picks]


class TaskPromptSource:
    """A `GymTask`'s rows, drawn afresh every step."""

    def __init__(self, task: GymTask, seed: int, sampling: RowSampling) -> None:
        self._task = task
        self._seed = seed
        self._sampling = sampling

    def batch(self, step: int, n: int) -> list[dict[str, Any]]:
        _check_step(step, n)
        # Deep copies: the rows are the callers' to mutate, whatever the task shares between calls.
        return copy.deepcopy(self._task.rows(self._seed * TASK_STEP_STRIDE + step, n, self._sampling))


# --- rollouts ------------------------------------------------------------------------------
class NemoGymEnvironment:
    """Rollouts through Gym's agent and gate; `servers` runs them (see module doc)."""

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
        self._reward_key = config.gym.reward_key if config.gym is not None else REWARD_FIELD
        self._http = GymHttpClient()
        # The servers' health polls use this environment's one session (whichever client is current).
        self.servers = GymServers(
            config, token_capture, worker_base_url=worker_base_url, log_dir=log_dir, session=lambda: self._http.session()
        )

    @property
    def capture(self) -> bool:
        return self._capture_cfg.enabled

    @property
    def ledger_dir(self) -> Path:
        return self.servers.ledger_dir

    async def start(self) -> None:
        """Start the servers (`GymServers.start`), with a fresh HTTP client after a stop."""
        self.servers.check_stopped()  # before touching the client a running environment uses
        if self._http.closed:
            self._http = GymHttpClient()
        try:
            await self.servers.start()
        except BaseException:
            await self._http.aclose()
            raise

    def stop(self) -> dict[str, int]:
        """Close the HTTP client (`GymHttpClient.close_soon`) and stop the servers (sync callers).

        Blocks up to about `stop_timeout_s` per server: from a coroutine, `await aclose()`."""
        self._http.close_soon()
        return self.servers.stop()

    async def aclose(self) -> dict[str, int]:
        """`stop()` from a coroutine: the session closes on this loop, the servers' teardown on a thread."""
        await self._http.aclose()
        return await self.servers.aclose()

    async def __aenter__(self) -> "NemoGymEnvironment":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def run(self, rollout_id: str | None, row: Mapping[str, Any]) -> dict[str, Any]:
        """One rollout through the agent's /run; returns Gym's verify result."""
        if ROLLOUT_ID_FIELD in row:
            raise NemoGymError(
                f"row already carries {ROLLOUT_ID_FIELD}={row[ROLLOUT_ID_FIELD]!r}; pass the id as run(rollout_id, row)",
                kind="invalid_rollout_id",
            )
        body = dict(row)
        if self.capture:
            if rollout_id is None:
                raise NemoGymError(
                    "token capture is on: run() needs a fresh rollout_id per attempt (Gym appends to a reused ledger)",
                    kind="invalid_rollout_id",
                )
            body[ROLLOUT_ID_FIELD] = check_rollout_id(rollout_id)
        agent, agent_url = self.servers.resources_server.agent_name, self.servers.agent_url
        status, text = await self._http.request(
            "POST",
            f"{agent_url}/run",
            self._cfg.run_timeout_s,
            on_timeout=lambda: GymRunTimeoutError(
                f"rollout {rollout_id!r}: agent /run did not answer within run_timeout_s={self._cfg.run_timeout_s}; "
                f"{self.servers.state(agent)}"
            ),
            on_client_error=lambda e: GymRunError(
                f"rollout {rollout_id!r}: agent /run at {agent_url} failed: {e!r}; {self.servers.state(agent)}"
            ),
            json_body=body,
        )
        if status != 200:
            logs = self.servers.log_paths
            raise GymRunError(
                f"rollout {rollout_id!r}: agent /run answered HTTP {status}: {_quote(text)} "
                f"(gate log {logs[launch.GATE]}, agent log {logs[agent]})"
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
        url = f"{self.servers.gate_url}{manifest_path(rollout_id)}"
        timeout_s = self._capture_cfg.manifest_timeout_s
        status, text = await self._http.request(
            "GET",
            url,
            timeout_s,
            on_timeout=lambda: ManifestError(
                f"rollout {rollout_id!r}: manifest not answered within token_capture.manifest_timeout_s={timeout_s}; "
                f"{self.servers.state(launch.GATE)}",
                kind="timeout",
            ),
            on_client_error=lambda e: ManifestError(
                f"rollout {rollout_id!r}: manifest GET {url} failed: {e!r}; {self.servers.state(launch.GATE)}",
                kind="server",
            ),
            headers={"Authorization": f"Bearer {self.servers.bearer}"},
        )
        if status in (401, 403):
            raise ManifestError(
                f"rollout {rollout_id!r}: the gate rejected the control bearer (HTTP 401: {_quote(text)}); the gate "
                f"reads it from ${self._capture_cfg.control_token_env}, set per run by this environment",
                kind="auth",
            )
        if status == 400:
            raise ManifestError(
                f"rollout {rollout_id!r}: the gate rejected the request (HTTP 400: {_quote(text)})", kind="request"
            )
        if status != 200:
            raise ManifestError(f"rollout {rollout_id!r}: manifest answered HTTP {status}: {_quote(text)}", kind="server")
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
        raise ManifestError(
            f"rollout {rollout_id!r}: the gate's manifest is not a valid RolloutManifest ({e}); body: {_quote(text)}",
            kind="server",
        ) from e
    # A manifest naming another rollout is returned as is: the judge alone decides its verdict.
    return manifest
