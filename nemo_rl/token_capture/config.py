"""The `token_capture` recipe section: the one and only home of token-capture defaults.

`TokenCaptureConfig` is frozen and rejects unknown keys; no other module carries a fallback.
Types are strict (a YAML "false" is not a bool, a float not an int); timeouts are finite and
> 0, counts bounded below, partition names non-empty `[A-Za-z0-9_-]` tokens, and the
control-token variable a valid environment-variable name. Capture rows reach the policy only
through the train partition: `train_partition: null` (the removed Ray-values path) is refused by
name with its fix. The bearer token itself never lives in config, only the name
of the variable that holds it. Build it with `validate_section(TokenCaptureConfig, ...)`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic_core import PydanticCustomError

PartitionName = Annotated[str, StringConstraints(min_length=1, pattern=r"^[A-Za-z0-9_-]+$")]


class TokenCaptureConfig(BaseModel):
    """Settings for exact-token capture on the agentic GRPO path."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = Field(
        default=False,
        description=(
            "Turn exact-token capture on. When false, every legacy path runs unchanged and "
            "produces byte-identical rows."
        ),
    )
    num_finalizer_workers: int = Field(
        default=1,
        ge=1,
        description=(
            "Number of finalizer actors that fetch staged deltas, verify digests and "
            "linearize rollouts into training rows."
        ),
    )
    staging_partition: str = Field(
        default="token_capture_staging",
        min_length=1,
        pattern=r"^[A-Za-z0-9_-]+$",
        description=(
            "TransferQueue partition the vLLM worker stages captured deltas into, keyed by "
            "`rollout_id/model_call_id`."
        ),
    )
    train_partition: PartitionName = Field(
        default="token_capture_train",
        description=(
            "TransferQueue partition the finalizer actors write each kept row's tokens, mask, logprobs "
            "and routes into (keyed by `rollout_id#chain_index`, with a content digest); the policy "
            "worker reads and verifies them there, so the driver handles row references and metrics, "
            "never tokens. The loop clears a step's keys after its train step."
        ),
    )

    @field_validator("train_partition", mode="before")
    @classmethod
    def _refuse_null_partition(cls, value: object) -> object:
        if value is None:
            raise PydanticCustomError(
                "removed_value",
                "null no longer exists: capture rows reach the policy only through the train partition "
                "(the Ray-values path through the driver was removed)",
                {"fix": "remove {path} from the recipe (default token_capture_train) or set it to a partition name"},
            )
        return value

    manifest_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Deadline in seconds for fetching one rollout's manifest from Gym.",
    )
    finalize_timeout_s: float = Field(
        default=120.0,
        gt=0.0,
        allow_inf_nan=False,
        description=(
            "Deadline in seconds for one finalizer call (fetch staged deltas, verify, "
            "linearize a group); past it the finalizer is reported dead by name."
        ),
    )
    stage_timeout_s: float = Field(
        default=10.0,
        gt=0.0,
        allow_inf_nan=False,
        description=(
            "Deadline in seconds for one staging write or read against TransferQueue. A row not "
            "written in time is never reported staged (before_reply: the call gets capture_failed "
            "coordinates; behind_reply: the served-call report names it). Under behind_reply it "
            "is also how long a worker waits for a staging_chain parent another worker is still "
            "writing."
        ),
    )
    stage_write: Literal["behind_reply", "before_reply"] = Field(
        default="behind_reply",
        description=(
            "When a worker's staging write happens. behind_reply: the response leaves once the "
            "staged row is queued; a background writer batches queued rows into one TransferQueue "
            "write, and the worker's served-call report (which the driver takes before any "
            "finalizer reads) waits for them, reporting rows that did not land as not staged. "
            "before_reply: the response waits for its own write (Gym's StagingSink contract to "
            "the letter; one write per call on the response path)."
        ),
    )
    prefix_cache_max_tokens: int = Field(
        default=1_000_000,
        ge=0,
        description=(
            "Bound, in tokens, of the worker-side cache of staging-chain prefixes it has "
            "already served (keyed by chain hash), so a long rollout does not re-fetch its "
            "whole chain every turn. 0 disables the cache (every turn fetches its chain)."
        ),
    )
    control_token_env: str = Field(
        default="NRL_TOKEN_CAPTURE_CONTROL_TOKEN",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=(
            "Name of the environment variable holding the bearer token for Gym's manifest "
            "(rollout control) route."
        ),
    )
    retire_after_commit: bool = Field(
        default=True,
        description=(
            "After a group's rows are committed, clear its staged TransferQueue keys and "
            "retire its ledger files so memory and disk stay bounded over a long run."
        ),
    )
    branch_policy: Literal["terminal_chain", "all_chains"] = Field(
        default="all_chains",
        description=(
            "Which verified chains of a rollout become training rows. `all_chains`: every verified "
            "chain (branches after a history rewrite, retried siblings), each with the rollout's "
            "advantage, every generated token in the loss at most once. `terminal_chain`: only the "
            "chain that ends at the scored response (NeMo-Gym's default)."
        ),
    )
    mixed_weight_version_policy: Literal["allow", "reject"] = Field(
        default="allow",
        description=(
            "A chain whose calls were served by different policy versions: `allow` trains it (each "
            "token keeps its own version), `reject` drops the chain (a rejected terminal chain makes "
            "the rollout a `mixed_weight_version` placeholder)."
        ),
    )
    min_valid_fraction_per_group: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description=(
            "A GRPO group whose kept rollouts are fewer than this fraction of N is dropped whole "
            "(every rollout becomes a `group_below_min_valid_fraction` placeholder, counted). "
            "0.0 keeps every group that has at least one kept rollout."
        ),
    )
    max_consecutive_masked_steps: int = Field(
        default=3,
        ge=1,
        description=(
            "A step in which every rollout is a placeholder is logged loudly, counted and skipped "
            "(no train step, no refit); the run stops with MaskedStepsError after this many such "
            "steps in a row."
        ),
    )
    on_component_failure: Literal["continue", "abort"] = Field(
        default="abort",
        description=(
            "What a component death mid-run does (Gym server, vLLM worker, TransferQueue actor, finalizer "
            "actor; found by the component watch within component_check_interval_s). Either way the "
            "rollouts in flight become `component_failed` placeholders naming the component and the step "
            "is accounted and logged. `abort`: the run then stops with ComponentFailedError naming it. "
            "`continue`: dead Gym servers are restarted on their ports and finalizer actors replaced "
            "before the next step; while a vLLM worker or TransferQueue actor stays dead, steps are "
            "masked and the run stops after max_consecutive_masked_steps."
        ),
    )
    component_check_interval_s: float = Field(
        default=1.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Seconds between two liveness rounds of the component watch while a step runs.",
    )
    component_probe_timeout_s: float = Field(
        default=5.0,
        gt=0.0,
        allow_inf_nan=False,
        description=(
            "Deadline of one liveness probe; a component that does not answer in time counts as busy, "
            "not dead (each call into it has its own deadline)."
        ),
    )
