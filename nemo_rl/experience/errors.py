"""The experience package's accounting failures: one fatal family with a `kind` (docs/design-docs/errors.md).

Contract: an `AccountingError` is a bug in the driver's bookkeeping, never data: an outcome filed
under the wrong slot (`rollout_manager`), a row whose age cannot be read or is in the future
(`staleness`), a prompt-ledger transition the ledger refuses (`prompt_queue`). Its `kind` says
which; the message names the group, rollout or prompt and is what it was before the kinds.
A snapshot restored under another batch size keeps its class (`SnapshotMismatchError`, in
`prompt_queue`): resume catches it by name to answer a `CheckpointError`.
"""

from __future__ import annotations

import typing
from types import MappingProxyType
from typing import Literal

from nemo_rl.data.errors import FatalError, Kinded

AccountingKind = Literal[
    "outcome", "unversioned_row", "future_version", "unknown_group", "group_state", "trained_twice", "prompt_lost",
    "in_flight_limit", "snapshot_mismatch",
]
"""An outcome does not belong to its slot, or the finalizer answered another count; a kept row has
a call without a weight version; a row's version is newer than the trainer's; a ticket the ledger
never issued (or superseded); a transition the prompt's state does not allow; a prompt consumed
twice; a drawn prompt neither queued nor dispatched (or both); a dispatch past max_in_flight; and
`snapshot_mismatch`, raised as its own class (`SnapshotMismatchError`)."""


class AccountingError(Kinded, FatalError, RuntimeError):
    """The driver's accounting broke (a bug, never data); `kind` says where (`AccountingKind`)."""

    KINDS = typing.get_args(AccountingKind)
    OWN_CLASS = MappingProxyType({"snapshot_mismatch": "SnapshotMismatchError"})
    kind: AccountingKind

    def __init__(self, message: str, *, kind: AccountingKind) -> None:
        super().__init__(message, kind=kind)
