"""`env.agent` as Gym names an agent: a package, or `<package>/<flavour>`, and where it runs.

`resolve_agent(name)` (reads files only) returns a `GymAgent`: our own agents by name; a Gym
package under `responses_api_agents/` (launched as `<package>.app`); or a flavour, one of the
package's `configs/<flavour>.yaml` whose agent block names an existing entrypoint (launched as
`<package>.<entrypoint>` with the package folder on the import path, as Gym runs it; its block's
keys, minus wiring, become the agent's config). An unknown package or flavour is a
`NemoGymError` (`env_not_found`) listing the valid ones. `extra_requirements` are the lines of the
package's requirements.txt besides nemo-gym itself: an agent with any runs in a venv of its own,
built from them and the local nemo-gym package (`venvs.gym_agent_spec`, spec-hashed).
See docs/design-docs/gym-environment.md, "Agents with requirements of their own".
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from packaging.requirements import InvalidRequirement, Requirement

from nemo_rl.environments.nemo_gym_config import WIRING_KEYS, NemoGymError
from nemo_rl.environments.nemo_gym_launch import GYM_AGENTS_PACKAGE, OUR_AGENT_MODULES
from nemo_rl.utils.venvs import GYM_DISTRIBUTION, installable_lines, requirement_names

FLAVOUR_SEPARATOR = "/"


@dataclass(frozen=True)
class GymAgent:
    """One resolved `env.agent` (see the module docstring)."""

    name: str  # as configured: `simple_agent`, `langgraph_agent/reflection_agent`
    package: str  # key under `responses_api_agents` in Gym's config (ours: the agent's own name)
    module: str  # launched as `python -m <module>`
    flavour: str | None = None
    block: Mapping[str, Any] = field(default_factory=dict)  # the flavour YAML's agent keys (no wiring)
    import_dir: Path | None = None  # put first on PYTHONPATH (flavours import their package's `app`)
    requirements_file: Path | None = None
    extra_requirements: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.flavour is None) != (self.import_dir is None):
            raise ValueError(f"GymAgent {self.name!r}: a flavour and its import_dir come together")
        if self.extra_requirements and self.requirements_file is None:
            raise ValueError(f"GymAgent {self.name!r}: extra requirements need the file they came from")

    @property
    def own_venv(self) -> bool:
        return bool(self.extra_requirements)


def extra_requirements(path: Path) -> tuple[str, ...]:
    """The requirement lines of `path` other than nemo-gym itself (its `-e nemo-gym[dev] @ ../../`)."""
    if not path.is_file():
        return ()
    out: list[str] = []
    for line in installable_lines(path, lambda line: requirement_names(line, GYM_DISTRIBUTION)):
        if line.startswith("-"):
            raise NemoGymError(f"{path}: option line {line!r} is not supported in an agent's requirements", kind="env_not_found")
        try:
            Requirement(line)
        except InvalidRequirement as e:
            raise NemoGymError(f"{path}: {line!r} is not a PEP 508 requirement: {e}", kind="env_not_found") from e
        out.append(line)
    return tuple(out)


def agents_root() -> Path:
    spec = importlib.util.find_spec(GYM_AGENTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NemoGymError(f"Gym's `{GYM_AGENTS_PACKAGE}` is not installed: install nemo-gym", kind="env_not_found")
    return Path(list(spec.submodule_search_locations)[0])


def _flavour_block(yaml_path: Path) -> dict[str, Any] | None:
    """The one agent block of a flavour YAML when its entrypoint is a file of the package, else None."""
    doc = OmegaConf.to_container(OmegaConf.load(yaml_path), resolve=False)
    blocks = [
        inner
        for body in (doc.values() if isinstance(doc, dict) else [])
        if isinstance(body, Mapping) and isinstance(body.get(GYM_AGENTS_PACKAGE), Mapping)
        for inner in body[GYM_AGENTS_PACKAGE].values()
        if isinstance(inner, Mapping)
    ]
    if len(blocks) != 1:
        return None
    entrypoint = blocks[0].get("entrypoint")
    if not isinstance(entrypoint, str) or not entrypoint.endswith(".py") or entrypoint == "app.py":
        return None
    return dict(blocks[0]) if (yaml_path.parent.parent / entrypoint).is_file() else None


def agent_flavours(package_dir: Path) -> dict[str, dict[str, Any]]:
    """Flavour name -> agent block, for every `configs/*.yaml` naming its own entrypoint (sorted)."""
    found = {}
    for yaml_path in sorted((package_dir / "configs").glob("*.yaml")):
        block = _flavour_block(yaml_path)
        if block is not None:
            found[yaml_path.stem] = block
    return found


def resolve_agent(name: str, root: Path | None = None) -> GymAgent:
    """`env.agent` resolved (see the module docstring); `root` defaults to the installed agents."""
    if name in OUR_AGENT_MODULES:
        return GymAgent(name=name, package=name, module=OUR_AGENT_MODULES[name])
    package, _, flavour = name.partition(FLAVOUR_SEPARATOR)
    root = agents_root() if root is None else root
    folder = root / package
    if not (folder / "app.py").is_file():
        examples = sorted(p.parent.name for p in root.glob("*/app.py"))[:8]
        raise NemoGymError(
            f"env.agent={name!r}: {folder} holds no Gym agent (no app.py); use {sorted(OUR_AGENT_MODULES)} or a "
            f"folder under {root} (e.g. {', '.join(examples)}, ...)",
            kind="env_not_found",
        )
    requirements = folder / "requirements.txt"
    extras = extra_requirements(requirements)
    req_file = requirements if requirements.is_file() else None
    if not flavour:
        return GymAgent(name=name, package=package, module=f"{GYM_AGENTS_PACKAGE}.{package}.app",
                        requirements_file=req_file, extra_requirements=extras)
    flavours = agent_flavours(folder)
    if flavour not in flavours:
        valid = [f"{package}/{f}" for f in flavours] or ["(none: this package ships no flavours)"]
        raise NemoGymError(
            f"env.agent={name!r}: {package} has no flavour {flavour!r}; valid: {', '.join(valid)}", kind="env_not_found"
        )
    block = flavours[flavour]
    entry = Path(block["entrypoint"]).stem
    return GymAgent(
        name=name, package=package, module=f"{GYM_AGENTS_PACKAGE}.{package}.{entry}", flavour=flavour,
        block={k: v for k, v in block.items() if k not in WIRING_KEYS}, import_dir=folder,
        requirements_file=req_file, extra_requirements=extras,
    )
