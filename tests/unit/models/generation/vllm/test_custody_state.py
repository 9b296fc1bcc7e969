"""PrefixCache seeding: what it admits, what it refuses, and its bound (a store that counts fetches)."""

from __future__ import annotations

import pytest
from nemo_gym.token_id_capture.staging import compute_chain_hash

from nemo_rl.models.generation.vllm.custody_state import CacheEntry, PrefixCache, PrefixMismatchError


class NoStore:
    """A staging source that must not be read (every test here resolves from seeded entries)."""

    def __init__(self) -> None:
        self.fetches: list[list[str]] = []

    def fetch(self, keys):
        self.fetches.append(list(keys))
        raise AssertionError(f"unexpected fetch of {keys}")


ROOT = [1, 2, 3, 4]
CHILD = [5, 6]
ROOT_HASH = compute_chain_hash(None, ROOT)
CHILD_HASH = compute_chain_hash(ROOT_HASH, CHILD)


def _seed_chain(cache: PrefixCache) -> None:
    assert cache.seed("r/a", parent_key=None, parent_chain_hash=None, delta=ROOT, cum_len=4, chain_hash=ROOT_HASH)
    assert cache.seed("r/b", parent_key="r/a", parent_chain_hash=ROOT_HASH, delta=CHILD, cum_len=6, chain_hash=CHILD_HASH)


def test_seeded_chain_resolves_without_a_fetch() -> None:
    store = NoStore()
    cache = PrefixCache(store, max_tokens=100)
    _seed_chain(cache)
    assert cache.resolve(["r/a", "r/b"], 6, CHILD_HASH) == ROOT + CHILD
    assert cache.entry("r/b") == CacheEntry("r/a", (5, 6), 6, CHILD_HASH)
    assert (cache.seeded_keys, cache.fetched_keys, cache.cached_tokens, store.fetches) == (2, 0, 6, [])


@pytest.mark.parametrize(
    "seed",
    [
        dict(parent_key=None, parent_chain_hash=None, delta=ROOT, cum_len=4, chain_hash=CHILD_HASH),  # wrong hash
        dict(parent_key=None, parent_chain_hash=None, delta=ROOT, cum_len=5, chain_hash=ROOT_HASH),  # root with a prefix
        dict(parent_key="r/a", parent_chain_hash=ROOT_HASH, delta=ROOT, cum_len=4, chain_hash=compute_chain_hash(ROOT_HASH, ROOT)),  # child at 0
        dict(parent_key="r/a", parent_chain_hash=None, delta=CHILD, cum_len=6, chain_hash=compute_chain_hash(None, CHILD)),  # no parent hash
        dict(parent_key=None, parent_chain_hash=None, delta=[], cum_len=0, chain_hash=compute_chain_hash(None, [])),  # empty
    ],
    ids=["hash", "root_with_prefix", "child_at_zero", "child_without_parent_hash", "empty"],
)
def test_an_inconsistent_seed_is_refused_and_not_cached(seed) -> None:
    cache = PrefixCache(NoStore(), max_tokens=100)
    assert cache.seed("r/x", **seed) is False
    assert (cache.entry("r/x"), cache.seed_rejected, cache.seeded_keys, cache.cached_tokens) == (None, 1, 0, 0)


def test_a_seeded_entry_in_the_wrong_chain_is_a_mismatch() -> None:
    cache = PrefixCache(NoStore(), max_tokens=100)
    _seed_chain(cache)
    with pytest.raises(PrefixMismatchError, match="r/b: cached entry does not follow None"):
        cache.resolve(["r/b"], 6, CHILD_HASH)


def test_seeds_share_the_bound_lru_and_an_oversize_delta_is_never_cached() -> None:
    cache = PrefixCache(NoStore(), max_tokens=6)
    _seed_chain(cache)
    big = list(range(7))
    assert cache.seed("s/a", parent_key=None, parent_chain_hash=None, delta=big, cum_len=7, chain_hash=compute_chain_hash(None, big))
    # Accepted but over the bound alone: not cached, and nothing else was evicted for it.
    assert (cache.entry("s/a"), cache.cached_tokens, cache.seeded_keys) == (None, 6, 2)
    small = [9]
    assert cache.seed("t/a", parent_key=None, parent_chain_hash=None, delta=small, cum_len=1, chain_hash=compute_chain_hash(None, small))
    # 7 tokens > 6: the least recently used entry (r/a) goes.
    assert (cache.entry("r/a"), cache.cached_tokens) == (None, 3)
    assert cache.entry("r/b") is not None and cache.entry("t/a") is not None


def test_reseeding_a_key_replaces_its_entry() -> None:
    cache = PrefixCache(NoStore(), max_tokens=100)
    _seed_chain(cache)
    other = [7]
    other_hash = compute_chain_hash(ROOT_HASH, other)
    assert cache.seed("r/b", parent_key="r/a", parent_chain_hash=ROOT_HASH, delta=other, cum_len=5, chain_hash=other_hash)
    assert cache.entry("r/b") == CacheEntry("r/a", (7,), 5, other_hash)
    assert cache.cached_tokens == 5
