"""Retention of the staging partition: once a group is accounted, its staged records go.

Contract:
- Staged keys are Gym's `staging_key(rollout_id, model_call_id)` = `"<rollout_id>/<call id>"`.
- The keys a group owns are the ones its fetched manifests named plus the ones the workers
  reported staging for its rollouts (`ServedCall.staged`, from the served-call report the
  manager already takes for the judge; `reported_staged_keys`). A reported key that no manifest
  names is an orphan: a worker staged the call but its commit never reached the ledger (the gate
  or the run died in between, or the manifest could not be fetched); nothing would ever read or
  clear it otherwise.
- `TQStagingCleaner.clear(named_keys, rollout_ids, reported_keys)` clears the named keys and the
  orphans in ONE data-plane call (bounded) and returns how many orphans it cleared. Only keys of
  `rollout_ids` are ever cleared, so groups in flight are unaffected. The cost is one round trip
  per group whatever the size of the partition.
- `reported_keys=None` means the served report was unavailable (a worker timed out or died; the
  manager counts it as `finalize/served_report_failures`). Then, and only then, the cleaner
  lists the partition to find the group's orphans (`orphaned_keys`), one more bounded call whose
  cost grows with the partition: that is the price of not knowing what the workers staged.
- Not seen either way: a call a worker stages after its group's report was taken (a run
  abandoned mid-call), or a rollout the worker's bounded served registry evicted
  (`served_evicted_rollouts`). It stays until the partition is dropped with the data plane.
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
