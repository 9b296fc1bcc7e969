"""GRPO math: group-normalised advantages, the clipped surrogate loss with its off-policy weight.

Pure functions; no model, no Ray, no I/O. `compute_group_advantages`, `grpo_clipped_loss`,
`truncated_is_weights` and `ClippedPGLossFn` (the policy's `LossFn`, picklable into the policy
actor); the mismatch metrics are re-exported from `nemo_rl.models.policy.worker`.
Invariants: invalid samples (placeholders) get advantage exactly 0.0 and never enter the
statistics; a group without signal is all 0.0; the loss is a token-level mean over the whole
batch's masked tokens (pass `normalizer` per micro-batch); the ratio is pi_theta / pi_prox
(the trainer's recomputed prev); the behaviour logprobs enter only through the detached weight
w = min(exp(prev - behaviour), is_truncation), and w = 1 exactly when mode is "recomputed"; a
masked token without a finite behaviour logprob is a `PolicyStepError` (`loss_input`), never w = 1;
positions outside the mask never influence a result; an all-zero mask is its `empty_mask` kind.
Formulas: docs/design-docs/policy.md, "GRPO math"; docs/guides/off-policy-correction.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch

from nemo_rl.models.policy.config import BehaviourLogprobs, LossConfig
from nemo_rl.models.policy.errors import PolicyStepError
from nemo_rl.models.policy.worker import (
    as_bool_mask,
    check_same_shape,
    gen_kl_error,
    masked_sum,
    mismatch_sums,
    token_mult_prob_error,
)

ADVANTAGE_EPS = 1e-6

# The inputs of a GRPO function are inconsistent (shape, length, range).
GRPOInputError = PolicyStepError

__all__ = [
    "ADVANTAGE_EPS",
    "ClippedPGLossFn",
    "GRPOInputError",
    "compute_group_advantages",
    "gen_kl_error",
    "grpo_clipped_loss",
    "is_weight_metrics",
    "token_mult_prob_error",
    "truncated_is_weights",
]


def _group_stats(values: list[float]) -> tuple[float, float]:
    """Mean and Bessel-corrected std of `values` (std 0.0 for fewer than two values)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var)


def compute_group_advantages(
    rewards: list[float], group_size: int, normalize: bool, valid: list[bool]
) -> list[float]:
    """Per-sample advantages, group by group (see the module docstring for the rules)."""
    if group_size < 1:
        raise GRPOInputError(f"group_size={group_size} must be >= 1", kind="loss_input")
    if len(rewards) != len(valid):
        raise GRPOInputError(
            f"len(rewards)={len(rewards)} != len(valid)={len(valid)}; pass one flag per sample", kind="loss_input"
        )
    if len(rewards) % group_size != 0:
        raise GRPOInputError(
            f"len(rewards)={len(rewards)} is not a multiple of group_size={group_size}; "
            "every group must keep all its samples (use placeholders with valid=False)", kind="loss_input"
        )
    advantages = [0.0] * len(rewards)
    for start in range(0, len(rewards), group_size):
        idx = [i for i in range(start, start + group_size) if valid[i]]
        vals = [float(rewards[i]) for i in idx]
        for i, v in zip(idx, vals):
            if not math.isfinite(v):
                raise GRPOInputError(
                    f"rewards[{i}]={v} is not finite for a valid sample; "
                    "mark the sample invalid or fix the reward function", kind="loss_input"
                )
        if not vals or min(vals) == max(vals):
            continue
        mean, std = _group_stats(vals)
        scale = 1.0 / (std + ADVANTAGE_EPS) if normalize else 1.0
        for i, v in zip(idx, vals):
            advantages[i] = (v - mean) * scale
    return advantages


def grpo_clipped_loss(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ratio_clip_min: float,
    ratio_clip_max: float,
    normalizer: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss over masked tokens and its metrics.

    Shapes: logprobs and mask are [B, T]; advantages are [B, T] (per token) or [B] (per
    sample, broadcast over its tokens). `normalizer` is the token count the sums are divided
    by (default: this mask's count). `is_weights` ([B, T], detached here) multiplies each
    token's term (the off-policy weight of `truncated_is_weights`); None leaves the terms
    as they are, bit for bit. Metrics ("loss", "probs_ratio", "clip_fraction" and, when
    `gen_logprobs` is given, "token_mult_prob_error", "gen_kl_error" of `prev_logprobs`, the
    pre-update policy, against `gen_logprobs`) use the same
    normalizer, so per-micro-batch metrics computed with the batch count sum to the batch value;
    "num_tokens" is this mask's count.
    """
    if not 0.0 <= ratio_clip_min < 1.0:
        raise GRPOInputError(f"ratio_clip_min={ratio_clip_min} must be in [0, 1)", kind="loss_input")
    if ratio_clip_max < 0.0:
        raise GRPOInputError(f"ratio_clip_max={ratio_clip_max} must be >= 0", kind="loss_input")
    if curr_logprobs.dim() != 2:
        raise GRPOInputError(
            f"curr_logprobs must be [B, T], got shape {tuple(curr_logprobs.shape)}", kind="loss_input"
        )
    check_same_shape(curr_logprobs, prev_logprobs=prev_logprobs)
    if gen_logprobs is not None:
        check_same_shape(curr_logprobs, gen_logprobs=gen_logprobs)
    if advantages.dim() == 1 and advantages.shape[0] == curr_logprobs.shape[0]:
        advantages = advantages.unsqueeze(1).expand_as(curr_logprobs)
    check_same_shape(curr_logprobs, advantages=advantages)
    if is_weights is not None:
        check_same_shape(curr_logprobs, is_weights=is_weights)
    m = as_bool_mask(mask, curr_logprobs, "curr_logprobs")
    num_tokens = int(m.sum())
    denom = float(num_tokens) if normalizer is None else float(normalizer)
    if not denom >= num_tokens:
        raise GRPOInputError(
            f"normalizer={normalizer} is smaller than the mask's token count {num_tokens}; "
            "pass the whole batch's masked-token count", kind="loss_input"
        )

    adv = advantages.detach().to(curr_logprobs.dtype)
    # Zero the log-ratio outside the mask so exp() cannot overflow into inf * 0 = nan.
    log_ratio = torch.where(m, curr_logprobs - prev_logprobs.detach(), torch.zeros_like(adv))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - ratio_clip_min, 1.0 + ratio_clip_max)
    unclipped_term = -adv * ratio
    clipped_term = -adv * clipped
    per_token = torch.maximum(unclipped_term, clipped_term)
    if is_weights is not None:
        # 1.0 off the mask: a nan weight there would turn the zero gradient masked_sum sends
        # back into nan (0 * nan), although the forward value never reads it.
        w = torch.where(m, is_weights.detach().to(per_token.dtype), torch.ones_like(per_token))
        per_token = per_token * w
    loss = masked_sum(per_token, m) / denom

    with torch.no_grad():
        clip_active = (clipped_term > unclipped_term).to(per_token.dtype)
        metrics = {
            "loss": float(loss),
            "probs_ratio": float(masked_sum(ratio, m) / denom),
            "clip_fraction": float(masked_sum(clip_active, m) / denom),
            "num_tokens": float(num_tokens),
        }
        if gen_logprobs is not None:
            mult, k3 = mismatch_sums(prev_logprobs, gen_logprobs, m)
            metrics["token_mult_prob_error"] = float(mult / denom)
            metrics["gen_kl_error"] = float(k3 / denom)
    return loss, metrics


def truncated_is_weights(
    prev_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    is_truncation: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token truncated importance weights of the proximal policy over the behaviour policy.

    Returns `(w, truncated)`, both [B, T] and without gradients: on masked tokens
    w = min(exp(prev - behaviour), is_truncation) and truncated = exp(prev - behaviour) >
    is_truncation; off the mask w = 1.0 and truncated = False. Each token is weighed against
    its own behaviour logprob (the version that sampled it), never a row or batch summary. A
    masked token whose behaviour logprob is not finite or is > 0 has no usable record of its
    sampler: a `loss_input` `PolicyStepError` naming its position (never a silent w = 1).
    """
    if not is_truncation > 1.0 or not math.isfinite(is_truncation):
        raise GRPOInputError(f"is_truncation={is_truncation} must be a finite number > 1", kind="loss_input")
    check_same_shape(prev_logprobs, behaviour_logprobs=behaviour_logprobs)
    m = as_bool_mask(mask, prev_logprobs, "prev_logprobs")
    with torch.no_grad():
        bad = m & ~(torch.isfinite(behaviour_logprobs) & (behaviour_logprobs <= 0.0))
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            raise GRPOInputError(
                f"behaviour logprob [{b}, {t}]={float(behaviour_logprobs[b, t])} on a masked token "
                f"({int(bad.sum())} such token(s)): every trained token needs the finite logprob (<= 0) "
                "of the engine that sampled it (fix: drop the row, or set loss_fn.behaviour_logprobs="
                "recomputed to train without the off-policy correction)", kind="loss_input"
            )
        # Zero the log-weight off the mask so exp() sees no garbage (w is 1.0 there).
        log_w = torch.where(m, prev_logprobs.detach() - behaviour_logprobs, torch.zeros_like(prev_logprobs))
        raw = torch.exp(log_w)
        truncated = m & (raw > is_truncation)
        return raw.clamp(max=is_truncation), truncated


def is_weight_metrics(
    weights: torch.Tensor, truncated: torch.Tensor, mask: torch.Tensor, normalizer: float
) -> dict[str, float]:
    """`is_weight_mean` and `is_truncated_fraction` as shares over `normalizer` tokens; `is_weight_max`
    and `is_weight_min` over this mask's tokens (the policy combines micro-batches by max and min).
    The min is never clamped: it shows the tokens the trainer now finds far less likely than their
    sampler did, which dominate `token_mult_prob_error` while leaving the mean and max near 1."""
    m = as_bool_mask(mask, weights, "is_weights")
    with torch.no_grad():
        return {
            "is_weight_mean": float(masked_sum(weights.to(torch.float64), m) / normalizer),
            "is_weight_max": float(weights[m].max()),
            "is_weight_min": float(weights[m].min()),
            "is_truncated_fraction": float(masked_sum(truncated.to(torch.float64), m) / normalizer),
        }


_BEHAVIOUR_MODES = get_args(BehaviourLogprobs)


@dataclass(frozen=True)
class ClippedPGLossFn:
    """The GRPO clipped surrogate with the truncated off-policy weight, as a policy `LossFn`.

    Fields mirror `LossConfig` (build with `from_config`; the defaults live there only).
    "captured": mu = `generation_logprobs` (the row's sampler record), each token weighted by
    `truncated_is_weights`; "recomputed": w = 1, today's on-policy loss bit for bit.
    """

    ratio_clip_min: float
    ratio_clip_max: float
    behaviour_logprobs: BehaviourLogprobs
    is_truncation: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio_clip_min < 1.0:
            raise GRPOInputError(
                f"loss_fn.ratio_clip_min={self.ratio_clip_min} must be in [0, 1)", kind="loss_input"
            )
        if self.ratio_clip_max < 0.0:
            raise GRPOInputError(f"loss_fn.ratio_clip_max={self.ratio_clip_max} must be >= 0", kind="loss_input")
        if self.behaviour_logprobs not in _BEHAVIOUR_MODES:
            raise GRPOInputError(
                f"loss_fn.behaviour_logprobs={self.behaviour_logprobs!r} must be one of "
                f"{list(_BEHAVIOUR_MODES)} (fix: set it to one of those)", kind="loss_input"
            )
        if not (self.is_truncation > 1.0 and math.isfinite(self.is_truncation)):
            raise GRPOInputError(
                f"loss_fn.is_truncation={self.is_truncation} must be a finite number > 1 "
                "(fix: set loss_fn.is_truncation to a finite value greater than 1)", kind="loss_input"
            )

    @classmethod
    def from_config(cls, cfg: LossConfig) -> ClippedPGLossFn:
        return cls(
            ratio_clip_min=cfg.ratio_clip_min,
            ratio_clip_max=cfg.ratio_clip_max,
            behaviour_logprobs=cfg.behaviour_logprobs,
            is_truncation=cfg.is_truncation,
        )

    def __call__(
        self,
        *,
        curr_logprobs: torch.Tensor,
        prev_logprobs: torch.Tensor,
        generation_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        normalizer: int,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if self.behaviour_logprobs == "captured":
            weights, truncated = truncated_is_weights(
                prev_logprobs, generation_logprobs, mask, self.is_truncation
            )
            is_weights: torch.Tensor | None = weights
        else:
            # No weight at all (not a tensor of ones): the on-policy loss's exact code path.
            weights = torch.ones_like(prev_logprobs)
            truncated = torch.zeros_like(prev_logprobs, dtype=torch.bool)
            is_weights = None
        # The mismatch metrics are the policy's (it reports them for every loss).
        loss, m = grpo_clipped_loss(
            curr_logprobs,
            prev_logprobs,
            None,
            advantages,
            mask,
            self.ratio_clip_min,
            self.ratio_clip_max,
            normalizer=normalizer,
            is_weights=is_weights,
        )
        return loss, {
            "loss": m["loss"],
            "clip_fraction": m["clip_fraction"],
            **is_weight_metrics(weights, truncated, mask, normalizer),
        }
