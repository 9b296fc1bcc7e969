"""Policy and loss configuration: the only home of their defaults.

`PolicySettings` is the recipe's `policy:` section; `PolicyConfig` adds what set-up resolves (the
model folder, the engine flavor) and is what the policy worker runs with.

Invariants: unknown keys are rejected (extra="forbid"); every numeric field is range-checked
here, so call sites read fields directly and never supply fallbacks.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

# Which logprobs stand for the behaviour policy in the loss (see LossConfig.behaviour_logprobs).
BehaviourLogprobs = Literal["captured", "recomputed"]


class PolicySettings(BaseModel):
    """The recipe's `policy:` section: how the torch policy is loaded, stepped and called."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Keys a recipe sets elsewhere, each with why and where (the section validator names the fix).
    SET_ELSEWHERE: ClassVar[dict[str, str]] = {
        "model_path": "the policy weights come from the model section (fix: set model.path=<folder> instead)",
        "engine_flavor": "setup sets it from generation.vllm.flavor (fix: remove it; set generation.vllm.flavor instead)",
    }

    learning_rate: float = Field(default=1e-4, gt=0.0)
    # Linear warmup: train step k (1-based) uses learning_rate * min(1, k / lr_warmup_steps); 0 =
    # the full rate from the first step. A fresh AdamW moves every weight by about lr on its first
    # steps whatever the gradient's size, so a small model at a rate that learns needs the ramp.
    lr_warmup_steps: int = Field(default=0, ge=0)
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    # Sequences per forward/backward pass; gradients accumulate over a step's micro-batches.
    train_micro_batch_size: int = Field(default=8, ge=1)
    # torch intra-op threads of the process that holds the policy.
    num_threads: int = Field(default=1, ge=1)
    seed: int = 42
    # Deadline of one call into a remote PolicyWorker (a train step included).
    call_timeout_s: float = Field(default=600.0, gt=0.0)
    # Parameter dtype of the loaded model (logprobs and the loss are computed in float32 either
    # way). Must equal generation.vllm.dtype (`dtype_mismatch`), so the trainer recomputes the
    # sampler's logprobs at the sampler's precision.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Where the model lives: cuda takes one GPU of the Ray cluster for the policy actor (the vLLM
    # workers take others); cuda on a host without a visible GPU is a PolicyLoadError (device) at load.
    device: Literal["cpu", "cuda"] = "cpu"
    # Router replay (R3): "replay" makes each MoE router of the policy follow the batch's
    # routed_experts where a token has them (docs/design-docs/policy.md, "Router replay (R3)");
    # "off" routes freely and ignores them. "replay" on a dense model is refused at load.
    router_replay: Literal["off", "replay"] = "off"


class PolicyConfig(PolicySettings):
    """What the policy worker runs with: the recipe's settings, the model folder and the engine flavor."""

    # A local Hugging Face model folder (config.json + safetensors); no hub access is assumed.
    model_path: str = Field(min_length=1)
    # The vLLM build that reloads the exported weights; setup sets it from the resolved
    # generation.vllm.flavor (a recipe does not). "cpu" refuses tied input/output embeddings: the
    # CPU engine keeps a packed lm_head that a reload of tied weights leaves stale.
    engine_flavor: Literal["cpu", "gpu"] = "cpu"

    @classmethod
    def for_run(cls, settings: PolicySettings, model_path: str, engine_flavor: Literal["cpu", "gpu"]) -> "PolicyConfig":
        """The run's config from the recipe's settings (validated once, with the recipe) and the two
        values set-up resolves: the model folder (an absolute path) and the engine flavor."""
        return cls.model_construct(**dict(settings), model_path=model_path, engine_flavor=engine_flavor)


class LossConfig(BaseModel):
    """GRPO clipped-surrogate settings: the ratio is clamped to [1 - min, 1 + max], and each
    token's term is weighted by the truncated importance weight of its behaviour policy
    (docs/guides/off-policy-correction.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ratio_clip_min: float = Field(default=0.2, ge=0.0, lt=1.0)
    ratio_clip_max: float = Field(default=0.2, ge=0.0)
    # Which logprobs stand for the behaviour policy mu that sampled each token. "captured": the
    # generation logprobs the row carries (with token capture on, the exact engine logprobs of
    # the weight version that served the token's call; with it off, Gym's echoed logprobs, the
    # only record of the sampler on that path), so w = min(exp(prev - mu), is_truncation).
    # "recomputed": mu = the trainer's own pre-update logprobs, w = 1 (the on-policy loss).
    # One default for both paths: each row carries its sampler's logprobs either way.
    behaviour_logprobs: BehaviourLogprobs = "captured"
    # C of the truncated importance weight (TIS): caps how much one stale or mismatched token can
    # weigh. Must exceed 1: C <= 1 would also shrink tokens the trainer likes more than the
    # sampler did. 2.0 as in TIS (Yao et al., 2025, "Your efficient RL framework secretly brings
    # you off-policy RL training").
    is_truncation: float = Field(default=2.0, gt=1.0, allow_inf_nan=False)


def dtype_mismatch(policy_dtype: str, generation_dtype: str) -> str | None:
    """The error message when the policy and the sampler run at different precisions, else None.

    A pure check over two sections (policy.dtype, generation.vllm.dtype); the recipe validator
    raises it as a config error.
    """
    if policy_dtype == generation_dtype:
        return None
    return (
        f"policy.dtype={policy_dtype!r} != generation.vllm.dtype={generation_dtype!r}: the trainer "
        "would recompute the sampler's logprobs at another precision and token_mult_prob_error "
        f"drifts from 1 (fix: set both to {generation_dtype!r}, or both to {policy_dtype!r})"
    )
