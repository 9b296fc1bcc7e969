"""orphaned_keys: which staged keys of a finished group no manifest named (pure logic)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nemo_gym.token_id_capture.staging import staging_key
from nemo_rl.token_capture.retention import orphaned_keys


def test_orphans_are_the_groups_unnamed_keys_in_listing_order() -> None:
    present = ["g-i0/c1", "other-i0/c0", "g-i1/c0", "g-i0/c0", "g-i0/c1", "g-i10/c0", "no-separator"]
    assert orphaned_keys(present, named=["g-i0/c0"], rollout_ids=["g-i0", "g-i1"]) == ["g-i0/c1", "g-i1/c0"]


def test_nothing_is_orphaned_when_every_key_is_named_or_foreign() -> None:
    assert orphaned_keys(["a/c0", "b/c0"], named=["a/c0"], rollout_ids=["a"]) == []
    assert orphaned_keys([], named=[], rollout_ids=["a"]) == []


_ids = st.text(alphabet="abc-0123", min_size=1, max_size=6)
_calls = st.text(alphabet="c0123", min_size=1, max_size=3)


@given(
    group=st.sets(_ids, min_size=1, max_size=4),
    others=st.sets(_ids, max_size=4),
    calls=st.lists(st.tuples(_ids, _calls), max_size=20),
    named_mask=st.lists(st.booleans(), max_size=20),
)
def test_orphans_partition_the_groups_keys(group, others, calls, named_mask) -> None:
    others = others - group
    keys = [staging_key(r, c) for r, c in calls if r in group | others]
    named = [k for k, flag in zip(keys, named_mask) if flag]
    orphans = orphaned_keys(keys, named, group)

    group_keys = {k for k in keys if k.split("/", 1)[0] in group}
    assert set(orphans) == group_keys - set(named)
    assert len(orphans) == len(set(orphans))
    assert all(k.split("/", 1)[0] in group for k in orphans)
