"""The gate process's set-up: its config, and what it reads once (Gym's global config, the worker's context).

`GateGuardConfig` is the gate's input limits (the driver writes it under `nrl_gate_guard`;
`nemo_gym_launch`). `ledger_dir_from_config`, `guard_config_from` and `control_token_from` read
Gym's global config (pure) and raise `CaptureGateConfigError` naming the key and the fix: capture
off, a configured `lineage_store` (it would win over ours), no ledger dir, no guard block, an empty
bearer variable. `WorkerContextLimit` probes the workers' `max_model_len` once (at the guard's first
generating request; a named 502/503 `ApiError` until a worker answers). `run_gate(config, serve)`
installs `BranchingCaptureLedger` over the ledger dir, then serves (`python -m
nemo_rl.environments.gate.app` runs it with Gym's config and `CaptureGateModel.run_webserver`).
Docs: token-capture-receipts.md, "More of the gate".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym.token_id_capture.config import token_id_capture_config
from nemo_gym.token_id_capture.protocols import install_lineage_store
from nemo_rl.data.errors import ApiError, FatalError, error_name
from nemo_rl.data.calls import DEFAULT_MAX_ROLLOUT_ID_CHARS, MAX_ROLLOUT_ID_CHARS, show
from nemo_rl.environments.gate.ledger import BranchingCaptureLedger

GATE_GUARD_KEY = "nrl_gate_guard"  # top-level key of Gym's global config that carries GateGuardConfig


class CaptureGateConfigError(FatalError, ValueError):
    """The global config cannot run our capture gate."""


class GateGuardConfig(BaseModel):
    """Limits of the gate's input validation (the only home of their defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_body_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description="Largest request body the gate reads on a generating route; larger is 413 before forwarding.",
    )
    max_rollout_id_chars: int = Field(
        default=DEFAULT_MAX_ROLLOUT_ID_CHARS,
        ge=1,
        le=MAX_ROLLOUT_ID_CHARS,
        description="Longest rollout id the gate accepts (ids become ledger file names; 200 keeps them under 255 bytes).",
    )
    context_probe_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Deadline of one GET <worker>/v1/models that reads the worker's max_model_len.",
    )
    stream_read_timeout_s: float = Field(
        default=600.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Deadline to connect to the worker and between two reads of a streamed (stream=true) reply.",
    )


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


def guard_config_from(global_config: Any) -> GateGuardConfig:
    """The gate's `GateGuardConfig` from the global config's `nrl_gate_guard` block (pure)."""
    block = global_config.get(GATE_GUARD_KEY) if isinstance(global_config, Mapping) else None
    if block is None:
        raise CaptureGateConfigError(
            f"the global config has no {GATE_GUARD_KEY!r} block (nemo_gym_launch.build_global_config writes it)"
        )
    try:
        return GateGuardConfig.model_validate(block)
    except ValidationError as e:
        raise CaptureGateConfigError(f"{GATE_GUARD_KEY} is invalid: {e}") from e


def control_token_from(global_config: Any, environ: Mapping[str, str]) -> str:
    """The control bearer, read from the variable the capture block names (never from the config)."""
    name = token_id_capture_config(global_config).token_id_capture.control_auth_token_env
    token = environ.get(name)
    if not token:
        raise CaptureGateConfigError(f"the control bearer variable ${name} is empty or unset in the gate's environment")
    return token


class WorkerContextLimit:
    """The workers' `max_model_len`, read once from `GET <base_url>/models` (first worker that answers)."""

    def __init__(self, base_urls: Sequence[str], timeout_s: float) -> None:
        self._base_urls = [url.rstrip("/") for url in base_urls]
        self._timeout_s = timeout_s
        self._value: int | None = None
        self._lock = asyncio.Lock()

    async def __call__(self) -> int:
        if self._value is not None:
            return self._value
        async with self._lock:
            if self._value is None:
                self._value = await self._probe()
        return self._value

    async def _probe(self) -> int:
        reasons = []
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for url in self._base_urls:
                try:
                    async with session.get(f"{url}/models") as resp:
                        if resp.status != 200:
                            text = (await resp.text())[:300]
                            reasons.append(f"{url}/models answered HTTP {resp.status}: {text}")
                            continue
                        payload = await resp.json()
                except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
                    reasons.append(f"{url}/models: {error_name(e)}: {e}")
                    continue
                value = (payload.get("data") or [{}])[0].get("max_model_len") if isinstance(payload, dict) else None
                if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                    raise ApiError(
                        "upstream_error", f"{url}/models names no usable max_model_len (got {show(value)})", None
                    )
                return value
        raise ApiError(
            "upstream_unavailable",
            f"no vLLM worker answered its model list within {self._timeout_s:g} s ({'; '.join(reasons)}); the workers "
            "are still starting or are down",
            None,
        )


def plain_config(config: Any) -> Any:
    """Gym's global config (an OmegaConf `DictConfig`) as plain, resolved containers."""
    return OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config


def run_gate(global_config: Any, serve: Callable[[], object]) -> None:
    """Install our ledger over the ledger dir Gym's `global_config` names, then `serve()` (Gym's `run_webserver`)."""
    ledger_dir = ledger_dir_from_config(plain_config(global_config))
    install_lineage_store(BranchingCaptureLedger(ledger_dir))
    serve()
