"""Named failures of the torch policy and of its Ray worker.

Every error message names the offending field or value and the fix. The base `PolicyError`,
`TrainBatchError` and `PolicyWorkerError` cross process boundaries and live in
`nemo_rl.data.errors`; the classes here subclass them. `PolicyWorkerError` and its
subclasses are what callers of a remote worker see; they carry only strings so they cross the
Ray boundary intact.
"""

from __future__ import annotations

from nemo_rl.data.errors import PolicyError, PolicyWorkerError


class PolicyLoadError(PolicyError):
    """The model folder could not be loaded."""


class PolicyDeviceError(PolicyLoadError):
    """`policy.device` names a device this process cannot see (e.g. cuda on a CPU-only host)."""


class TokenIdOutOfRangeError(PolicyError, ValueError):
    """A token id is outside the model's vocabulary."""


class LossInputError(PolicyError, ValueError):
    """The tensors given to a loss or a logprob-mismatch metric are inconsistent (shape, mask,
    range). Not a `PolicyError`: loss implementations outside the policy (the GRPO loss) raise it
    for their own inputs too."""


class EmptyMaskError(LossInputError):
    """A masked mean was asked over a mask with no selected token."""


class LossFnError(PolicyError, TypeError):
    """`train_step` was given something that is not a `LossFn`, or the loss broke its contract."""


class NonFiniteGradientError(PolicyError):
    """The gradient norm of a step is inf or nan; the optimizer step was not taken."""


class WeightExportError(PolicyError):
    """The weights cannot be exported in a form the generation engine reloads correctly."""


class PolicyWorkerTimeoutError(PolicyWorkerError):
    """A call into a remote PolicyWorker missed its deadline."""


class PolicyWorkerDiedError(PolicyWorkerError):
    """The remote PolicyWorker process is gone."""
