"""The GRPO recipe schema: one pydantic model per section, validated at setup.

Each section's defaults live in its own model (this file only adds the GRPO loop, model and
cluster sections); recipes only override. `MasterConfig` is the one list of sections, and its
validators hold the rules across them. `load_master_config(path, overrides)` loads a YAML recipe
with its `defaults:` chain and Hydra-style overrides, then validates the whole recipe once: one
`ConfigError` lists every problem, each naming the key path, the value and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_rl.algorithms.async_config import AsyncRolloutsConfig, async_cross_check
from nemo_rl.data_plane import DataPlaneConfig
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.policy import LossConfig, PolicyConfig, PolicySettings
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.models.policy.config import dtype_mismatch
from nemo_rl.utils.checkpoint import CheckpointingConfig
from nemo_rl.utils.config import ConfigError, cross_section_problems, load_config, validate_section
from nemo_rl.utils.logger import LoggerConfig


class GRPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_prompts_per_step: int = Field(2, ge=1)
    num_generations_per_prompt: int = Field(4, ge=1, description="N rollouts per group (always N rows).")
    max_num_steps: int = Field(3, ge=1)
    seed: int = 42
    normalize_rewards: bool = True
    max_output_tokens: int = Field(64, ge=1, description="max tokens per model call of a rollout.")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    refit_probe_tokens: int = Field(
        32, ge=2, description="Length of the fixed probe sequence scored by engine and trainer after each refit."
    )
    refit_dir: str | None = Field(
        None,
        min_length=1,
        description=(
            "Folder the policy exports each refit's weights to and every vLLM worker reads them from; null "
            "means <logger.log_dir>/weights (`refit_root`). On a multi-node cluster it must be on a filesystem "
            "every node mounts at the same path: set-up proves it (a worker or the policy that cannot read the "
            "driver's marker there fails, naming this knob)."
        ),
    )
    async_rollouts: AsyncRolloutsConfig = AsyncRolloutsConfig()


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        None,
        description=(
            "Local HF model folder the policy trains and the workers serve. Null validates (a recipe may "
            "leave the model to its entry point: examples/run_grpo_single_controller.py builds the example's "
            "tiny model for it), but a run needs a folder."
        ),
    )


def model_path(model: ModelConfig) -> Path:
    """The model folder a run uses; a null `model.path` is a `ConfigError` naming the fix."""
    if model.path is None:
        raise ConfigError(
            "model.path is null: a run needs a local HF model folder (fix: set model.path=<folder>, or start "
            "the run from examples/run_grpo_single_controller.py, which builds the example's tiny model "
            "for a null model.path)",
            kind="missing_value",
        )
    return Path(model.path)


class ClusterConfig(BaseModel):
    """Ray for the run: a private local cluster, or the cluster named by `RAY_ADDRESS`.

    Which one is not a recipe key: a launcher that starts a cluster (ultra_launch.sh) says so
    through `RAY_ADDRESS`, which `nemo_rl.algorithms.setup.start_stack` honours.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: int = Field(
        2,
        ge=1,
        description=(
            "Logical CPUs of the private Ray cluster; when joining a cluster (RAY_ADDRESS), the "
            "minimum CPUs it must offer."
        ),
    )


class MasterConfig(BaseModel):
    """The whole recipe: one field per section, the one list of sections. A section the recipe
    leaves out (or null) takes its model's defaults; rules across sections are `_cross_section`'s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grpo: GRPOConfig
    loss_fn: LossConfig
    policy: PolicySettings
    model: ModelConfig
    generation: GenerationConfig
    env: NemoGymConfig
    token_capture: TokenCaptureConfig
    data_plane: DataPlaneConfig
    logger: LoggerConfig
    cluster: ClusterConfig
    checkpointing: CheckpointingConfig

    @model_validator(mode="before")
    @classmethod
    def _absent_sections_take_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {**data, **{name: {} for name in cls.model_fields if data.get(name) is None}}

    @model_validator(mode="after")
    def _cross_section(self) -> "MasterConfig":
        """Every rule between sections at once (the precision of policy and sampler, what async needs)."""
        problems: list[tuple[tuple[str, ...], str]] = []
        mismatch = dtype_mismatch(self.policy.dtype, self.generation.vllm.dtype)
        if mismatch:
            problems.append((("policy", "dtype"), mismatch))
        refused = async_cross_check(self.grpo.async_rollouts, num_prompts_per_step=self.grpo.num_prompts_per_step,
                                    capture_enabled=self.token_capture.enabled,
                                    on_component_failure=self.token_capture.on_component_failure)
        if refused:
            problems.append((("grpo", "async_rollouts", "enabled"), refused))
        if problems:
            raise cross_section_problems(type(self).__name__, problems)
        return self


REFIT_DIR_KNOB = "grpo.refit_dir"


def refit_root(cfg: MasterConfig) -> Path:
    """The refit weights folder, absolute (actors on other nodes resolve no relative path alike)."""
    folder = Path(cfg.grpo.refit_dir) if cfg.grpo.refit_dir is not None else Path(cfg.logger.log_dir) / "weights"
    return folder.resolve()


def validate_master(raw: dict) -> MasterConfig:
    """The recipe validated once, or ONE `ConfigError` listing every problem of every section."""
    return validate_section(MasterConfig, raw, "")


def policy_config(cfg: MasterConfig, model_path: str, engine_flavor: Literal["cpu", "gpu"]) -> PolicyConfig:
    """The policy worker's config: the recipe's validated `policy:` settings, the model folder and the engine flavor."""
    return PolicyConfig.for_run(cfg.policy, model_path, engine_flavor)


def load_master_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> MasterConfig:
    return validate_master(load_config(path, list(overrides), schema=MasterConfig))
