"""Trainer/sampler agreement metrics and the masked-tensor helpers every loss shares.

Pure tensor functions; they live with the policy because it reports them every step whatever
loss it is given. `token_mult_prob_error` = mean over masked tokens of exp(|train - gen|)
(exactly 1.0 when the trainer reproduces the sampler); `gen_kl_error` = mean of exp(d) - d - 1,
d = train - gen (the k3 estimator of KL(P_gen || P_train), >= 0, 0 iff equal).
Invariants: positions outside the mask never influence a result, even inf or nan (`masked_sum`
selects, never multiplies); a mask that is not 0/1 or mis-shaped is a `LossInputError`, an
all-zero mask an `EmptyMaskError`.
"""

from __future__ import annotations

import torch

from nemo_rl.models.policy.errors import EmptyMaskError, LossInputError


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """`mask` as a bool tensor shaped like `like` (named `name` in errors); never empty."""
    if mask.shape != like.shape:
        raise LossInputError(
            f"mask shape {tuple(mask.shape)} != {name} shape {tuple(like.shape)}"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise LossInputError("mask must hold only 0 and 1")
        mask = mask != 0
    if not bool(mask.any()):
        raise EmptyMaskError("mask selects no token; a masked mean over zero tokens is undefined")
    return mask


def check_same_shape(ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every keyword tensor has `ref`'s shape (the keyword names the offender)."""
    for name, t in tensors.items():
        if t.shape != ref.shape:
            raise LossInputError(
                f"{name} shape {tuple(t.shape)} != expected {tuple(ref.shape)}"
            )


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where the bool `mask` is set."""
    # torch.where (not multiplication) so inf/nan at unselected positions cannot leak in.
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def mismatch_sums(
    train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked sums (float64) of exp(|d|) and of exp(d) - d - 1, d = train - gen."""
    d = (train_logprobs - gen_logprobs).detach().to(torch.float64)
    mult = masked_sum(torch.exp(d.abs()), mask)
    k3 = masked_sum(torch.exp(d) - d - 1.0, mask)
    return mult, k3


def token_mult_prob_error(
    train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """Mean over masked tokens of exp(|train - gen|); 1.0 means the logprobs agree exactly."""
    check_same_shape(train_logprobs, gen_logprobs=gen_logprobs)
    m = as_bool_mask(mask, train_logprobs, "train_logprobs")
    mult, _ = mismatch_sums(train_logprobs, gen_logprobs, m)
    return float(mult / m.sum())


def gen_kl_error(
    train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """k3 estimate of KL(P_gen || P_train): mean over masked tokens of exp(d) - d - 1, d = t - g."""
    check_same_shape(train_logprobs, gen_logprobs=gen_logprobs)
    m = as_bool_mask(mask, train_logprobs, "train_logprobs")
    _, k3 = mismatch_sums(train_logprobs, gen_logprobs, m)
    return float(k3 / m.sum())
