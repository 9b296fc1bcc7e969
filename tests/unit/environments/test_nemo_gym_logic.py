"""Pure logic of the Gym environment: config generation, row sampling, errors, retire."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from pydantic import ValidationError

from examples.arith.gym_task import RESOURCES_SERVER as ARITH
from examples.arith.rows import build_row
from examples.arith.task import Problem
from nemo_gym.token_id_capture.config import TokenIdCaptureConfig, token_id_capture_enabled_for_agent
from nemo_gym.token_id_capture.staging.records import RolloutManifest
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gym_client import (
    NemoGymEnvironment,
    _parse_manifest,
    check_rollout_id,
    ledger_files,
    manifest_path,
)
from nemo_rl.environments.nemo_gym_config import (
    GymServerStartError,
    GymRunError,
    GymRunTimeoutError,
    ManifestError,
    NemoGymConfig,
    NemoGymError,
)
from nemo_rl.environments.task import RowSampling
from nemo_rl.token_capture.config import TokenCaptureConfig

PORTS = launch.ServerPorts(gate=1001, resources=1002, agent=1003)
WORKER = "http://127.0.0.1:18300/v1"
SAMPLING = RowSampling(temperature=0.7, top_p=0.9, max_output_tokens=128)


def _env(tmp_path: Path, capture: bool) -> NemoGymEnvironment:
    return NemoGymEnvironment(
        NemoGymConfig(), TokenCaptureConfig(enabled=capture), worker_base_url=WORKER, log_dir=tmp_path
    )


# --- config generation -------------------------------------------------------------------


def _expected_config(capture: bool) -> dict:
    agent = {
        "entrypoint": "app.py",
        "host": "127.0.0.1",
        "port": 1003,
        "resources_server": {"type": "resources_servers", "name": "arith_resources"},
        "model_server": {"type": "responses_api_models", "name": "policy_model"},
        "max_steps": 4,
    }
    if capture:
        agent["token_id_capture"] = True
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        "dry_run": False,
        "policy_model": {
            "responses_api_models": {
                "vllm_model": {
                    "entrypoint": "app.py",
                    "host": "127.0.0.1",
                    "port": 1001,
                    "base_url": WORKER,
                    "api_key": "EMPTY",
                    "model": "policy",
                    "return_token_id_information": not capture,
                    "uses_reasoning_parser": False,
                }
            }
        },
        "arith_resources": {
            "resources_servers": {
                "arith": {"entrypoint": "arith_resources.py", "host": "127.0.0.1", "port": 1002, "domain": "math"}
            }
        },
        "arith_agent": {"responses_api_agents": {"simple_agent": agent}},
    }


def test_legacy_config_echoes_tokens_and_has_no_capture_block() -> None:
    config = launch.build_global_config(NemoGymConfig(), worker_base_url=WORKER, ports=PORTS, capture=None, resources_server=ARITH)
    assert config == _expected_config(capture=False)
    assert TokenIdCaptureConfig.model_validate(config).enabled is False
    assert token_id_capture_enabled_for_agent(config, ARITH.agent_name) is False


def test_capture_config_is_the_contract_block_and_gym_accepts_it(tmp_path: Path) -> None:
    wiring = launch.CaptureWiring(ledger_dir=tmp_path / "ledger", control_token_env="MY_BEARER")
    config = launch.build_global_config(NemoGymConfig(), worker_base_url=WORKER, ports=PORTS, capture=wiring, resources_server=ARITH)
    expected = _expected_config(capture=True)
    expected["token_id_capture"] = {
        "enabled": True,
        "external_staging": True,
        "external_staging_backend": "vllm_worker",
        "rebuild_response": False,
        "dir": str(tmp_path / "ledger"),
        "control_auth_token_env": "MY_BEARER",
    }
    # Only our capture gate reads this block: its input limits (GateGuardConfig defaults).
    expected["nrl_gate_guard"] = {"max_body_bytes": 4 * 1024 * 1024, "max_rollout_id_chars": 128, "context_probe_timeout_s": 10.0,
                                  "stream_read_timeout_s": 600.0}
    assert config == expected
    parsed = TokenIdCaptureConfig.model_validate(config).token_id_capture
    assert (parsed.sink, parsed.lineage_store, parsed.control_auth_token_env) == (None, None, "MY_BEARER")
    assert token_id_capture_enabled_for_agent(config, ARITH.agent_name) is True


def test_config_knobs_reach_the_servers() -> None:
    cfg = NemoGymConfig(agent_max_steps=7, model_name="tiny", worker_api_key="k")
    config = launch.build_global_config(cfg, worker_base_url=WORKER, ports=PORTS, capture=None, resources_server=ARITH)
    gate = config["policy_model"]["responses_api_models"]["vllm_model"]
    assert (gate["model"], gate["api_key"]) == ("tiny", "k")
    assert config["arith_agent"]["responses_api_agents"]["simple_agent"]["max_steps"] == 7


def test_nemo_gym_config_forbids_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        NemoGymConfig(startup_timeout=3.0)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        NemoGymConfig(agent_max_steps=0)
    with pytest.raises(ValidationError, match="greater than 0"):
        NemoGymConfig(run_timeout_s=0.0)


@pytest.mark.parametrize("url", ["127.0.0.1:8000/v1", "ftp://127.0.0.1:8000/v1", "http://127.0.0.1/v1"])
def test_worker_base_url_must_be_http_with_port(url: str) -> None:
    with pytest.raises(ValueError, match="is not an http URL with host and port"):
        launch.check_worker_base_url(url)


def test_ports_and_wiring_check_their_invariants() -> None:
    with pytest.raises(ValueError, match="three distinct ports"):
        launch.ServerPorts(gate=5, resources=5, agent=6)
    with pytest.raises(ValueError, match="three distinct ports"):
        launch.ServerPorts(gate=0, resources=5, agent=6)
    with pytest.raises(ValueError, match="must be absolute"):
        launch.CaptureWiring(ledger_dir=Path("ledger"), control_token_env="X")


def test_pick_free_ports_are_distinct_loopback_ports() -> None:
    ports = launch.pick_free_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)


def test_server_env_drops_inherited_gym_variables(tmp_path: Path) -> None:
    spec = launch.ServerSpec(launch.GATE, launch.GATE_MODULE, 1001)
    env = launch.server_env(
        {"PATH": "fake-path", "PYTHONPATH": "old", "NEMO_GYM_MODEL_SERVER_BASE_URL": "http://elsewhere"},
        config_json='{"a": 1}',
        spec=spec,
        import_root=tmp_path,
        extra={"MY_BEARER": "secret"},
    )
    assert env == {
        "PATH": "fake-path",
        "PYTHONPATH": f"{tmp_path}:old",
        "PYTHONUNBUFFERED": "1",
        "NEMO_GYM_CONFIG_DICT": '{"a": 1}',
        "NEMO_GYM_CONFIG_PATH": "policy_model",
        "MY_BEARER": "secret",
    }
    assert launch.server_command("py", spec) == ["py", "-m", "responses_api_models.vllm_model.app"]


def test_server_specs_name_our_module_not_a_gym_package(tmp_path: Path) -> None:
    modules = {s.name: s.module for s in launch.server_specs(PORTS, resources_server=ARITH)}
    assert modules == {
        "policy_model": "responses_api_models.vllm_model.app",
        "arith_resources": "examples.arith.resources",
        "arith_agent": "responses_api_agents.simple_agent.app",
    }
    assert launch.server_specs(PORTS, None, resources_server=ARITH) == launch.server_specs(PORTS, resources_server=ARITH)
    wiring = launch.CaptureWiring(ledger_dir=tmp_path / "ledger", control_token_env="MY_BEARER")
    captured = {s.name: s.module for s in launch.server_specs(PORTS, wiring, resources_server=ARITH)}
    assert captured == {**modules, "policy_model": "nemo_rl.environments.gate.app"}


# --- row sampling ----------------------------------------------------------------------------


def test_row_sampling_is_strict() -> None:
    with pytest.raises(ValidationError):
        RowSampling(temperature=0.7, top_p=1.5, max_output_tokens=8)
    with pytest.raises(ValidationError):
        RowSampling(temperature=0.7, top_p=1.0, max_output_tokens="8")


# --- rollout ids, manifest parsing, retire, errors ----------------------------------------


def test_rollout_ids_follow_gyms_rule() -> None:
    assert check_rollout_id("run1.step-0_g2") == "run1.step-0_g2"
    for bad in ("", "bad id", "a/b", "é"):
        with pytest.raises(NemoGymError, match="use only ASCII letters") as raised:
            check_rollout_id(bad)
        assert raised.value.kind == "invalid_rollout_id"


def test_manifest_path_is_gyms_control_route() -> None:
    from nemo_gym.token_id_capture.control_routes import CONTROL_ROUTE_PREFIX

    assert manifest_path("r-1") == f"{CONTROL_ROUTE_PREFIX}/rollouts/r-1/manifest"


def test_parse_manifest_checks_the_schema_and_leaves_the_rollout_verdict_to_the_judge() -> None:
    empty = _parse_manifest("r1", '{"schema_version": 2, "rollout_id": "r1", "records": [], "failures": []}')
    assert empty == RolloutManifest(rollout_id="r1")
    # A manifest of another rollout is returned as is; judge_rollout makes it capture_poisoned.
    assert _parse_manifest("r1", '{"rollout_id": "r2"}') == RolloutManifest(rollout_id="r2")
    with pytest.raises(ManifestError, match="not a valid RolloutManifest") as raised:
        _parse_manifest("r1", '{"records": []}')
    assert raised.value.kind == "server"


def test_retire_removes_only_the_named_rollouts_files(tmp_path: Path) -> None:
    env = _env(tmp_path, capture=True)
    env.ledger_dir.mkdir(parents=True)
    for rid in ("a1", "b2"):
        for suffix in (".lineage.jsonl", ".tokens.intents", ".tokens.lock"):
            (env.ledger_dir / f"{rid}{suffix}").write_text("x")
    removed = env.retire(["a1", "never-seen"])
    assert sorted(p.name for p in removed) == ["a1.lineage.jsonl", "a1.tokens.intents", "a1.tokens.lock"]
    assert sorted(p.name for p in env.ledger_dir.iterdir()) == [
        "b2.lineage.jsonl",
        "b2.tokens.intents",
        "b2.tokens.lock",
    ]
    assert ledger_files(tmp_path, "a1")[0] == tmp_path / "a1.lineage.jsonl"
    with pytest.raises(NemoGymError) as raised:
        env.retire(["../escape"])
    assert raised.value.kind == "invalid_rollout_id"


async def test_capture_only_calls_fail_loudly_in_legacy_mode(tmp_path: Path) -> None:
    env = _env(tmp_path, capture=False)
    with pytest.raises(NemoGymError, match="token_capture.enabled=true") as raised:
        env.retire(["a1"])
    assert raised.value.kind == "capture_mode"
    with pytest.raises(NemoGymError, match="legacy gate keeps no ledger") as raised:
        await env.manifest("a1")
    assert raised.value.kind == "capture_mode"


async def test_run_checks_its_arguments_before_and_without_servers(tmp_path: Path) -> None:
    row = build_row(Problem("1 + 1", 2), SAMPLING)
    capture_env = _env(tmp_path, capture=True)
    with pytest.raises(NemoGymError, match="needs a fresh rollout_id") as raised:
        await capture_env.run(None, row)
    assert raised.value.kind == "invalid_rollout_id"
    with pytest.raises(NemoGymError, match="already carries _ng_rollout_id") as raised:
        await capture_env.run("r1", {**row, "_ng_rollout_id": "r0"})
    assert raised.value.kind == "invalid_rollout_id"
    with pytest.raises(NemoGymError, match="await start") as raised:
        await capture_env.run("r1", row)
    assert raised.value.kind == "not_started"
    with pytest.raises(NemoGymError) as raised:
        await _env(tmp_path, capture=False).run(None, row)
    assert raised.value.kind == "not_started"


def test_start_error_message_names_server_reason_log_and_tail(tmp_path: Path) -> None:
    log = tmp_path / "gym_policy_model.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    tail = launch.read_log_tail(log, 3)
    assert tail == "line 97\nline 98\nline 99"
    err = GymServerStartError("policy_model", "the process exited with code 1", log, tail)
    assert str(err) == (
        f"Gym server `policy_model` failed to start: the process exited with code 1. Log {log} ends with:\n"
        "line 97\nline 98\nline 99"
    )
    assert launch.read_log_tail(tmp_path / "missing.log", 3) == f"<no log file at {tmp_path / 'missing.log'}>"


def test_interpolation_syntax_is_rejected(tmp_path: Path) -> None:
    wiring = launch.CaptureWiring(ledger_dir=tmp_path / "${oops}", control_token_env="X")
    with pytest.raises(ValueError, match=r"token_id_capture.dir=.*contains '\$\{'"):
        launch.build_global_config(NemoGymConfig(), worker_base_url=WORKER, ports=PORTS, capture=wiring, resources_server=ARITH)


# --- HTTP status -> named error, against an in-process fake gate/agent --------------------


async def _fake_server(handler) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


def _attach(env: NemoGymEnvironment, *, gate: int = 1, agent: int = 2) -> None:
    # Point a never-started environment at a fake server (the Gym servers are not under test here).
    servers = env.servers
    servers._ports = launch.ServerPorts(gate=gate, resources=3, agent=agent)
    servers._bearer = "good"
    servers._log_paths = {
        name: servers._log_dir / f"gym_{name}.log" for name in (launch.GATE, ARITH.name, ARITH.agent_name)
    }


@pytest.mark.parametrize(
    ("status", "kind", "match"),
    [
        (401, "auth", "rejected the control bearer"),
        (400, "request", "HTTP 400: Invalid rollout id"),
        (503, "server", "HTTP 503"),
        (200, "server", "not a valid RolloutManifest"),
    ],
)
async def test_manifest_status_maps_to_named_errors(tmp_path: Path, status: int, kind: str, match: str) -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.Response(status=status, text="Invalid rollout id" if status != 200 else "[]")

    runner, port = await _fake_server(handler)
    env = _env(tmp_path, capture=True)
    _attach(env, gate=port)
    try:
        with pytest.raises(ManifestError, match=match) as raised:
            await env.manifest("r1")
        assert raised.value.kind == kind
    finally:
        await env.aclose()
        await runner.cleanup()
    assert seen == ["Bearer good"]


async def test_manifest_and_run_deadlines_raise_named_errors(tmp_path: Path) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="{}")

    runner, port = await _fake_server(slow)
    env = NemoGymEnvironment(
        NemoGymConfig(run_timeout_s=0.2),
        TokenCaptureConfig(enabled=True, manifest_timeout_s=0.2),
        worker_base_url=WORKER,
        log_dir=tmp_path,
    )
    _attach(env, gate=port)
    try:
        with pytest.raises(ManifestError, match="manifest_timeout_s=0.2") as raised:
            await env.manifest("r1")
        assert raised.value.kind == "timeout"
        _attach(env, agent=port)
        with pytest.raises(GymRunTimeoutError, match="run_timeout_s=0.2"):
            await env.run("r1", build_row(Problem("1 + 1", 2), SAMPLING))
    finally:
        release.set()
        await env.aclose()
        await runner.cleanup()


async def test_run_error_status_is_quoted(tmp_path: Path) -> None:
    async def failing(request: web.Request) -> web.Response:
        return web.Response(status=500, text="Hit an exception in SimpleAgent calling an inner server")

    runner, port = await _fake_server(failing)
    env = _env(tmp_path, capture=False)
    _attach(env, agent=port)
    try:
        with pytest.raises(GymRunError, match="HTTP 500: Hit an exception in SimpleAgent"):
            await env.run(None, build_row(Problem("1 + 1", 2), SAMPLING))
    finally:
        await env.aclose()
        await runner.cleanup()
