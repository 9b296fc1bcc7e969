"""LossFn: what the policy calls to turn one micro-batch's logprobs into a loss.

The policy does not know which algorithm trains it: `PolicyCore.train_step(batch, loss_fn)`
takes the loss as an argument; this package never imports `nemo_rl.algorithms`. A `LossFn` is
called once per micro-batch holding a masked token, with [B, T] logprobs, advantages, the mask
and `normalizer` (the WHOLE batch's masked-token count), and returns `(loss, metrics)`, each
metric a micro-batch share of a batch value (the core sums them), except a name ending in
`_max`: a micro-batch maximum (the core keeps the largest, `combine_metric`); `CORE_METRICS`
names are reserved. It must be picklable: it crosses into the Ray policy actor with every step.
See docs/design-docs/policy.md, "The `LossFn` contract".
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from nemo_rl.models.policy.config import LossConfig
from nemo_rl.models.policy.errors import LossFnError

# Metrics PolicyCore.train_step computes itself; a LossFn may not return these names.
CORE_METRICS = frozenset(
    {"grad_norm", "lr", "token_mult_prob_error", "gen_kl_error", "num_tokens", "num_samples"}
)

# A metric named `<x>_max` is a maximum: micro-batch maxima combine by max, never by sum.
MAX_METRIC_SUFFIX = "_max"


def combine_metric(name: str, total: float | None, part: float) -> float:
    """The batch value of metric `name` so far (`total`, None before the first micro-batch) with one more part."""
    if total is None:
        return part
    return max(total, part) if name.endswith(MAX_METRIC_SUFFIX) else total + part


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
