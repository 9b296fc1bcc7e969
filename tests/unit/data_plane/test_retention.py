"""Retention: which staged keys a finished group owns, and the data-plane calls clearing them takes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nemo_gym.token_id_capture.staging import staging_key
from nemo_rl.data.calls import ServedCall
from nemo_rl.data_plane.partitions import TQStagingCleaner, orphaned_keys, reported_staged_keys


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


def test_reported_staged_keys_are_the_staged_calls_once_in_report_order() -> None:
    served = [
        ServedCall("g-i0", "c0", None, "text", 3, True),
        ServedCall("g-i0", "c1", "c0", "token_in", 2, False, "staging_failed (see worker log)"),
        ServedCall("g-i1", "c0", None, "text", 4, True),
        ServedCall("g-i0", "c0", None, "text", 3, True),
    ]
    assert reported_staged_keys(served) == ["g-i0/c0", "g-i1/c0"]
    assert reported_staged_keys([]) == []


class RecordingClient:
    """The two data-plane calls the cleaner may make, recorded; `present` is the partition listing."""

    def __init__(self, present: list[str]) -> None:
        self.present = present
        self.calls: list[tuple] = []

    def list_keys(self, partition, *, timeout_s=None):
        self.calls.append(("list_keys", partition, timeout_s))
        return list(self.present)

    def clear(self, partition, keys, *, timeout_s=None):
        self.calls.append(("clear", partition, list(keys), timeout_s))


def test_cleaner_clears_the_keys_the_group_owns_in_one_call_without_listing() -> None:
    client = RecordingClient(present=["never-listed/c0"])
    cleaner = TQStagingCleaner(client, "staging", timeout_s=7.0)
    orphans = cleaner.clear(["g-i0/c0"], ["g-i0", "g-i1"], ["g-i0/c0", "g-i0/c1", "g-i1/c0", "other-i0/c0"])
    assert orphans == 2
    # Reported keys of rollouts outside the group are never touched.
    assert client.calls == [("clear", "staging", ["g-i0/c0", "g-i0/c1", "g-i1/c0"], 7.0)]


def test_cleaner_lists_the_partition_only_without_a_served_report() -> None:
    client = RecordingClient(present=["g-i1/c0", "next-i0/c0", "g-i0/c0"])
    cleaner = TQStagingCleaner(client, "staging", timeout_s=7.0)
    assert cleaner.clear(["g-i0/c0"], ["g-i0", "g-i1"], None) == 1
    assert client.calls == [("list_keys", "staging", 7.0), ("clear", "staging", ["g-i0/c0", "g-i1/c0"], 7.0)]


def test_cleaner_makes_no_call_for_a_group_with_nothing_staged() -> None:
    client = RecordingClient(present=[])
    assert TQStagingCleaner(client, "staging", timeout_s=7.0).clear([], ["g-i0"], []) == 0
    assert client.calls == []
