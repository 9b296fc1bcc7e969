"""The GRPO driver's named failures (set-up, refit and the loop raise them; each message names the
step or the phase and the cause)."""

from __future__ import annotations

from nemo_rl.data.errors import FatalError


class GRPOError(FatalError, RuntimeError):
    """The training loop cannot continue (the message names the step and the cause)."""


class MaskedStepsError(GRPOError):
    """Too many consecutive steps in which every rollout became a placeholder."""


class StaleWeightsError(GRPOError):
    """Rows carry a weight version other than the one the loop refit into every worker."""
