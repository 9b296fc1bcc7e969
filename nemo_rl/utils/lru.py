"""One bounded, thread-safe least-recently-used map: every bounded cache and registry of ours.

`BoundedLRU(max_weight, weight=...)` keeps the total weight (1 per entry by default) within
`max_weight`, evicting least recently used entries first; a single value heavier than the bound
is never held. `put`, `get` and `touch` refresh recency; `peek`, `in`, `len`, `keys` and `pop`
never change the order. `put` returns what it pushed out, oldest first, so owners can count
evictions (replacing a value is not one). Each method is atomic under one internal lock; a
compound read-then-write is atomic only under the owner's lock. Weights are non-negative ints
that must not change while a value is held.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _unit(_: object) -> int:
    return 1


class BoundedLRU(Generic[K, V]):
    """Least-recently-used map bounded by total weight (entry count by default); thread-safe."""

    def __init__(self, max_weight: int, *, weight: Callable[[V], int] = _unit) -> None:
        if type(max_weight) is not int or max_weight < 0:
            raise ValueError(f"max_weight={max_weight!r}: must be an int >= 0")
        self._max_weight = max_weight
        self._weight_of = weight
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    @property
    def max_weight(self) -> int:
        return self._max_weight

    @property
    def weight(self) -> int:
        """Total weight held (the entry count with unit weights)."""
        with self._lock:
            return self._weight

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Hold `value` under `key` as the most recently used; returns what was pushed out (see contract)."""
        w = self._checked_weight(value)
        with self._lock:
            if key in self._entries:
                self._weight -= self._checked_weight(self._entries.pop(key))
            if w > self._max_weight:
                return [(key, value)]
            self._entries[key] = value
            self._weight += w
            evicted: list[tuple[K, V]] = []
            while self._weight > self._max_weight:
                old_key, old = self._entries.popitem(last=False)
                self._weight -= self._checked_weight(old)
                evicted.append((old_key, old))
            return evicted

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of `key` (now the most recently used), else `default`."""
        with self._lock:
            if key not in self._entries:
                return default
            self._entries.move_to_end(key)
            return self._entries[key]

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The value of `key` without using it (the order is unchanged), else `default`."""
        with self._lock:
            return self._entries.get(key, default)

    def touch(self, key: K) -> bool:
        """Make `key` the most recently used; False when it is not held."""
        with self._lock:
            if key not in self._entries:
                return False
            self._entries.move_to_end(key)
            return True

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Remove `key` and return its value, else `default`."""
        with self._lock:
            if key not in self._entries:
                return default
            value = self._entries.pop(key)
            self._weight -= self._checked_weight(value)
            return value

    def keys(self) -> list[K]:
        """The held keys, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _checked_weight(self, value: V) -> int:
        w = self._weight_of(value)
        if type(w) is not int or w < 0:
            raise ValueError(f"weight of a value must be an int >= 0, got {w!r}")
        return w
