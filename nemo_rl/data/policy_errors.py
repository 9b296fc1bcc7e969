"""The policy failures that cross a process boundary: raised by records below the policy, or by
the policy worker actor and caught by the driver.

Contract:
- `PolicyError` is the base of every policy failure (the rest of the family is in
  `nemo_rl.models.policy.errors`, which subclasses it).
- `TrainBatchError`: a `TrainBatch` breaks one of its invariants (also a `ValueError`).
- `PolicyWorkerError`: a call into a remote policy worker failed inside the worker; the actor
  re-raises every failure as one, so callers catch one named class. Errors here carry only
  strings, so they cross the Ray boundary intact.
"""

from __future__ import annotations

from nemo_rl.data.errors import FatalError


class PolicyError(FatalError):
    """Base class of every policy failure."""


class TrainBatchError(PolicyError, ValueError):
    """A TrainBatch violates one of its invariants."""


class PolicyWorkerError(PolicyError):
    """A call into a remote PolicyWorker failed inside the worker."""
