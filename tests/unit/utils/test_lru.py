"""`BoundedLRU`: never over its bound, least recently used evicted first, atomic across threads."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.utils.lru import BoundedLRU

KEYS = st.integers(min_value=0, max_value=7)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), KEYS, st.integers(min_value=0, max_value=6)),
        st.tuples(st.just("get"), KEYS, st.none()),
        st.tuples(st.just("peek"), KEYS, st.none()),
        st.tuples(st.just("touch"), KEYS, st.none()),
        st.tuples(st.just("pop"), KEYS, st.none()),
    ),
    max_size=60,
)


class ModelLRU:
    """The reference: a list of (key, value), least recently used first."""

    def __init__(self, max_weight: int) -> None:
        self.max_weight = max_weight
        self.items: list[tuple[int, int]] = []

    def _index(self, key: int) -> int | None:
        return next((i for i, (k, _) in enumerate(self.items) if k == key), None)

    def _use(self, key: int) -> int | None:
        i = self._index(key)
        if i is None:
            return None
        item = self.items.pop(i)
        self.items.append(item)
        return item[1]

    def apply(self, op: str, key: int, value: int | None):
        if op == "put":
            i = self._index(key)
            if i is not None:
                self.items.pop(i)
            if value > self.max_weight:
                return [(key, value)]
            self.items.append((key, value))
            evicted = []
            while sum(v for _, v in self.items) > self.max_weight:
                evicted.append(self.items.pop(0))
            return evicted
        if op == "get":
            return self._use(key)
        if op == "touch":
            return self._use(key) is not None
        i = self._index(key)
        if i is None:
            return None
        return self.items[i][1] if op == "peek" else self.items.pop(i)[1]


@settings(max_examples=300, deadline=None)
@given(max_weight=st.integers(min_value=0, max_value=12), ops=OPS)
def test_weighted_lru_matches_the_reference_and_never_exceeds_its_bound(max_weight, ops):
    lru: BoundedLRU[int, int] = BoundedLRU(max_weight, weight=lambda v: v)
    model = ModelLRU(max_weight)
    for op, key, value in ops:
        got = lru.put(key, value) if op == "put" else getattr(lru, op)(key)
        assert got == model.apply(op, key, value), (op, key, value)
        assert lru.weight <= max_weight
        assert lru.keys() == [k for k, _ in model.items]  # least recently used first
        assert lru.weight == sum(v for _, v in model.items) and len(lru) == len(model.items)


@settings(max_examples=200, deadline=None)
@given(max_items=st.integers(min_value=1, max_value=5), keys=st.lists(KEYS, max_size=40))
def test_unit_weights_bound_the_entry_count_and_evict_the_least_recently_used(max_items, keys):
    lru: BoundedLRU[int, str] = BoundedLRU(max_items)
    for key in keys:
        evicted = lru.put(key, str(key))
        assert len(lru) <= max_items
        assert all(old not in lru for old, _ in evicted)
    recent = list(dict.fromkeys(reversed(keys)))[:max_items]
    assert lru.keys() == list(reversed(recent))


def test_peek_and_membership_keep_the_order_get_and_touch_refresh_it():
    lru: BoundedLRU[str, int] = BoundedLRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.peek("a") == 1 and "a" in lru
    assert lru.put("c", 3) == [("a", 1)]  # peeked, not used: still the oldest
    assert lru.get("b") == 2
    assert lru.put("d", 4) == [("c", 3)]
    assert lru.touch("b") and not lru.touch("zz")
    assert lru.keys() == ["d", "b"]
    assert lru.pop("d") == 4 and lru.pop("d", -1) == -1 and lru.get("d") is None


def test_a_value_heavier_than_the_bound_is_never_held_and_replaces_nothing_silently():
    lru: BoundedLRU[str, list[int]] = BoundedLRU(3, weight=len)
    lru.put("a", [1, 2])
    assert lru.put("a", [1, 2, 3, 4]) == [("a", [1, 2, 3, 4])]  # the old value went too: the key is absent
    assert "a" not in lru and lru.weight == 0


@pytest.mark.parametrize("bad", [-1, 1.5, None])
def test_the_bound_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match="max_weight"):
        BoundedLRU(bad)


def test_a_negative_weight_is_refused():
    with pytest.raises(ValueError, match="weight of a value"):
        BoundedLRU(3, weight=lambda v: -1).put("a", 0)


def test_concurrent_writers_and_readers_keep_the_bound_and_the_accounting():
    lru: BoundedLRU[int, int] = BoundedLRU(50, weight=lambda v: v % 3)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(2000):
                key = (seed * 7919 + i) % 97
                lru.put(key, i)
                lru.get((key + 1) % 97)
                lru.touch((key + 2) % 97)
                if i % 5 == 0:
                    lru.pop((key + 3) % 97)
                assert lru.weight <= 50
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert lru.weight == sum(lru.peek(k) % 3 for k in lru.keys()) <= 50
