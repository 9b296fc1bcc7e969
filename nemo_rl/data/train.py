"""The train-row codec and `TrainPlan`: what the finalizer stores, the driver plans and the policy reads.

With `token_capture.train_partition` set a kept row's payload goes finalizer -> data plane ->
policy worker, past the driver, which keeps a `RowRef` and sends a `TrainPlan` (partition, unique
keys, digests, one finite advantage per key). Pure part; the I/O is `nemo_rl.data_plane.train_rows`.
Invariants: `train_key` is unique per row; float payloads are float64, so the batch is bit for
bit the driver-built one; `payload_digest` covers `meta`, which names the key, so a row read
under another key fails.
Layout: docs/design-docs/token-capture-receipts.md, "The train-row codec and `TrainPlan`".
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nemo_rl.data.errors import FatalError
from nemo_rl.data.rows import RowRef, TrainRow
from nemo_rl.data.staged_rows import Row

TOKEN_IDS = "token_ids"
TOKEN_MASK = "token_mask"
LOGPROBS = "generation_logprobs"
ROUTES = "routed_experts"
META = "meta"
FIELDS = (TOKEN_IDS, TOKEN_MASK, LOGPROBS, ROUTES, META)
KEY_SEPARATOR = "#"


class TrainPlanError(FatalError, ValueError):
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
