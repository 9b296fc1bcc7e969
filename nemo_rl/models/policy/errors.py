"""Named failures of the torch policy and of its Ray worker: four families with a `kind`.

Every error message names the offending field or value and the fix. The base `PolicyError` and
`PolicyWorkerError` cross process boundaries and live in `nemo_rl.data.errors`; the families
here subclass them (docs/design-docs/errors.md, "`models.policy`"). `PolicyWorkerError` and its
subclasses are what callers of a remote worker see; they carry only strings (and a kind) so they
cross the Ray boundary intact.
"""

from __future__ import annotations

import typing
from typing import Literal

from nemo_rl.data.errors import Kinded, PolicyError, PolicyWorkerError

PolicyLoadKind = Literal["model", "device", "router_replay"]
"""What could not start: the model folder (`policy.model_path`) is not a loadable causal LM;
`policy.device` names a device this process cannot see (cuda on a CPU-only host);
`policy.router_replay` asks for what the model cannot do (a dense model, an unknown router)."""


class PolicyLoadError(Kinded, PolicyError):
    """The policy could not be built from its config; nothing was trained."""

    KINDS = typing.get_args(PolicyLoadKind)
    kind: PolicyLoadKind

    def __init__(self, message: str, *, kind: PolicyLoadKind) -> None:
        super().__init__(message, kind=kind)


PolicyStepKind = Literal["loss_input", "empty_mask", "token_ids", "route_fit", "loss_fn", "non_finite_grad"]
"""What was refused: the tensors or settings given to a loss or a mismatch metric are inconsistent
(shape, mask, range; the GRPO math raises it too); a mask selects no token; a token id is outside
the vocabulary (or a sequence is empty); a batch's `routed_experts` do not fit the model; the
`loss_fn` is not a `LossFn` or broke its contract; the gradient norm is inf or nan."""


class PolicyStepError(Kinded, PolicyError, ValueError):
    """A train step, a logprob call or a loss refused its input or its result; no optimizer step was taken."""

    KINDS = typing.get_args(PolicyStepKind)
    kind: PolicyStepKind

    def __init__(self, message: str, *, kind: PolicyStepKind) -> None:
        super().__init__(message, kind=kind)


PolicyStateKind = Literal["export", "checkpoint"]
"""What cannot be written or read: the weights in a form the generation engine reloads correctly
(the refit export); a policy checkpoint (save refused, or a load that does not fit this policy)."""


class PolicyStateError(Kinded, PolicyError):
    """The policy's state cannot be exported, saved or loaded as asked; the policy's state is unchanged."""

    KINDS = typing.get_args(PolicyStateKind)
    kind: PolicyStateKind

    def __init__(self, message: str, *, kind: PolicyStateKind) -> None:
        super().__init__(message, kind=kind)


PolicyWorkerCallKind = Literal["timeout", "died"]
"""How the call failed outside the worker: it missed `policy.call_timeout_s`; the actor is gone."""


class PolicyWorkerCallError(Kinded, PolicyWorkerError):
    """A call into a remote PolicyWorker got no answer (its deadline passed, or the actor died)."""

    KINDS = typing.get_args(PolicyWorkerCallKind)
    kind: PolicyWorkerCallKind

    def __init__(self, message: str, *, kind: PolicyWorkerCallKind) -> None:
        super().__init__(message, kind=kind)
