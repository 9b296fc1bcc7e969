"""Retention of the staging partition: once a group is accounted, its staged records go.

Contract:
- Staged keys are Gym's `staging_key(rollout_id, model_call_id)` = `"<rollout_id>/<call id>"`.
- `orphaned_keys(present, named, rollout_ids)` (pure): the keys in `present` that belong to one
  of `rollout_ids` but that no fetched manifest named. They exist when a worker staged a call
  whose commit never reached the ledger (the gate or the run died in between, or the manifest
  could not be fetched); nothing would ever read or clear them otherwise.
- `TQStagingCleaner.clear(named_keys, rollout_ids)` lists the partition, then clears the named
  keys and those orphans in one call (each call bounded) and returns how many orphans it cleared. Keys of other
  rollouts are never touched, so groups in flight are unaffected.
- A call a worker stages after its group was cleared (a run abandoned mid-call) is not seen
  here; it stays until the partition is dropped with the data plane.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nemo_rl.data_plane import DataPlaneClient

STAGING_KEY_SEPARATOR = "/"


def orphaned_keys(present: Iterable[str], named: Iterable[str], rollout_ids: Iterable[str]) -> list[str]:
    """Keys of `rollout_ids` in `present` that `named` lacks, in `present` order, each once."""
    named_set = set(named)
    owners = set(rollout_ids)
    seen: set[str] = set()
    orphans = []
    for key in present:
        owner, separator, _ = key.partition(STAGING_KEY_SEPARATOR)
        if separator and owner in owners and key not in named_set and key not in seen:
            seen.add(key)
            orphans.append(key)
    return orphans


class TQStagingCleaner:
    """Clears a group's staged records from the TQ staging partition (a `StagingCleaner`)."""

    def __init__(self, client: DataPlaneClient, partition: str, timeout_s: float) -> None:
        self._client, self._partition, self._timeout_s = client, partition, timeout_s

    def clear(self, named_keys: Sequence[str], rollout_ids: Sequence[str]) -> int:
        present = self._client.list_keys(self._partition, timeout_s=self._timeout_s)
        orphans = orphaned_keys(present, named_keys, rollout_ids)
        keys = list(dict.fromkeys([*named_keys, *orphans]))
        if keys:
            self._client.clear(self._partition, keys, timeout_s=self._timeout_s)
        return len(orphans)
