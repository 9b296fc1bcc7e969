"""The train partition's I/O: kept rows written by a finalizer, read by the policy worker, cleared by the driver.

Records and codec live in `nemo_rl.data.train`; this module moves them through a
`DataPlaneClient`. `store_rows` / `store_many_rows` write a finalizer's kept rows in ONE
`put_many` and return `RowRef`s; `read_train_batch` reads a plan's keys in ONE `get` and
recomputes every digest (`TrainRowDigestError` naming key and digests: nothing is trained);
`TrainRowCleaner` clears and counts what remains. Data-plane failures stay `DataPlaneError`s.
Invariant: the batch read is the very `TrainBatch` the driver would have built from the rows.
See docs/design-docs/token-capture-receipts.md, "The train partition's I/O".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nemo_rl.data.errors import PolicyWorkerError
from nemo_rl.data.rows import KeptRollout, RowRef, TrainRow
from nemo_rl.data.train import (
    FIELDS,
    LOGPROBS,
    TOKEN_IDS,
    TOKEN_MASK,
    TrainBatch,
    TrainPlan,
    batch_routes,
    decode_row_routes,
    payload_digest,
    row_payload,
    train_key,
)
from nemo_rl.data_plane.client import DataPlaneClient


class TrainRowDigestError(PolicyWorkerError):
    """A row read from the train partition is not the row the finalizer wrote: the step is not trained."""


def store_rows(
    client: DataPlaneClient, partition: str, kept: KeptRollout, timeout_s: float, carry_prompt_ids: bool
) -> KeptRollout:
    """Write the rollout's rows in one put; the rollout with `RowRef` rows (see the module contract)."""
    return store_many_rows(client, partition, [kept], timeout_s, carry_prompt_ids)[0]


def store_many_rows(
    client: DataPlaneClient, partition: str, kept: Sequence[KeptRollout], timeout_s: float, carry_prompt_ids: bool
) -> list[KeptRollout]:
    """Write the rows of several kept rollouts in ONE put; each rollout with `RowRef` rows, in order."""
    keys, payloads, refs = [], [], []
    for rollout in kept:
        refs.append([])
        for row in rollout.rows:
            if not isinstance(row, TrainRow):
                raise TypeError(f"rollout {rollout.rollout_id}: store_rows takes TrainRows, got {type(row).__name__}")
            key = train_key(row.rollout_id, row.chain_index)
            payload = row_payload(key, row)
            keys.append(key)
            payloads.append(payload)
            refs[-1].append(RowRef.of(row, key, payload_digest(payload), carry_prompt_ids))
    if keys:
        client.put_many(partition, keys, payloads, timeout_s=timeout_s)
    return [dataclasses.replace(rollout, rows=tuple(r)) for rollout, r in zip(kept, refs)]


def read_train_batch(client: DataPlaneClient, plan: TrainPlan, timeout_s: float | None = None) -> TrainBatch:
    """The plan's rows, digest-checked, as the TrainBatch the driver would have built."""
    rows = client.get(plan.partition, list(plan.keys), list(FIELDS), timeout_s=timeout_s)
    for key, expected, row in zip(plan.keys, plan.digests, rows, strict=True):
        found = payload_digest(row)
        if found != expected:
            raise TrainRowDigestError(
                f"train partition {plan.partition!r} key {key!r}: payload digest {found} != {expected} recorded by "
                "the finalizer; the row changed after it was judged, so this step is not trained"
            )
    token_ids = [row[TOKEN_IDS].tolist() for row in rows]
    return TrainBatch(
        token_ids=token_ids,
        token_mask=[[int(m) for m in row[TOKEN_MASK].tolist()] for row in rows],
        generation_logprobs=[row[LOGPROBS].tolist() for row in rows],
        advantages=list(plan.advantages),
        routed_experts=batch_routes([decode_row_routes(row) for row in rows], [len(ids) for ids in token_ids]),
    )


class TrainRowCleaner:
    """Clears trained (or abandoned) rows from the train partition; every call bounded."""

    def __init__(self, client: DataPlaneClient, partition: str, timeout_s: float) -> None:
        self.client, self.partition, self._timeout_s = client, partition, timeout_s

    def clear(self, keys: Sequence[str]) -> None:
        if keys:
            self.client.clear(self.partition, list(keys), timeout_s=self._timeout_s)

    def remaining(self) -> list[str]:
        return self.client.list_keys(self.partition, timeout_s=self._timeout_s)
