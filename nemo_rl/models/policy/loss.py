"""The loss's contract and its tensor math: `LossFn`, token logprobs, masked mismatch sums.

The policy does not know which algorithm trains it: `PolicyCore.train_step(batch, loss_fn)` takes
the loss as an argument (this package never imports `nemo_rl.algorithms`). A `LossFn` is called
once per micro-batch (`micro_batches`) holding a masked token, with right-padded [B, T] logprobs
(`pad_right`; `gather_token_logprobs`, column 0 is 0.0), advantages, the mask and `normalizer`
(the WHOLE batch's masked-token count); it returns `(loss, metrics)`, each metric a micro-batch
share the core sums, a `_max` name a maximum (`combine_metric`), `CORE_METRICS` reserved; it must
be picklable. The policy reports `token_mult_prob_error` (mean exp|train - gen|, 1.0 iff equal)
and `gen_kl_error` (k3) every step. Invariant: masked-out positions never influence a result,
even inf or nan (`masked_sum` selects); a bad mask is a `LossInputError`, an empty one an
`EmptyMaskError`. See docs/design-docs/policy.md, "The `LossFn` contract".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from nemo_rl.models.policy.config import LossConfig
from nemo_rl.models.policy.errors import EmptyMaskError, LossFnError, LossInputError

# Metrics PolicyCore.train_step computes itself; a LossFn may not return these names.
CORE_METRICS = frozenset(
    {"grad_norm", "lr", "token_mult_prob_error", "gen_kl_error", "num_tokens", "num_samples"}
)

# A metric named `<x>_max` is a maximum: micro-batch maxima combine by max, never by sum.
MAX_METRIC_SUFFIX = "_max"
MIN_METRIC_SUFFIX = "_min"


def combine_metric(name: str, total: float | None, part: float) -> float:
    """The batch value of metric `name` so far (`total`, None before the first micro-batch) with one more part."""
    if total is None:
        return part
    if name.endswith(MAX_METRIC_SUFFIX):
        return max(total, part)
    if name.endswith(MIN_METRIC_SUFFIX):
        return min(total, part)
    return total + part


@runtime_checkable
class LossFn(Protocol):
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
        """The micro-batch's loss share and its metric shares (see the module docstring)."""
        ...


def check_loss_fn(loss_fn: object) -> LossFn:
    """`loss_fn` if it is callable; a named `LossFnError` with the fix otherwise."""
    if isinstance(loss_fn, LossConfig):
        raise LossFnError(
            "train_step got a LossConfig (the loss_fn: section), not a loss function; the policy "
            "no longer builds the GRPO loss itself (fix: pass "
            "nemo_rl.algorithms.grpo.ClippedPGLossFn.from_config(cfg.loss_fn))"
        )
    if not callable(loss_fn):
        raise LossFnError(
            f"train_step got loss_fn={loss_fn!r} ({type(loss_fn).__name__}), which is not callable "
            "(fix: pass a LossFn, e.g. nemo_rl.algorithms.grpo.ClippedPGLossFn.from_config(cfg.loss_fn))"
        )
    return loss_fn  # type: ignore[return-value]


def check_loss_output(out: object, loss_fn: object) -> tuple[torch.Tensor, dict[str, float]]:
    """The `(loss, metrics)` a LossFn returned, checked against the contract."""
    name = getattr(loss_fn, "__qualname__", type(loss_fn).__qualname__)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise LossFnError(f"loss_fn {name} returned {type(out).__name__}; a LossFn returns (loss, metrics)")
    loss, metrics = out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise LossFnError(f"loss_fn {name} returned a loss that is not a 0-dim tensor: {loss!r}")
    if not isinstance(metrics, dict):
        raise LossFnError(f"loss_fn {name} returned metrics of type {type(metrics).__name__}; expected a dict")
    reserved = sorted(CORE_METRICS & set(metrics))
    if reserved:
        raise LossFnError(
            f"loss_fn {name} returned metric(s) {reserved} that the policy reports itself "
            "(fix: rename them in the loss)"
        )
    return loss, metrics


# --- token logprobs and the micro-batch split (pure tensor helpers) ---------------------


def pad_right(
    rows: Sequence[Sequence[float]], pad: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged rows into [B, max_len] (right-padded) plus a 0/1 long attention mask.

    Right padding keeps every real token's position id and causal context, so its logits match
    an unpadded forward; the mask is 1 exactly on real positions."""
    if not rows:
        raise ValueError("pad_right needs at least one row")
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=dtype)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        attn[i, : len(row)] = 1
    return out, attn


def micro_batches(n: int, size: int) -> list[range]:
    """Consecutive index ranges of at most `size` covering range(n)."""
    if size < 1:
        raise ValueError(f"micro-batch size={size} must be >= 1")
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def gather_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Logprob of each token given its prefix, [B, T]; column 0 is 0.0."""
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    logits = logits[:, :-1].float()
    target = input_ids[:, 1:].unsqueeze(-1)
    # gather - logsumexp avoids materialising a second [B, T, V] log-softmax tensor.
    picked = logits.gather(-1, target).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    first = torch.zeros((input_ids.shape[0], 1), dtype=picked.dtype, device=picked.device)
    return torch.cat([first, picked], dim=1)


# --- masked sums and the trainer/sampler mismatch metrics every loss shares -------------


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
