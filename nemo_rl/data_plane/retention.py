"""Retention of the staging partition: once a group is accounted, its staged records go.

A group owns the keys its fetched manifests name plus the ones the workers' served report says
they staged for its rollouts (orphans: staged, but the commit never reached the ledger).
`TQStagingCleaner.clear` removes both in ONE bounded data-plane call per group. Only keys of
the given rollouts are ever cleared, so groups in flight are unaffected. Without a served report
(`reported_keys=None`) it lists the partition to find the orphans, one more bounded call.
Not seen either way: a call staged after its group's report was taken, or a rollout the
worker's served registry evicted; it stays until the data plane is dropped.
See docs/design-docs/token-capture-receipts.md, "Retention of the staging partition".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nemo_gym.token_id_capture.staging import staging_key

from nemo_rl.data.served import ServedCall
from nemo_rl.data_plane import DataPlaneClient

STAGING_KEY_SEPARATOR = "/"


def _owner(key: str) -> str | None:
    owner, separator, _ = key.partition(STAGING_KEY_SEPARATOR)
    return owner if separator else None


def orphaned_keys(present: Iterable[str], named: Iterable[str], rollout_ids: Iterable[str]) -> list[str]:
    """Keys of `rollout_ids` in `present` that `named` lacks, in `present` order, each once."""
    named_set = set(named)
    owners = set(rollout_ids)
    seen: set[str] = set()
    orphans = []
    for key in present:
        if _owner(key) in owners and key not in named_set and key not in seen:
            seen.add(key)
            orphans.append(key)
    return orphans


def reported_staged_keys(served: Iterable[ServedCall]) -> list[str]:
    """The staging keys of the served calls whose delta was staged, in report order, each once."""
    return list(dict.fromkeys(staging_key(call.rollout_id, call.model_call_id) for call in served if call.staged))


class TQStagingCleaner:
    """Clears a group's staged records from the TQ staging partition (a `StagingCleaner`)."""

    def __init__(self, client: DataPlaneClient, partition: str, timeout_s: float) -> None:
        self._client, self._partition, self._timeout_s = client, partition, timeout_s

    def clear(self, named_keys: Sequence[str], rollout_ids: Sequence[str], reported_keys: Sequence[str] | None) -> int:
        """Clear the group's named keys and its orphans in one call; returns the orphan count."""
        if reported_keys is None:
            present = self._client.list_keys(self._partition, timeout_s=self._timeout_s)
        else:
            present = reported_keys
        orphans = orphaned_keys(present, named_keys, rollout_ids)
        keys = list(dict.fromkeys([*named_keys, *orphans]))
        if keys:
            self._client.clear(self._partition, keys, timeout_s=self._timeout_s)
        return len(orphans)

    def remaining(self) -> int:
        """How many keys the staging partition still holds (one bounded list)."""
        return len(self._client.list_keys(self._partition, timeout_s=self._timeout_s))
