"""The freshness rule read from the rows' own weight versions: exact boundaries, every call counts,
placeholders have no age, unversioned or future rows refuse, and the age metrics (exact values,
and a property against a per-token oracle)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.data.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason, RowOrigin, RowRef, TrainRow
from nemo_rl.experience.errors import AccountingError
from nemo_rl.experience.staleness import (
    age_histogram,
    age_histogram_metrics,
    group_age,
    group_min_version,
    is_fresh,
    rollout_versions,
    split_fresh,
    trajectory_age_metrics,
    trajectory_ages,
)


def capture_row(rollout_id: str, group: int, sample: int, versions: tuple[int, ...], chain: int = 0,
                loss_calls: tuple[int, ...] | None = None) -> TrainRow:
    """One call per version, each span two tokens (a prompt token, then a generated one in the loss
    when the call is in `loss_calls`, else carried context)."""
    calls = len(versions)
    loss = set(range(calls)) if loss_calls is None else set(loss_calls)
    mask = tuple(m for i in range(calls) for m in (0.0, 1.0 if i in loss else 0.0))
    return TrainRow(
        rollout_id=rollout_id, group_index=group, sample_index=sample,
        token_ids=tuple(range(1, 2 * calls + 1)), token_mask=mask,
        generation_logprobs=tuple(-0.5 if m else 0.0 for m in mask), reward=1.0, prompt_len=1,
        model_call_ids=tuple(f"{rollout_id}-c{chain}-{i}" for i in range(calls)), weight_versions=versions,
        token_in_calls=calls - 1, text_root_calls=1, terminal_selection="response_id", origin=RowOrigin.CAPTURE,
        call_spans=tuple((2 * i, 2 * i + 2) for i in range(calls)), chain_index=chain,
    )


def legacy_row(rollout_id: str, group: int, sample: int) -> TrainRow:
    return TrainRow(
        rollout_id=rollout_id, group_index=group, sample_index=sample, token_ids=(1, 2), token_mask=(0.0, 1.0),
        generation_logprobs=(0.0, -0.5), reward=1.0, prompt_len=1, model_call_ids=("c",), weight_versions=(None,),
        token_in_calls=0, text_root_calls=0, terminal_selection=None, origin=RowOrigin.LEGACY,
    )


def as_ref(row: TrainRow) -> RowRef:
    return RowRef.of(row, f"train/{row.rollout_id}/{row.chain_index}", hashlib.sha256(b"x").hexdigest(), False)


def kept(group: int, sample: int, chains: list[tuple[int, ...]], refs: bool = False) -> KeptRollout:
    """A kept rollout whose chain c has calls served by chains[c]'s versions (chain 0 is the terminal)."""
    rid = f"r-g{group}-i{sample}"
    rows = [capture_row(rid, group, sample, versions, chain=c) for c, versions in enumerate(chains)]
    rows = [as_ref(r) for r in rows] if refs else rows
    return KeptRollout(rid, group, sample, tuple(rows), 1.0, "response_id")


def placeholder(group: int, sample: int) -> Placeholder:
    return Placeholder(f"r-g{group}-i{sample}", group, sample, PlaceholderReason.RUN_FAILED, "boom")


def group_of(group: int, entries: list[list[tuple[int, ...]] | None], refs: bool = False) -> GroupResult:
    """entries[i] None: a placeholder; else the chains of a kept rollout."""
    return GroupResult(group, tuple(
        placeholder(group, i) if chains is None else kept(group, i, chains, refs) for i, chains in enumerate(entries)
    ))


def test_the_synchronous_loops_rows_are_age_zero_and_fresh_on_policy():
    # Sync: the rows of a step carry the version the trainer holds (the last refit): age 0.
    for version in (0, 1, 7):
        group = group_of(0, [[(version,)], [(version, version)]])
        assert group_age(group, version) == 0
        assert is_fresh(group, version, max_age=0)


@pytest.mark.parametrize("refs", [False, True], ids=["TrainRow", "RowRef"])
@pytest.mark.parametrize(("trainer", "max_age"), [(5, 0), (5, 1), (5, 3), (9, 2)])
def test_the_boundary_is_version_at_least_trainer_minus_max_age(refs, trainer, max_age):
    boundary = trainer - max_age
    at = group_of(0, [[(trainer,)], [(boundary, trainer)]], refs)
    below = group_of(0, [[(trainer,)], [(boundary - 1, trainer)]], refs)
    assert group_age(at, trainer) == max_age and is_fresh(at, trainer, max_age)
    assert group_age(below, trainer) == max_age + 1 and not is_fresh(below, trainer, max_age)


@pytest.mark.parametrize("refs", [False, True], ids=["TrainRow", "RowRef"])
def test_every_call_of_every_row_counts_not_only_the_terminal_chains_loss(refs):
    # The oldest token hides in a non-terminal chain of the last rollout: it decides.
    group = group_of(0, [[(4,)], [(4, 4), (2, 4)]], refs)
    assert group_min_version(group) == 2
    assert not is_fresh(group, 4, max_age=1)
    # A carried (non-loss) call of an old version is a token of the trajectory too.
    rid = "r-g0-i0"
    carried = capture_row(rid, 0, 0, (2, 4), loss_calls=(1,))
    assert carried.token_weight_versions == (2, 2, 4, 4)
    row = as_ref(carried) if refs else carried
    group = GroupResult(0, (KeptRollout(rid, 0, 0, (row,), 1.0, "response_id"),))
    assert group_age(group, 4) == 2 and not is_fresh(group, 4, 1) and is_fresh(group, 4, 2)


def test_a_group_without_a_kept_rollout_has_no_age_and_is_never_stale():
    group = group_of(0, [None, None, None])
    assert group_min_version(group) is None
    assert group_age(group, 10**6) is None
    assert is_fresh(group, 10**6, max_age=0)
    assert trajectory_ages([group], 3) == [] and trajectory_age_metrics([group], 3) == {}
    assert age_histogram([group], 3) == {}


def test_placeholders_carry_no_version_and_do_not_age_a_group():
    group = group_of(0, [None, [(6,)], None, [(5,)]])
    assert group_age(group, 6) == 1
    assert trajectory_ages([group], 6) == [0, 1]


def test_legacy_rows_refuse_with_the_fix():
    rid = "r-g0-i0"
    group = GroupResult(0, (KeptRollout(rid, 0, 0, (legacy_row(rid, 0, 0),), 1.0, None),))
    with pytest.raises(AccountingError, match=r"r-g0-i0 row 0 \(legacy\).*token_capture\.enabled=true") as excinfo:
        is_fresh(group, 3, 1)
    assert excinfo.value.kind == "unversioned_row"
    with pytest.raises(AccountingError) as excinfo:
        trajectory_age_metrics([group], 3)
    assert excinfo.value.kind == "unversioned_row"
    assert type(excinfo.value) is AccountingError


def test_a_row_newer_than_the_trainer_is_a_bookkeeping_bug():
    group = group_of(2, [[(3,)], [(5,)]])
    with pytest.raises(AccountingError, match="group 2 carries weight version 3 but the trainer holds version 2") as excinfo:
        is_fresh(group, 2, 10)
    assert excinfo.value.kind == "future_version"
    with pytest.raises(AccountingError, match="rollout r-g2-i1 carries weight version 5") as excinfo:
        trajectory_ages([group], 4)
    assert excinfo.value.kind == "future_version"


@pytest.mark.parametrize(("call", "message"), [
    (lambda g: is_fresh(g, 3, -1), "max_age must be a non-negative int, got -1"),
    (lambda g: is_fresh(g, -1, 0), "trainer_version must be a non-negative int, got -1"),
    (lambda g: group_age(g, 1.0), "trainer_version must be a non-negative int, got 1.0"),
    (lambda g: age_histogram_metrics([g], 3, True), "max_age must be a non-negative int, got True"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call(group_of(0, [[(3,)]]))


def test_split_fresh_keeps_order():
    old, new, empty = group_of(0, [[(1,)]]), group_of(1, [[(3,)]]), group_of(2, [None])
    assert split_fresh([old, new, empty], 3, 1) == ((new, empty), (old,))


def test_rollout_versions_are_distinct_and_ascending():
    rollout = kept(0, 0, [(5, 3, 5), (4,)])
    assert rollout_versions(rollout) == (3, 4, 5)


def test_age_metrics_are_per_kept_rollout_from_the_rows():
    groups = [group_of(0, [[(7,)], [(6, 7)], None]), group_of(1, [[(5,)], [(7,), (7,)]])]
    assert trajectory_ages(groups, 7) == [0, 1, 2, 0]
    assert trajectory_age_metrics(groups, 7) == {
        "async/trajectory_age_steps_min": 0.0, "async/trajectory_age_steps_mean": 0.75,
        "async/trajectory_age_steps_max": 2.0,
    }
    assert age_histogram(groups, 7) == {0: 2, 1: 1, 2: 1}
    assert age_histogram_metrics(groups, 7, max_age=1) == {
        "async/trajectory_age_steps/hist/0": 2.0, "async/trajectory_age_steps/hist/1": 1.0,
        "async/trajectory_age_steps/hist/older": 1.0,
    }
    assert age_histogram_metrics([group_of(0, [None])], 7, max_age=0) == {
        "async/trajectory_age_steps/hist/0": 0.0, "async/trajectory_age_steps/hist/older": 0.0,
    }


chains_st = st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=3).map(tuple), min_size=1, max_size=3)
entries_st = st.lists(st.one_of(st.none(), chains_st), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(entries=entries_st, refs=st.booleans(), extra=st.integers(0, 3), max_age=st.integers(0, 6))
def test_freshness_and_ages_match_a_per_token_oracle(entries, refs, extra, max_age):
    group = group_of(0, entries, refs)
    # The oracle reads every token's version from the TrainRows' spans (a different path than the
    # per-call minimum the module takes; for RowRefs the TrainRow it was built from).
    token_versions = [
        [v for c, chain in enumerate(chains) for v in capture_row("o", 0, 0, chain, chain=c).token_weight_versions]
        for chains in entries if chains is not None
    ]
    all_versions = [v for rollout in token_versions for v in rollout]
    trainer = max(all_versions, default=0) + extra
    oracle_fresh = all(v >= trainer - max_age for v in all_versions)
    assert is_fresh(group, trainer, max_age) == oracle_fresh
    oracle_ages = [trainer - min(rollout) for rollout in token_versions]
    assert trajectory_ages([group], trainer) == oracle_ages
    metrics = trajectory_age_metrics([group], trainer)
    if oracle_ages:
        assert metrics["async/trajectory_age_steps_max"] == max(oracle_ages)
        assert metrics["async/trajectory_age_steps_min"] == min(oracle_ages)
        assert metrics["async/trajectory_age_steps_mean"] == pytest.approx(sum(oracle_ages) / len(oracle_ages))
        assert group_age(group, trainer) == max(oracle_ages)
    else:
        assert metrics == {} and group_age(group, trainer) is None and is_fresh(group, trainer, max_age)
    assert sum(age_histogram([group], trainer).values()) == len(oracle_ages)
