"""What the custody core remembers, bounded and thread-safe: parents' prefixes, admitted and served calls.

- `PrefixCache.resolve(chain, prev_len, parent_chain_hash)`: the exact ids of the staged deltas a
  token-in chain names, fetching only the keys the cache lacks; every snapshot must continue the
  prefix and match the chain hash, else `PrefixMismatchError` (never generate from an unverified
  prefix). `seed` admits a delta this worker staged only under a fetch's checks; only durable rows
  enter the cache; memory is linear in tokens, LRU beyond `max_tokens`.
- `AdmittedCalls`: every admitted (rollout_id, model_call_id) with its `request_digest` and, once
  answered, its reply, so a byte-identical re-send is replayed and anything else under a used id is
  refused; `release`, `spoil` and `retire` forget, poison and drop. LRU beyond `max_calls`.
- `ServedRegistry`: rollout_id -> this worker's `ServedCall`s in call order, popped by `take`; past
  `max_rollouts` the least recently written rollout is dropped whole and counted.
See docs/design-docs/vllm-worker-capture.md, "Prefix cache".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_gym.token_id_capture.staging import StagingSource, compute_chain_hash

from nemo_rl.data.calls import ServedCall
from nemo_rl.models.generation.vllm.errors import PrefixError, PrefixMismatchError
from nemo_rl.utils.lru import BoundedLRU


@dataclass(frozen=True)
class CacheEntry:
    """One staged delta as the cache holds it: its parent's key in the chain, ids, length so far, chain hash."""

    parent_key: str | None
    delta: tuple[int, ...]
    cum_len: int
    chain_hash: str


def _delta_len(entry: CacheEntry) -> int:
    return len(entry.delta)


class PrefixCache:
    def __init__(self, source: StagingSource, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"token_capture.prefix_cache_max_tokens={max_tokens}: must be >= 0")
        self._source = source
        # Bounded by cached tokens: a delta longer than the bound alone is never held.
        self._entries: BoundedLRU[str, CacheEntry] = BoundedLRU(max_tokens, weight=_delta_len)
        self._lock = threading.Lock()  # the counters, and a resolve's or seed's several steps as one
        self.fetched_keys = 0
        self.fetched_tokens = 0
        self.seeded_keys = 0
        self.seed_rejected = 0

    def resolve(self, chain: list[str], prev_len: int, parent_chain_hash: str | None) -> list[int]:
        if not chain:
            raise PrefixError("staging_chain is empty: nothing to resolve")
        if len(set(chain)) != len(chain):
            raise PrefixMismatchError(f"staging_chain repeats a key: {chain}")
        with self._lock:
            cached = {k: entry for k in chain if (entry := self._entries.peek(k)) is not None}
        missing = [k for k in chain if k not in cached]
        snapshots = self._source.fetch(missing) if missing else []
        if len(snapshots) != len(missing):
            raise PrefixError(f"staging source returned {len(snapshots)} snapshots for {len(missing)} keys")
        fetched = dict(zip(missing, snapshots))
        resolved: list[tuple[str, CacheEntry]] = []
        parent_key: str | None = None
        parent: CacheEntry | None = None
        for key in chain:
            cum = parent.cum_len if parent else 0
            if key in cached:
                entry = cached[key]
                if entry.parent_key != parent_key or entry.cum_len - len(entry.delta) != cum:
                    raise PrefixMismatchError(f"{key}: cached entry does not follow {parent_key!r} in this chain")
            else:
                snap = fetched[key]
                if snap.prev_len != cum:
                    raise PrefixMismatchError(f"{key}: prev_len {snap.prev_len} does not continue a prefix of {cum} ids")
                expected = compute_chain_hash(parent.chain_hash if parent else None, list(snap.token_ids_delta))
                if expected != snap.chain_hash:
                    raise PrefixMismatchError(f"{key}: chain_hash {snap.chain_hash} != recomputed {expected}")
                entry = CacheEntry(parent_key, tuple(snap.token_ids_delta), snap.cum_len, snap.chain_hash)
            resolved.append((key, entry))
            parent_key, parent = key, entry
        assert parent is not None  # chain is non-empty
        if parent.cum_len != prev_len:
            raise PrefixMismatchError(f"resolved prefix has {parent.cum_len} ids, admission prev_len is {prev_len}")
        if parent_chain_hash is not None and parent.chain_hash != parent_chain_hash:
            raise PrefixMismatchError(f"chain hash {parent.chain_hash} != admission parent_chain_hash {parent_chain_hash}")
        with self._lock:
            for key, entry in resolved:
                if not self._entries.touch(key):
                    self._entries.put(key, entry)
            self.fetched_keys += len(missing)
            self.fetched_tokens += sum(len(fetched[k].token_ids_delta) for k in missing)
        prefix = [t for _, entry in resolved for t in entry.delta]
        if len(prefix) != prev_len:
            raise PrefixMismatchError(f"concatenated prefix has {len(prefix)} ids, admission prev_len is {prev_len}")
        return prefix

    def seed(
        self,
        key: str,
        *,
        parent_key: str | None,
        parent_chain_hash: str | None,
        delta: Sequence[int],
        cum_len: int,
        chain_hash: str,
    ) -> bool:
        """Cache a delta this worker staged under `key` (see the module contract).

        True when the delta passed the checks (then it is cached unless it alone exceeds the bound;
        `seeded_keys` counts the cached ones); False when it failed them (`seed_rejected`).
        """
        ids = tuple(delta)
        parent_len = cum_len - len(ids)
        consistent = (
            len(ids) > 0
            and (parent_len == 0 if parent_key is None else parent_len > 0)
            and (parent_key is None) == (parent_chain_hash is None)
            and compute_chain_hash(parent_chain_hash, list(ids)) == chain_hash
        )
        with self._lock:
            if not consistent:
                self.seed_rejected += 1
                return False
            self._entries.put(key, CacheEntry(parent_key, ids, cum_len, chain_hash))
            self.seeded_keys += key in self._entries
            return True

    def staged_tip(self, key: str) -> tuple[int, str]:
        """(cum_len, chain_hash) of the staged row `key`: from the cache, else read from the source.

        A read is not cached (a lone row names no chain position); the source's errors propagate.
        """
        cached = self._entries.peek(key)
        if cached is not None:
            return cached.cum_len, cached.chain_hash
        snapshots = self._source.fetch([key])
        if len(snapshots) != 1:
            raise PrefixError(f"staging source returned {len(snapshots)} snapshots for 1 key")
        self.fetched_keys += 1
        return snapshots[0].cum_len, snapshots[0].chain_hash

    def entry(self, key: str) -> CacheEntry | None:
        """The cached entry of `key` (no LRU touch), or None."""
        return self._entries.peek(key)

    @property
    def cached_tokens(self) -> int:
        return self._entries.weight


def request_digest(body: Mapping[str, Any]) -> str:
    """sha256 of the request body's canonical JSON (sorted keys, no whitespace): what a re-send must match.

    The whole body, every field: a transport re-send carries the very bytes of the original (Gym's
    client re-sends the same encoded body after a connection error), so no field may differ. Any
    difference (another message, other sampling values, another admission) is another request
    under a used id, answered 409.
    """
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(eq=False)
class AdmittedCall:
    """One admitted (rollout_id, model_call_id): its request digest and, once answered, its reply.

    Mutable bookkeeping owned by `AdmittedCalls` (it flips under the registry's lock)."""

    digest: str
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set once committed, released or spoiled
    reply_json: bytes | None = None  # the committed reply, compact JSON (replayed to a re-send)
    spoiled: bool = False  # generated, but no reply was committed (a bug raised after generation)
    retired: bool = False  # its rollout's served report was taken: the reply is dropped, never replayed


class AdmittedCalls:
    """Bounded LRU of admitted (rollout_id, model_call_id) -> `AdmittedCall`; thread-safe.

    Memory: per remembered call its key, a digest and, until its rollout is reported (`retire`),
    the committed reply as compact JSON (no token echo: message, finish_reason, id and commit
    coordinates). Only rollouts still running hold replies.
    """

    def __init__(self, max_calls: int) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls={max_calls}: must be >= 1")
        self._calls: BoundedLRU[tuple[str, str], AdmittedCall] = BoundedLRU(max_calls)
        self._lock = threading.Lock()  # claim's look-up and insert as one step

    def claim(self, key: tuple[str, str], digest: str) -> AdmittedCall | None:
        """Remember `key` as admitted with `digest` and return None; if it is remembered, its entry."""
        with self._lock:
            known = self._calls.get(key)
            if known is not None:
                return known
            self._calls.put(key, AdmittedCall(digest))
            return None

    def commit(self, key: tuple[str, str], reply: Mapping[str, Any]) -> None:
        """The call was answered with `reply`: a re-send of the same request replays it."""
        encoded = json.dumps(reply, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
        with self._lock:
            call = self._calls.peek(key)
            if call is not None:
                call.reply_json = encoded
                call.settled.set()

    def spoil(self, key: tuple[str, str]) -> None:
        """The call was generated but no reply was committed: never generated again, never replayed."""
        with self._lock:
            call = self._calls.peek(key)
            if call is not None:
                call.spoiled = True
                call.settled.set()

    def retire(self, keys: Iterable[tuple[str, str]]) -> None:
        """These calls' rollouts were reported: drop their replies; a re-send of one is refused."""
        with self._lock:
            for key in keys:
                call = self._calls.peek(key)
                if call is not None:
                    call.reply_json = None
                    call.retired = True
                    call.settled.set()

    def release(self, key: tuple[str, str]) -> None:
        """Forget a call refused or not generated, so its retry is admitted afresh."""
        with self._lock:
            call = self._calls.pop(key)
        if call is not None:
            call.settled.set()

    def __len__(self) -> int:
        return len(self._calls)


class ServedRegistry:
    """Bounded rollout_id -> [ServedCall] (call order kept); thread-safe.

    Rollouts are ordered by their latest record; past `max_rollouts` the least recently written
    rollout is dropped whole. `record` returns how many rollouts it evicted.
    """

    def __init__(self, max_rollouts: int) -> None:
        if max_rollouts < 1:
            raise ValueError(f"max_rollouts={max_rollouts}: must be >= 1")
        self._by_rollout: BoundedLRU[str, list[ServedCall]] = BoundedLRU(max_rollouts)
        self._lock = threading.Lock()  # record's look-up, append and insert as one step

    def record(self, call: ServedCall) -> int:
        with self._lock:
            calls = self._by_rollout.get(call.rollout_id)
            if calls is not None:
                calls.append(call)
                return 0
            return len(self._by_rollout.put(call.rollout_id, [call]))

    def take(self, rollout_ids: list[str]) -> list[ServedCall]:
        """Pop the records of `rollout_ids` (in the order asked; unknown ids contribute nothing)."""
        out: list[ServedCall] = []
        with self._lock:
            for rid in rollout_ids:
                out.extend(self._by_rollout.pop(rid) or ())
        return out

    def __len__(self) -> int:
        return len(self._by_rollout)
