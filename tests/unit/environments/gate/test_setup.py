"""The gate's set-up: what it reads from Gym's global config, or why it refuses to start (`gate.setup`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.arith.gym_task import RESOURCES_SERVER as ARITH
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gate.setup import (
    CaptureGateConfigError,
    control_token_from,
    guard_config_from,
    ledger_dir_from_config,
)
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from tests.unit.environments.gate.test_guard import BEARER, BEARER_ENV, GUARD


def test_the_gate_reads_its_limits_and_bearer_or_refuses_to_start(tmp_path: Path) -> None:
    wiring = launch.CaptureWiring(tmp_path / "ledger", BEARER_ENV)
    config = launch.build_global_config(NemoGymConfig(), worker_base_url="http://127.0.0.1:9/v1",
                                        ports=launch.ServerPorts(1001, 1002, 1003), capture=wiring, gate_guard=GUARD, resources_server=ARITH)
    assert guard_config_from(config) == GUARD
    assert control_token_from(config, {BEARER_ENV: BEARER}) == BEARER
    with pytest.raises(CaptureGateConfigError, match=rf"the control bearer variable \${BEARER_ENV} is empty or unset"):
        control_token_from(config, {})
    with pytest.raises(CaptureGateConfigError, match="has no 'nrl_gate_guard' block"):
        guard_config_from({k: v for k, v in config.items() if k != "nrl_gate_guard"})
    with pytest.raises(CaptureGateConfigError, match="nrl_gate_guard is invalid"):
        guard_config_from({**config, "nrl_gate_guard": {"max_body_bytes": "big"}})


def test_the_gate_reads_its_ledger_dir_and_refuses_configs_it_cannot_honour(tmp_path: Path) -> None:
    wiring = launch.CaptureWiring(ledger_dir=tmp_path / "ledger", control_token_env="MY_BEARER")
    ports = launch.ServerPorts(1001, 1002, 1003)
    url = "http://127.0.0.1:9/v1"
    captured = launch.build_global_config(NemoGymConfig(), worker_base_url=url, ports=ports, capture=wiring, resources_server=ARITH)
    legacy = launch.build_global_config(NemoGymConfig(), worker_base_url=url, ports=ports, capture=None, resources_server=ARITH)
    custom = {**captured, "token_id_capture": {**captured["token_id_capture"], "lineage_store": "pkg.mod:Store"}}

    assert ledger_dir_from_config(captured) == tmp_path / "ledger"
    with pytest.raises(CaptureGateConfigError, match="needs token_id_capture.enabled and external_staging"):
        ledger_dir_from_config(legacy)
    with pytest.raises(CaptureGateConfigError, match="would replace the gate's BranchingCaptureLedger"):
        ledger_dir_from_config(custom)
