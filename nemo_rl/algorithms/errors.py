"""The GRPO driver's named failures (set-up, refit and the loop raise them; each message names the
step or the phase and the cause): one fatal family, `GRPOError`, whose `kind` says which. Three
members the loop catches by name, or that carry fields, keep their class (`OWN_CLASS`)."""

from __future__ import annotations

import typing
from types import MappingProxyType
from typing import Literal

from nemo_rl.data.errors import FatalError, Kinded

GRPOKind = Literal[
    "placement", "stale_weights", "batch", "worker_metrics", "accounting", "masked_steps", "all_rollouts_failed",
    "async_loop",
]
"""Asking the actors which node they run on failed; rows or workers carry a weight version other
than the one the loop refit (or the workers start from different ones); a step's rows cannot form
one batch; the workers' counters or engine timings cannot be compared across the step; the
always-N accounting broke; and the three with their own class: `masked_steps`
(`MaskedStepsError`), `all_rollouts_failed` (`AllRolloutsFailedError`), `async_loop` (`AsyncLoopError`)."""


class GRPOError(Kinded, FatalError, RuntimeError):
    """The training loop cannot continue (the message names the step and the cause; `kind` which)."""

    KINDS = typing.get_args(GRPOKind)
    OWN_CLASS = MappingProxyType({
        "masked_steps": "MaskedStepsError", "all_rollouts_failed": "AllRolloutsFailedError",
        "async_loop": "AsyncLoopError",
    })
    kind: GRPOKind

    def __init__(self, message: str, *, kind: GRPOKind) -> None:
        super().__init__(message, kind=kind)


class MaskedStepsError(GRPOError):
    """Too many consecutive steps in which every rollout became a placeholder (the loop re-raises it by name)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="masked_steps")

