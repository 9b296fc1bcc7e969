"""What the policy trains on: `TrainBatch`, and the `TrainPlan` and train-row codec that carry it.

`TrainBatch` holds one optimizer step's samples: per sample, `token_ids` (L >= 2), a 0/1
`token_mask` (position 0 never trained), the sampler's `generation_logprobs` (read where masked:
finite, <= 0) and one finite advantage; a masked placeholder is an all-0 mask. Checked at
construction (a `RecordInvariantError`, kind `train_batch`; `train_plan` for a plan) on the values
as given, then stored once as tuples. A legacy step's batch is built by the driver; a capture row
goes finalizer -> train partition (`token_capture.train_partition`) -> policy worker past the
driver, which keeps a `RowRef` and sends a `TrainPlan` (partition, unique keys, digests, one
finite advantage per key, the same for every row of a rollout). Pure;
the I/O is `nemo_rl.data_plane.partitions`. Invariants: `train_key` is unique per row; float
payloads are float64, so the batch read is bit for bit the driver-built one; `payload_digest`
covers `meta`, which names the key, so a row read under another key fails.
Layout: docs/design-docs/token-capture-receipts.md, "The train-row codec and `TrainPlan`".
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nemo_rl.data.errors import RecordInvariantError
from nemo_rl.data.rows import RowRef, TrainRow
from nemo_rl.data.calls import Row

TOKEN_IDS = "token_ids"
TOKEN_MASK = "token_mask"
LOGPROBS = "generation_logprobs"
ROUTES = "routed_experts"
META = "meta"
FIELDS = (TOKEN_IDS, TOKEN_MASK, LOGPROBS, ROUTES, META)
KEY_SEPARATOR = "#"
ROUTE_SENTINEL = -1  # no replayed route for this token (prompt, placeholder, dense model, padding)


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


def decode_row_routes(fields: Mapping[str, object]) -> np.ndarray | None:
    """A payload's int16 `[len(row), L, K]` routes (the shape is in `meta`), or None when it has none."""
    shape = json.loads(str(fields[META]))["routes_shape"]
    if shape is None:
        return None
    return np.frombuffer(bytes(fields[ROUTES]), dtype="<i2").reshape(shape).astype(np.int16)


def batch_routes(per_row: Sequence[np.ndarray | None], lengths: Sequence[int]) -> np.ndarray | None:
    """Rows' `[len_i, L, K]` routes as one int16 `[n, max(lengths), L, K]` array, ROUTE_SENTINEL where
    a row has none and past its end; None when no row has routes (a dense model)."""
    shapes = sorted({tuple(r.shape[1:]) for r in per_row if r is not None})
    if not shapes:
        return None
    if len(shapes) > 1:
        raise RecordInvariantError(
            f"routed_experts: rows disagree on (layers, top-k) {shapes}; every row of a step comes from one "
            "model (fix: do not mix rows of different engines in one step)", kind="train_batch"
        )
    out = np.full((len(per_row), max(lengths), *shapes[0]), ROUTE_SENTINEL, dtype=np.int16)
    for i, (routes, n) in enumerate(zip(per_row, lengths, strict=True)):
        if routes is not None:
            if routes.shape[0] != n:
                raise RecordInvariantError(f"routed_experts[{i}] covers {routes.shape[0]} tokens, the row has {n}", kind="train_batch")
            out[i, :n] = routes
    return out


def _array_bytes(value: torch.Tensor, dtype: str) -> bytes:
    return np.ascontiguousarray(value.numpy(), dtype=dtype).tobytes()


def payload_digest(fields: Mapping[str, object]) -> str:
    """sha256 hex over meta and each array's dtype and little-endian bytes, each part length-prefixed
    (the dtype too: float token ids or an int mask must not digest like the codec's arrays they cast to)."""
    digest = hashlib.sha256()
    parts = (
        str(fields[META]).encode(),
        *(part for name, dtype in ((TOKEN_IDS, "<i8"), (TOKEN_MASK, "<f8"), (LOGPROBS, "<f8"))
          for part in (str(fields[name].dtype).encode(), _array_bytes(fields[name], dtype))),
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
            raise RecordInvariantError(f"partition must be a non-empty str, got {self.partition!r}", kind="train_plan")
        n = len(self.keys)
        if n == 0 or len(self.digests) != n or len(self.advantages) != n:
            raise RecordInvariantError(f"need >= 1 key and one digest and advantage per key, got "
                                       f"{n}/{len(self.digests)}/{len(self.advantages)}", kind="train_plan")
        if len(set(self.keys)) != n or any(not isinstance(k, str) or not k for k in self.keys):
            raise RecordInvariantError("keys must be distinct non-empty str", kind="train_plan")
        if any(not isinstance(d, str) or len(d) != 64 or any(c not in "0123456789abcdef" for c in d)
               for d in self.digests):
            raise RecordInvariantError("digests must be sha256 hex digests", kind="train_plan")
        if any(not isinstance(a, float) or not math.isfinite(a) for a in self.advantages):
            raise RecordInvariantError(f"advantages must be finite floats, got {self.advantages!r}", kind="train_plan")
        by_rollout: dict[str, set[float]] = {}
        for key, advantage in zip(self.keys, self.advantages):
            by_rollout.setdefault(key.rpartition(KEY_SEPARATOR)[0] or key, set()).add(advantage)
        for rollout_id, found in by_rollout.items():
            if len(found) > 1:
                raise RecordInvariantError(f"rows of rollout {rollout_id!r} carry different advantages {sorted(found)}; "
                                           "every row of a rollout carries its rollout's advantage", kind="train_plan")

    @classmethod
    def of(cls, partition: str, refs: Sequence[RowRef], advantages: Sequence[float]) -> "TrainPlan":
        return cls(partition, tuple(r.key for r in refs), tuple(r.digest for r in refs),
                   tuple(float(a) for a in advantages))

    @property
    def num_samples(self) -> int:
        return len(self.keys)


# --- TrainBatch: the rows one optimizer step trains on (driver-built or read by the policy worker) ---


def _samples(name: str, rows: Sequence[Sequence]) -> tuple[Sequence, ...]:
    if isinstance(rows, (str, bytes)):
        raise RecordInvariantError(f"{name} must be a sequence of per-sample sequences, got a string", kind="train_batch")
    return tuple(rows)


@dataclass(frozen=True)
class TrainBatch:
    """Per sample i (all per-token sequences have the same length L_i >= 2):
    token_ids[i] the full sequence (prompt, generated tokens, tool results, ...); token_mask[i]
    1 where the token was generated by the policy and is trained, else 0 (position 0 has no
    prefix, so no logprob: never trained); generation_logprobs[i] the sampler's logprob of each
    token given its prefix (only masked positions are read; others conventionally 0.0);
    advantages[i] one finite advantage, broadcast over its masked tokens; routed_experts (R3) None or
    a read-only int16 `[n, max_len, L, K]` array of replayed expert ids aligned with token_ids,
    ROUTE_SENTINEL (-1) where a token has no route and past each row's end."""

    token_ids: tuple[tuple[int, ...], ...]
    token_mask: tuple[tuple[int, ...], ...]
    generation_logprobs: tuple[tuple[float, ...], ...]
    advantages: tuple[float, ...]
    routed_experts: np.ndarray | None = field(default=None, hash=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrainBatch):
            return NotImplemented
        fields_equal = (self.token_ids, self.token_mask, self.generation_logprobs, self.advantages) == (
            other.token_ids, other.token_mask, other.generation_logprobs, other.advantages)
        if self.routed_experts is None or other.routed_experts is None:
            return fields_equal and self.routed_experts is other.routed_experts
        return fields_equal and np.array_equal(self.routed_experts, other.routed_experts)

    def __post_init__(self) -> None:
        ids, masks, lps = (_samples(name, getattr(self, name))
                           for name in ("token_ids", "token_mask", "generation_logprobs"))
        object.__setattr__(self, "advantages", tuple(float(a) for a in self.advantages))
        n = len(ids)
        if n == 0:
            raise RecordInvariantError("token_ids is empty; a TrainBatch needs at least one sample", kind="train_batch")
        for name, found in (("token_mask", masks), ("generation_logprobs", lps), ("advantages", self.advantages)):
            if len(found) != n:
                raise RecordInvariantError(
                    f"len({name})={len(found)} != len(token_ids)={n}; pass one entry per sample", kind="train_batch"
                )
        # Each sample is checked on the values as given, then stored once as tuples of int / int / float.
        checked = [self._checked_sample(i, ids[i], masks[i], lps[i]) for i in range(n)]
        for position, name in enumerate(("token_ids", "token_mask", "generation_logprobs")):
            object.__setattr__(self, name, tuple(sample[position] for sample in checked))
        self._check_routes()

    def _check_routes(self) -> None:
        routes = self.routed_experts
        if routes is None:
            return
        lengths = [len(ids) for ids in self.token_ids]
        if not isinstance(routes, np.ndarray) or routes.dtype != np.int16 or routes.ndim != 4:
            raise RecordInvariantError(
                f"routed_experts must be None or an int16 ndarray [n, max_len, L, K], got "
                f"{getattr(routes, 'dtype', type(routes).__name__)} of shape {getattr(routes, 'shape', None)} "
                "(fix: build it with nemo_rl.data.train.batch_routes)", kind="train_batch"
            )
        n, max_len, layers, topk = routes.shape
        if (n, max_len) != (len(lengths), max(lengths)) or layers < 1 or topk < 1:
            raise RecordInvariantError(
                f"routed_experts shape {routes.shape} does not fit the batch: need ({len(lengths)}, "
                f"{max(lengths)}, L >= 1, K >= 1) (fix: build it with nemo_rl.data.train.batch_routes)", kind="train_batch"
            )
        if int(routes.min()) < ROUTE_SENTINEL:
            raise RecordInvariantError(f"routed_experts holds {int(routes.min())}; ids are >= 0, {ROUTE_SENTINEL} is the sentinel", kind="train_batch")
        for i, length in enumerate(lengths):
            if (routes[i, length:] != ROUTE_SENTINEL).any():
                raise RecordInvariantError(f"routed_experts[{i}] has routes past the row's end ({length} tokens)", kind="train_batch")
        frozen = routes.copy()
        frozen.flags.writeable = False
        object.__setattr__(self, "routed_experts", frozen)

    def _checked_sample(self, i: int, ids: Sequence, mask: Sequence, lps: Sequence
                        ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
        adv = self.advantages[i]
        if len(ids) < 2:
            raise RecordInvariantError(
                f"token_ids[{i}] has {len(ids)} tokens; a trainable sequence needs at least 2", kind="train_batch"
            )
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0 for t in ids):
            raise RecordInvariantError(f"token_ids[{i}] must hold non-negative ints", kind="train_batch")
        for name, row in (("token_mask", mask), ("generation_logprobs", lps)):
            if len(row) != len(ids):
                raise RecordInvariantError(
                    f"len({name}[{i}])={len(row)} != len(token_ids[{i}])={len(ids)}; "
                    "per-token fields align with token_ids", kind="train_batch"
                )
        bad = [m for m in mask if m not in (0, 1)]
        if bad:
            raise RecordInvariantError(f"token_mask[{i}] holds {bad[0]!r}; the mask is 0/1 only", kind="train_batch")
        if mask[0] != 0:
            raise RecordInvariantError(
                f"token_mask[{i}][0]=1; position 0 has no prefix and cannot be trained", kind="train_batch"
            )
        for t, (m, lp) in enumerate(zip(mask, lps)):
            if m and not (math.isfinite(lp) and lp <= 0.0):
                raise RecordInvariantError(
                    f"generation_logprobs[{i}][{t}]={lp} on a masked token; "
                    "a logprob is finite and <= 0", kind="train_batch"
                )
        if not math.isfinite(adv):
            raise RecordInvariantError(f"advantages[{i}]={adv} is not finite", kind="train_batch")
        return tuple(int(t) for t in ids), tuple(int(m) for m in mask), tuple(float(lp) for lp in lps)

    @property
    def num_samples(self) -> int:
        return len(self.token_ids)

    @property
    def num_masked_tokens(self) -> int:
        return sum(sum(m) for m in self.token_mask)
