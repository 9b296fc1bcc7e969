"""`env.agent` as Gym names agents: packages, `<package>/<flavour>`, and the venv of an agent with extra requirements."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from examples.arith.gym_task import RESOURCES_SERVER as ARITH
from nemo_rl.environments import nemo_gym_launch as launch
from nemo_rl.environments.gym_agents import agent_flavours, agents_root, extra_requirements, resolve_agent
from nemo_rl.environments.nemo_gym_config import NemoGymConfig, NemoGymError
from nemo_rl.utils import venvs

LANGGRAPH_FLAVOURS = ["orchestrator_agent", "parallel_thinking_agent", "reflection_agent", "rewoo_agent"]
PORTS = launch.ServerPorts(1001, 1002, 1003)


@pytest.mark.parametrize(("flavour", "entrypoint"), [("reflection_agent", "reflection_agent.py"), ("rewoo_agent", "rewoo_agent.py")])
def test_two_langgraph_flavours_resolve_to_their_entrypoints_and_own_venv(flavour: str, entrypoint: str) -> None:
    agent = resolve_agent(f"langgraph_agent/{flavour}")
    folder = agents_root() / "langgraph_agent"
    assert (agent.package, agent.flavour) == ("langgraph_agent", flavour)
    assert agent.module == f"responses_api_agents.langgraph_agent.{entrypoint[:-3]}"
    assert agent.block["entrypoint"] == entrypoint and "resources_server" not in agent.block
    assert agent.import_dir == folder  # its entrypoint does `from app import ...`, as Gym runs it from the folder
    assert agent.requirements_file == folder / "requirements.txt"
    assert agent.extra_requirements == ("langchain-core", "langgraph") and agent.own_venv


def test_the_reflection_flavour_keeps_its_own_keys() -> None:
    assert resolve_agent("langgraph_agent/reflection_agent").block == {"entrypoint": "reflection_agent.py", "max_reflections": 2}


def test_an_unknown_flavour_is_refused_listing_the_valid_ones() -> None:
    with pytest.raises(NemoGymError) as raised:
        resolve_agent("langgraph_agent/no_such_flavour")
    assert raised.value.kind == "env_not_found"
    valid = ", ".join(f"langgraph_agent/{f}" for f in LANGGRAPH_FLAVOURS)
    assert str(raised.value) == f"env.agent='langgraph_agent/no_such_flavour': langgraph_agent has no flavour 'no_such_flavour'; valid: {valid}"
    assert list(agent_flavours(agents_root() / "langgraph_agent")) == LANGGRAPH_FLAVOURS  # `entrypoint: ???` is none
    with pytest.raises(NemoGymError, match=r"valid: \(none: this package ships no flavours\)"):
        resolve_agent("simple_agent/x")


def test_agents_without_extra_requirements_run_in_this_venv() -> None:
    compaction = resolve_agent("simple_agent_with_compaction")
    assert compaction.module == "responses_api_agents.simple_agent_with_compaction.app"
    assert compaction.extra_requirements == () and not compaction.own_venv and compaction.import_dir is None
    ours = resolve_agent("compacting_agent")
    assert (ours.module, ours.own_venv) == (launch.COMPACTING_AGENT_MODULE, False)


def test_the_config_accepts_one_flavour_level_only() -> None:
    assert NemoGymConfig(agent="langgraph_agent/reflection_agent").agent == "langgraph_agent/reflection_agent"
    for bad in ("langgraph_agent/", "a/b/c", "/x", "langgraph_agent/../x"):
        with pytest.raises(ValidationError, match="agent"):
            NemoGymConfig(agent=bad)


def test_a_flavour_is_keyed_by_its_package_in_gyms_config_with_its_entrypoint() -> None:
    agent = resolve_agent("langgraph_agent/rewoo_agent")
    cfg = NemoGymConfig(agent=agent.name)
    resources = launch.ResourcesServer(ARITH.name, ARITH.package, ARITH.module, ARITH.block, ARITH.agent_name, agent.block)
    config = launch.build_global_config(cfg, worker_base_url="http://127.0.0.1:9/v1", ports=PORTS, capture=None,
                                        resources_server=resources)
    block = config[ARITH.agent_name]["responses_api_agents"]["langgraph_agent"]
    assert block["entrypoint"] == "rewoo_agent.py" and block["port"] == PORTS.agent


def test_extra_requirements_skip_nemo_gym_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "requirements.txt"
    path.write_text("-e nemo-gym[dev] @ ../../\n# tools\nlanggraph>=0.2  # graph\n\nnemo_gym>=0.7\nlangchain-core\nnemo-gym-extras\n")
    assert extra_requirements(path) == ("langgraph>=0.2", "langchain-core", "nemo-gym-extras")
    assert extra_requirements(tmp_path / "absent.txt") == ()
    path.write_text("--no-binary :all:\n")
    with pytest.raises(NemoGymError, match="option line '--no-binary"):
        extra_requirements(path)
    path.write_text("not a requirement ==\n")
    with pytest.raises(NemoGymError, match="is not a PEP 508 requirement"):
        extra_requirements(path)


def test_the_agent_venv_spec_is_its_requirements_plus_local_nemo_gym_and_hashes_them(tmp_path: Path) -> None:
    path = tmp_path / "requirements.txt"
    path.write_text("-e nemo-gym[dev] @ ../../\nlanggraph\n")
    spec = venvs.gym_agent_spec("langgraph_agent", path)
    assert spec.name == "gym-agent-langgraph_agent" and spec.requirements_file == path
    assert spec.local_packages == (venvs.REPO_ROOT / "3rdparty" / "nemo-gym",)
    first = venvs.spec_hash(spec, python_version="3.11.test")
    assert venvs.spec_hash(spec, python_version="3.11.test") == first
    path.write_text("-e nemo-gym[dev] @ ../../\nlanggraph\nlangchain-core\n")
    assert venvs.spec_hash(spec, python_version="3.11.test") != first  # another venv folder, never a reuse


def test_the_resolving_builder_installs_the_requirements_and_nemo_gym_with_dependencies(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "requirements.txt"
    path.write_text("-e nemo-gym[dev] @ ../../\nlangchain-core\nlanggraph\n")
    commands: list[list[str]] = []
    monkeypatch.setattr(venvs, "_uv", lambda: "uv")
    monkeypatch.setattr(venvs, "_run", lambda cmd, progress, timeout_s: commands.append(cmd))
    target = tmp_path / "venv"
    venvs.resolving_uv_builder(venvs.gym_agent_spec("langgraph_agent", path), target, print, 60.0)
    assert commands[0][:3] == ["uv", "venv", "--no-config"] and "--relocatable" in commands[0]
    install = commands[1]
    assert install[:7] == ["uv", "pip", "install", "--no-config", "--python", str(target / "bin" / "python"), "--compile-bytecode"]
    assert install[7:10] == ["langchain-core", "langgraph", str(venvs.GYM_PACKAGE)]
    assert "--no-deps" not in install and not any("../../" in part for part in install)


def test_a_first_build_prints_progress_and_a_second_use_reuses_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(venvs.VENVS_DIR_ENV, str(tmp_path / "venvs"))
    path = tmp_path / "requirements.txt"
    path.write_text("langgraph\n")
    built: list[Path] = []

    def builder(spec, target, progress, timeout_s):
        built.append(target)
        (target / "bin").mkdir(parents=True)

    lines: list[str] = []
    spec = venvs.gym_agent_spec("langgraph_agent", path)
    first = venvs.ensure_venv(spec, progress=lines.append, builder=builder)
    assert venvs.ensure_venv(spec, progress=lines.append, builder=builder) == first and len(built) == 1
    assert first.name.startswith("gym-agent-langgraph_agent-")
    assert lines[0].startswith("[venv] building flavor 'gym-agent-langgraph_agent'") and "ready in" in lines[-1]
