"""Resolve `env.gym` (a Gym environment named as Gym names it) into what the launcher starts.

`resolve_gym_environment(cfg)` finds the installed resources-server package, the agent wired to
it in the Gym config YAML, and the dataset (`package:<rel>` or an absolute path), and checks
that this venv satisfies the server's `requirements.txt` (an agent with extra requirements gets a
venv of its own: `gym_agents`). Promises: every problem is a named error
(a `NemoGymError` of kind `env_not_found`, `GymRequirementsError` listing every missing package)
raised before anything is launched; files are only read, never copied.
See docs/design-docs/gym-environment.md, "Resolving `env.gym`".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from packaging.requirements import InvalidRequirement, Requirement

from nemo_rl.environments.gym_agents import GymAgent, resolve_agent
from nemo_rl.environments.nemo_gym_config import (
    PACKAGE_DATASET_PREFIX,
    WIRING_KEYS,
    GymEnvironmentConfig,
    GymRequirementsError,
    NemoGymError,
)
from nemo_rl.environments.nemo_gym_launch import (
    GYM_AGENTS_PACKAGE,
    OUR_AGENT_MODULES,
    ResourcesServer,
)
from nemo_rl.utils.venvs import GYM_DISTRIBUTION, installable_lines, requirement_names

RESOURCES_ROOT_PACKAGE = "resources_servers"
GYM_AGENT_TYPE = "simple_agent"


def _launchable_package(root: str, name: str, field: str, hint: str) -> Path:
    """The installed folder of `<root>.<name>`, which must hold app.py (launched as a module)."""
    spec = importlib.util.find_spec(f"{root}.{name}")
    if spec is None or not spec.submodule_search_locations:
        raise NemoGymError(
            f"{field}={name!r}: no package {root}.{name} is installed; {hint} {_root_hint(root)}",
            kind="env_not_found",
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / "app.py").is_file():
        raise NemoGymError(
            f"{field}={name!r}: {folder} has no app.py, so it cannot be launched as `python -m {root}.{name}.app`",
            kind="env_not_found",
        )
    return folder


def package_dir(name: str) -> Path:
    """The installed folder of `resources_servers.<name>` (must contain app.py)."""
    return _launchable_package(RESOURCES_ROOT_PACKAGE, name, "env.gym.resources_server", "use a folder name under")


def _root_hint(root: str) -> str:
    spec = importlib.util.find_spec(root)
    if spec is None or not spec.submodule_search_locations:
        return f"Gym's `{root}` (not installed: install nemo-gym)"
    folder = Path(list(spec.submodule_search_locations)[0])
    examples = sorted(p.parent.name for p in folder.glob("*/app.py"))[:6]
    return f"{folder} (e.g. {', '.join(examples)}, ...)"


def load_gym_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise NemoGymError(
            f"Gym config YAML {path} does not exist; set env.gym.config_path to one of "
            f"{sorted(p.name for p in path.parent.glob('*.yaml')) if path.parent.is_dir() else []}",
            kind="env_not_found",
        )
    # Unresolved: a `${...}` left in a used block is rejected by build_global_config with its key.
    doc = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(doc, dict):
        raise NemoGymError(f"Gym config YAML {path} is not a mapping of server instances", kind="env_not_found")
    return doc


def resources_block(doc: Mapping[str, Any], package: str, where: str = "<yaml>") -> tuple[str, dict[str, Any]]:
    """(instance name, keys) of the one resources-server instance of `package` in a Gym config."""
    found = [
        (name, dict(body[RESOURCES_ROOT_PACKAGE][package]))
        for name, body in doc.items()
        if isinstance(body, Mapping)
        and isinstance(body.get(RESOURCES_ROOT_PACKAGE), Mapping)
        and isinstance(body[RESOURCES_ROOT_PACKAGE].get(package), Mapping)
    ]
    if len(found) != 1:
        raise NemoGymError(
            f"{where}: expected exactly one instance with `{RESOURCES_ROOT_PACKAGE}: {package}:`, found "
            f"{[name for name, _ in found]}; point env.gym.config_path at the YAML that declares the server",
            kind="env_not_found",
        )
    return found[0]


def agent_block(
    doc: Mapping[str, Any], resources_instance: str, agent_type: str = GYM_AGENT_TYPE
) -> tuple[str | None, dict[str, Any]]:
    """(instance name, keys minus wiring) of the `agent_type` agent wired to `resources_instance`, or (None, {})."""
    for name, body in doc.items():
        agents = body.get(GYM_AGENTS_PACKAGE) if isinstance(body, Mapping) else None
        agent = agents.get(agent_type) if isinstance(agents, Mapping) else None
        if not isinstance(agent, Mapping):
            continue
        ref = agent.get("resources_server")
        if isinstance(ref, Mapping) and ref.get("name") == resources_instance:
            return name, {k: v for k, v in agent.items() if k not in WIRING_KEYS}
    return None, {}


def _unsatisfied(line: str) -> str | None:
    """None when the venv satisfies the requirement line, else how it fails (by distribution name)."""
    try:
        req = Requirement(line)
    except InvalidRequirement:
        return f"{line!r} (not a PEP 508 requirement; install it by hand)"
    if req.marker is not None and not req.marker.evaluate():
        return None
    try:
        installed = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return str(req)
    if req.specifier and not req.specifier.contains(installed, prereleases=True):
        return f"{req} (installed {installed})"
    return None


def missing_requirements(path: Path) -> list[str]:
    """Requirements of `path` this venv does not satisfy (none when the file does not exist)."""
    if not path.is_file():
        return []
    missing: list[str] = []
    # Option lines (`-e nemo-gym[dev] @ ../../`, index options) install nothing this venv must hold.
    for line in installable_lines(path, lambda line: line.startswith("-") or requirement_names(line, GYM_DISTRIBUTION)):
        problem = _unsatisfied(line)
        if problem is not None:
            missing.append(problem)
    return missing


def dataset_path(cfg: GymEnvironmentConfig, package_folder: Path) -> Path:
    """The dataset file named by `env.gym.dataset` (must exist)."""
    if cfg.dataset.startswith(PACKAGE_DATASET_PREFIX):
        path = package_folder / cfg.dataset[len(PACKAGE_DATASET_PREFIX):]
    else:
        path = Path(cfg.dataset)
    if not path.is_file():
        raise NemoGymError(
            f"env.gym.dataset={cfg.dataset!r}: {path} does not exist; the shipped example rows are "
            "package:data/example.jsonl",
            kind="env_not_found",
        )
    return path


def check_agent(agent: str) -> GymAgent:
    """`env.agent` resolved: ours, an installed Gym agent package or one of its flavours (`gym_agents`).

    An agent whose requirements.txt adds packages runs in a venv of its own, so they are not
    required here."""
    return resolve_agent(agent)


def resolve_gym_environment(cfg: GymEnvironmentConfig, agent: str = GYM_AGENT_TYPE) -> ResourcesServer:
    """The resources server + agent keys `env.gym` names; checks its extra requirements first.

    The agent block is the YAML's `agent` instance wired to the server; our compacting_agent takes
    simple_agent's (it is simple_agent plus compaction).
    """
    folder = package_dir(cfg.resources_server)
    requirements = folder / "requirements.txt"
    missing = missing_requirements(requirements)
    if missing:
        raise GymRequirementsError(cfg.resources_server, requirements, missing)
    dataset_path(cfg, folder)  # a wrong dataset fails here, before any server starts
    yaml_path = folder / cfg.config_relpath
    doc = load_gym_yaml(yaml_path)
    instance, block = resources_block(doc, cfg.resources_server, str(yaml_path))
    agent_type = GYM_AGENT_TYPE if agent in OUR_AGENT_MODULES else agent.partition("/")[0]
    agent_instance, agent_keys = agent_block(doc, instance, agent_type)
    return ResourcesServer(
        name=instance,
        package=cfg.resources_server,
        module=f"{RESOURCES_ROOT_PACKAGE}.{cfg.resources_server}.app",
        block={**block, **cfg.resources_overrides},
        agent_name=agent_instance or f"{instance}_agent",
        agent_block={**agent_keys, **cfg.agent_overrides},
    )
