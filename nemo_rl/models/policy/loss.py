"""LossFn: what the policy calls to turn one micro-batch's logprobs into a loss.

The policy does not know which algorithm trains it: `PolicyCore.train_step(batch, loss_fn)`
takes the loss as an argument (the GRPO clipped loss is `nemo_rl.algorithms.grpo.ClippedPGLossFn`).
This package never imports `nemo_rl.algorithms`.

Contract of a `LossFn` (called once per micro-batch that holds at least one masked token):
- keyword inputs, all [B, T] float32 except `advantages` ([B], one per sample) and `mask`
  ([B, T] bool, True on trained tokens):
  `curr_logprobs` (carries gradients), `prev_logprobs` (the same policy before this step, no
  gradients), `generation_logprobs` (the sampler's; 0.0 off the mask), `advantages`, `mask`, and
  `normalizer`: the number of masked tokens in the WHOLE batch;
- returns `(loss, metrics)`: `loss` a 0-dim tensor the core back-propagates; `metrics` a dict of
  floats, each a micro-batch SHARE of a batch value (divide by `normalizer`, not by this
  micro-batch's count), because the core reports the sum over micro-batches. The names the core
  reports itself (`CORE_METRICS`) are reserved;
- must be picklable (a module-level function, or a frozen dataclass with `__call__`): it crosses
  into the Ray policy actor with every `train_step`.
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
