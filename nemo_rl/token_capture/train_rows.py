"""The train partition: kept rows carried finalizer -> TransferQueue -> policy worker, past the driver.

With `token_capture.train_partition` set, a finalizer actor that keeps a rollout writes each row's
payload here and returns `RowRef`s (`rows.RowRef`: lengths, calls, versions, R3 coverage, the key
and the digest); the driver computes advantages and sends the policy worker a `TrainPlan` (keys,
digests, advantages); the policy worker reads the rows, checks every digest and builds the very
`TrainBatch` the driver would have built from the `TrainRow`s.

Contract:
- Key of a row: `train_key(rollout_id, chain_index)` = `"<rollout_id>#<chain_index>"` (unique per
  row: rollout ids are unique per run, chain indexes per rollout).
- Payload (one data-plane row per `TrainRow`): `token_ids` int64, `token_mask` and
  `generation_logprobs` float64 (exact for every Python float, so the batch is bit for bit the
  driver-built one), `routed_experts` bytes (the int16 `[n, L, K]` array, little-endian, C order;
  b"" when the row has none) and `meta` (JSON: the key and the routes' shape or null).
- `payload_digest(fields)`: sha256 over `meta` (which names the key, so a row read under another
  key fails) and the little-endian bytes of each array, length-prefixed, in a fixed order.
- `store_rows(client, partition, kept, timeout_s, carry_prompt_ids)`: ONE `put_many` for all rows
  of a kept rollout, then the same `KeptRollout` with `RowRef` rows (prompt ids kept only with
  `carry_prompt_ids`). `store_many_rows` does the same for several kept rollouts (a finalizer's
  share of a group) in ONE `put_many`. A data-plane failure raises `DataPlaneError` (the finalizer
  makes it the `data_plane_error` verdict of every rollout of that put).
- `TrainPlan`: partition, keys (unique), digests (sha256 hex) and one finite advantage per key.
- `read_train_batch(client, plan)`: ONE `get` of every key; each payload's digest is recomputed and
  must equal the plan's, else `TrainRowDigestError` naming the key and both digests (nothing is
  trained); a missing key raises the data plane's `MissingKeysError`.
- `TrainRowCleaner`: `clear(keys)` (absent keys ignored) and `remaining()` (one bounded list).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nemo_rl.data_plane import DataPlaneClient, Row
from nemo_rl.models.policy.batch import TrainBatch
from nemo_rl.models.policy.errors import PolicyWorkerError
from nemo_rl.token_capture.rows import KeptRollout, RowRef, TrainRow

TOKEN_IDS = "token_ids"
TOKEN_MASK = "token_mask"
LOGPROBS = "generation_logprobs"
ROUTES = "routed_experts"
META = "meta"
FIELDS = (TOKEN_IDS, TOKEN_MASK, LOGPROBS, ROUTES, META)
KEY_SEPARATOR = "#"


class TrainRowDigestError(PolicyWorkerError):
    """A row read from the train partition is not the row the finalizer wrote: the step is not trained."""


class TrainPlanError(ValueError):
    """A `TrainPlan` violates its invariants."""


def train_key(rollout_id: str, chain_index: int) -> str:
    return f"{rollout_id}{KEY_SEPARATOR}{chain_index}"


def row_payload(key: str, row: TrainRow) -> Row:
    """The data-plane fields of one row (see the module contract)."""
    routes = row.routed_experts
    meta = {"key": key, "routes_shape": list(routes.shape) if routes is not None else None}
    return {
        TOKEN_IDS: torch.tensor(row.token_ids, dtype=torch.int64),
        TOKEN_MASK: torch.tensor(row.token_mask, dtype=torch.float64),
        LOGPROBS: torch.tensor(row.generation_logprobs, dtype=torch.float64),
        ROUTES: np.ascontiguousarray(routes, dtype="<i2").tobytes() if routes is not None else b"",
        META: json.dumps(meta, sort_keys=True),
    }


def _array_bytes(value: torch.Tensor, dtype: str) -> bytes:
    return np.ascontiguousarray(value.numpy(), dtype=dtype).tobytes()


def payload_digest(fields: Mapping[str, object]) -> str:
    """sha256 hex over meta and the arrays' little-endian bytes, each length-prefixed."""
    digest = hashlib.sha256()
    parts = (
        str(fields[META]).encode(),
        _array_bytes(fields[TOKEN_IDS], "<i8"),
        _array_bytes(fields[TOKEN_MASK], "<f8"),
        _array_bytes(fields[LOGPROBS], "<f8"),
        bytes(fields[ROUTES]),
    )
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


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


@dataclass(frozen=True)
class TrainPlan:
    """What the policy worker trains on: rows by key, the digest each must have, their advantages."""

    partition: str
    keys: tuple[str, ...]
    digests: tuple[str, ...]
    advantages: tuple[float, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.partition, str) or not self.partition:
            raise TrainPlanError(f"partition must be a non-empty str, got {self.partition!r}")
        n = len(self.keys)
        if n == 0 or len(self.digests) != n or len(self.advantages) != n:
            raise TrainPlanError(f"need >= 1 key and one digest and advantage per key, got "
                                 f"{n}/{len(self.digests)}/{len(self.advantages)}")
        if len(set(self.keys)) != n or any(not isinstance(k, str) or not k for k in self.keys):
            raise TrainPlanError("keys must be distinct non-empty str")
        if any(not isinstance(d, str) or len(d) != 64 or any(c not in "0123456789abcdef" for c in d)
               for d in self.digests):
            raise TrainPlanError("digests must be sha256 hex digests")
        if any(not isinstance(a, float) or not math.isfinite(a) for a in self.advantages):
            raise TrainPlanError(f"advantages must be finite floats, got {self.advantages!r}")

    @classmethod
    def of(cls, partition: str, refs: Sequence[RowRef], advantages: Sequence[float]) -> "TrainPlan":
        return cls(partition, tuple(r.key for r in refs), tuple(r.digest for r in refs),
                   tuple(float(a) for a in advantages))

    @property
    def num_samples(self) -> int:
        return len(self.keys)


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
    return TrainBatch(
        token_ids=[row[TOKEN_IDS].tolist() for row in rows],
        token_mask=[[int(m) for m in row[TOKEN_MASK].tolist()] for row in rows],
        generation_logprobs=[row[LOGPROBS].tolist() for row in rows],
        advantages=list(plan.advantages),
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
