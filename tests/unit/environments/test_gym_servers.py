"""`env.gym`: the config, resolving a shipped Gym environment, the global config it yields,
the missing-requirements error and the reward key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from examples.arith.gym_task import RESOURCES_SERVER as ARITH
from nemo_gym.token_id_capture.config import token_id_capture_enabled_for_agent
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gym_servers import (
    agent_block,
    dataset_path,
    missing_requirements,
    package_dir,
    resolve_gym_environment,
    resources_block,
)
from nemo_rl.environments.gym_client import NemoGymEnvironment, apply_reward_key
from nemo_rl.environments.nemo_gym_config import (
    GymEnvironmentConfig,
    GymRequirementsError,
    NemoGymConfig,
    NemoGymError,
)
from nemo_rl.token_capture.config import TokenCaptureConfig

PORTS = launch.ServerPorts(gate=1001, resources=1002, agent=1003)
WORKER = "http://127.0.0.1:18300/v1"


# --- config -------------------------------------------------------------------------------------
def test_config_defaults_live_in_the_model() -> None:
    cfg = NemoGymConfig.model_validate({"gym": {"resources_server": "example_multi_step"}})
    assert cfg.gym is not None and NemoGymConfig().gym is None
    assert cfg.gym.config_relpath == "configs/example_multi_step.yaml"
    assert (cfg.gym.dataset, cfg.gym.reward_key) == ("package:data/example.jsonl", "reward")


@pytest.mark.parametrize(
    "gym,match",
    [
        ({"resources_server": "a/b"}, "resources_server"),
        ({"resources_server": "x", "typo": 1}, "typo"),
        ({"resources_server": "x", "dataset": "data/example.jsonl"}, "neither 'package:<relative path>'"),
        ({"resources_server": "x", "dataset": "package:../../etc/passwd"}, "path inside the package"),
        ({"resources_server": "x", "config_path": "/abs.yaml"}, "inside the resources server package"),
        ({"resources_server": "x", "agent_overrides": {"port": 1}}, r"launcher owns"),
        ({"resources_server": "x", "agent_overrides": {"max_steps": 9}}, r"env\.agent_max_steps"),
    ],
)
def test_config_rejects_bad_values_by_name(gym: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        NemoGymConfig.model_validate({"gym": gym})


# --- resolving a shipped environment ----------------------------------------------------------------
def test_resolves_gyms_example_multi_step_by_name() -> None:
    rs = resolve_gym_environment(GymEnvironmentConfig(resources_server="example_multi_step"))
    assert rs.name == "example_multi_step_resources_server"
    assert rs.agent_name == "example_multi_step_simple_agent"
    assert rs.module == "resources_servers.example_multi_step.app"
    assert rs.block["domain"] == "instruction_following" and "datasets" not in rs.agent_block


def test_unknown_package_and_missing_dataset_are_named() -> None:
    with pytest.raises(NemoGymError, match="no_such_env") as raised:
        package_dir("no_such_env")
    assert raised.value.kind == "env_not_found"
    cfg = GymEnvironmentConfig(resources_server="example_multi_step", dataset="package:data/nope.jsonl")
    with pytest.raises(NemoGymError, match="nope.jsonl") as raised:
        dataset_path(cfg, package_dir(cfg.resources_server))
    assert raised.value.kind == "env_not_found"
    with pytest.raises(NemoGymError, match="config_path") as raised:
        resolve_gym_environment(GymEnvironmentConfig(resources_server="example_multi_step", config_path="configs/x.yaml"))
    assert raised.value.kind == "env_not_found"


def test_resources_and_agent_blocks_are_found_by_gyms_own_wiring() -> None:
    doc = {
        "srv": {"resources_servers": {"pkg": {"entrypoint": "app.py", "domain": "d", "judge": 3}}},
        "other_agent": {"responses_api_agents": {"simple_agent": {"resources_server": {"name": "elsewhere"}}}},
        "srv_agent": {
            "responses_api_agents": {
                "simple_agent": {"entrypoint": "app.py", "resources_server": {"name": "srv"}, "datasets": [], "x": 1}
            }
        },
    }
    assert resources_block(doc, "pkg") == ("srv", {"entrypoint": "app.py", "domain": "d", "judge": 3})
    assert agent_block(doc, "srv") == ("srv_agent", {"entrypoint": "app.py", "x": 1})
    assert agent_block(doc, "none") == (None, {})
    with pytest.raises(NemoGymError, match="exactly one") as raised:
        resources_block(doc, "other")
    assert raised.value.kind == "env_not_found"


def test_global_config_keeps_the_capture_wiring_for_a_gym_server(tmp_path: Path) -> None:
    rs = resolve_gym_environment(GymEnvironmentConfig(resources_server="example_single_tool_call"))
    wiring = launch.CaptureWiring(tmp_path.resolve(), "CTRL_TOKEN")
    config = launch.build_global_config(NemoGymConfig(), worker_base_url=WORKER, ports=PORTS, capture=wiring,
                                        resources_server=rs)
    resources = config[rs.name]["resources_servers"]["example_single_tool_call"]
    assert (resources["host"], resources["port"], resources["domain"]) == ("127.0.0.1", 1002, "agent")
    agent = config[rs.agent_name]["responses_api_agents"]["simple_agent"]
    assert agent["resources_server"] == {"type": "resources_servers", "name": rs.name}
    assert agent["model_server"] == {"type": "responses_api_models", "name": launch.GATE}
    assert token_id_capture_enabled_for_agent(config, rs.agent_name) is True
    assert config["token_id_capture"] == launch.capture_block(wiring)
    specs = {s.name: s.module for s in launch.server_specs(PORTS, wiring, "simple_agent", resources_server=rs)}
    assert specs == {
        launch.GATE: launch.CAPTURE_GATE_MODULE,
        rs.name: "resources_servers.example_single_tool_call.app",
        rs.agent_name: launch.AGENT_MODULE,
    }


def test_the_default_is_still_the_arithmetic_environment(tmp_path: Path) -> None:
    env = NemoGymEnvironment(NemoGymConfig(), TokenCaptureConfig(enabled=False), worker_base_url=WORKER, log_dir=tmp_path)
    assert env.servers.resources_server == ARITH
    assert launch.build_global_config(NemoGymConfig(), worker_base_url=WORKER, ports=PORTS, capture=None, resources_server=ARITH)[
        ARITH.name
    ] == {"resources_servers": {"arith": {"entrypoint": "arith_resources.py", "domain": "math",
                                          "host": "127.0.0.1", "port": 1002}}}


# --- requirements ------------------------------------------------------------------------------
def test_missing_requirements_are_listed_by_distribution(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text(
        "-e nemo-gym[dev] @ ../../\n# a comment\n\nnemo-gym\npydantic\n"
        "no-such-dist-xyz>=1.0  # trailing\nPyYAML>=999\nonly-on-windows ; sys_platform == 'win32'\n"
    )
    missing = missing_requirements(req)
    assert missing[0] == "no-such-dist-xyz>=1.0"
    assert missing[1].startswith("PyYAML>=999 (installed ")
    assert len(missing) == 2
    assert missing_requirements(tmp_path / "absent.txt") == []


def test_a_server_with_missing_requirements_fails_before_launch(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "fake_env"
    (folder / "configs").mkdir(parents=True)
    (folder / "app.py").write_text("")
    (folder / "requirements.txt").write_text("-e nemo-gym[dev] @ ../../\nno-such-dist-xyz\nother-missing==2\n")
    import nemo_rl.environments.gym_servers as gym_servers

    monkeypatch.setattr(gym_servers, "package_dir", lambda name: folder)
    cfg = NemoGymConfig.model_validate({"gym": {"resources_server": "fake_env"}})
    with pytest.raises(GymRequirementsError, match=r"`fake_env` needs .*no-such-dist-xyz, other-missing==2") as info:
        NemoGymEnvironment(cfg, TokenCaptureConfig(enabled=False), worker_base_url=WORKER, log_dir=tmp_path)
    assert info.value.missing == ["no-such-dist-xyz", "other-missing==2"]


# --- reward key ----------------------------------------------------------------------------------
def test_reward_key_maps_the_configured_key_onto_reward() -> None:
    result = {"reward": 0.0, "set_overlap": 0.5, "response": {}}
    assert apply_reward_key(result, "reward") == result
    mapped = apply_reward_key(result, "set_overlap")
    assert (mapped["reward"], mapped["verifier_reward"]) == (0.5, 0.0)
    assert result["reward"] == 0.0  # not mutated
    assert "reward" not in apply_reward_key(result, "absent")  # -> the judge's reward_missing


def test_any_installed_gym_agent_is_selectable_by_name(tmp_path: Path) -> None:
    from nemo_rl.environments.gym_servers import check_agent

    for agent in ("simple_agent", "compacting_agent", "simple_agent_with_compaction"):
        check_agent(agent)
    assert launch.agent_module("simple_agent") == launch.AGENT_MODULE
    assert launch.agent_module("compacting_agent") == launch.COMPACTING_AGENT_MODULE
    assert launch.agent_module("simple_agent_with_compaction") == "responses_api_agents.simple_agent_with_compaction.app"
    cfg = NemoGymConfig(agent="simple_agent_with_compaction")
    config = launch.build_global_config(cfg, worker_base_url=WORKER, ports=PORTS, capture=None, resources_server=ARITH)
    assert list(config[ARITH.agent_name]["responses_api_agents"]) == ["simple_agent_with_compaction"]
    specs = {s.name: s.module for s in launch.server_specs(PORTS, None, cfg.agent, resources_server=ARITH)}
    assert specs[ARITH.agent_name] == "responses_api_agents.simple_agent_with_compaction.app"


def test_an_unknown_agent_fails_before_launch_naming_env_agent() -> None:
    from nemo_rl.environments.gym_servers import check_agent

    with pytest.raises(NemoGymError, match=r"env.agent=.no_such_agent.: .*no_such_agent holds no Gym agent \(no app.py\); use \[.compacting_agent.\] or a folder under") as raised:
        check_agent("no_such_agent")
    assert raised.value.kind == "env_not_found"
    # langgraph_agent ships with Gym and needs langgraph, which this venv does not install: it gets a venv of its own.
    assert check_agent("langgraph_agent").extra_requirements == ("langchain-core", "langgraph")
    with pytest.raises(ValidationError, match="agent"):
        NemoGymConfig(agent="../evil")


def test_the_yaml_block_of_the_selected_agent_type_is_used() -> None:
    doc = {
        "srv": {"resources_servers": {"pkg": {"entrypoint": "app.py"}}},
        "srv_simple": {"responses_api_agents": {"simple_agent": {"resources_server": {"name": "srv"}, "a": 1}}},
        "srv_sim": {"responses_api_agents": {"tool_simulation_agent": {"resources_server": {"name": "srv"}, "b": 2}}},
    }
    assert agent_block(doc, "srv") == ("srv_simple", {"a": 1})
    assert agent_block(doc, "srv", "tool_simulation_agent") == ("srv_sim", {"b": 2})
    assert agent_block(doc, "srv", "simple_agent_with_compaction") == (None, {})
