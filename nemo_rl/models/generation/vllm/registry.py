"""The custody core's two bounded registries and the request digest a re-send must match.

Contract:
- `AdmittedCalls`: every admitted (rollout_id, model_call_id) of this worker with its request
  digest and, once answered, its reply (compact JSON), so a byte-identical re-send is replayed
  and anything else under a used id is refused; a call refused or not generated is forgotten
  (`release`), one generated without a reply is never replayed (`spoil`), and a reported
  rollout's replies are dropped (`retire`). Bounded LRU (`max_calls`).
- `ServedRegistry`: rollout_id -> the `ServedCall`s this worker recorded, in call order, popped
  by `take`; past `max_rollouts` the rollout written least recently is dropped whole and counted.
- Both are thread-safe (the driver's report runs on a worker thread) and bounded by
  `nemo_rl.utils.lru.BoundedLRU`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_rl.data.served import ServedCall
from nemo_rl.utils.lru import BoundedLRU


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
