"""TrainRow / KeptRollout / Placeholder / RolloutYield / GroupResult invariants."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from nemo_rl.data.errors import RecordInvariantError
from nemo_rl.data.rows import (
    CallLineage,
    GroupResult,
    KeptRollout,
    Placeholder,
    PlaceholderReason,
    RolloutYield,
    RowOrigin,
    TrainRow,
)


def _row(**changes) -> TrainRow:
    fields = dict(
        rollout_id="r-0", group_index=0, sample_index=0,
        token_ids=(1, 2, 3, 4), token_mask=(0.0, 0.0, 1.0, 1.0), generation_logprobs=(0.0, 0.0, -0.5, -1.5),
        reward=1.0, prompt_len=2, model_call_ids=("c0",), weight_versions=(7,),
        token_in_calls=0, text_root_calls=1, terminal_selection="response_id", origin=RowOrigin.CAPTURE,
        call_spans=((0, 4),),
    )
    fields.update(changes)
    return TrainRow(**fields)


def test_a_valid_row_is_frozen():
    row = _row()
    assert row.num_generated_tokens == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.reward = 0.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token_mask": (0.0, 0.0, 1.0)}, "lengths must be equal"),
        ({"token_ids": (), "token_mask": (), "generation_logprobs": ()}, "lengths must be equal and non-zero"),
        ({"token_mask": (0.0, 0.0, 0.0, 0.0), "generation_logprobs": (0.0,) * 4}, "no masked-in"),
        ({"token_mask": (0.0, 0.0, 0.5, 1.0)}, "must be 0.0 or 1.0"),
        ({"generation_logprobs": (0.0, 0.0, math.inf, -1.0)}, "finite floats"),
        ({"generation_logprobs": (0.0, 0.0, math.nan, -1.0)}, "finite floats"),
        ({"generation_logprobs": (0.0, -0.1, -0.5, -1.5)}, "masked-out tokens must carry logprob 0.0"),
        ({"token_ids": (1, -2, 3, 4)}, "non-negative ints"),
        ({"prompt_len": 3}, "first prompt_len=3 tokens must be masked out"),
        ({"prompt_len": 4}, "prompt_len must be in [0, 4)"),
        ({"reward": math.nan}, "reward must be a finite float"),
        ({"reward": 1}, "reward must be a finite float"),
        ({"weight_versions": (7, 7)}, "one weight version per call"),
        ({"text_root_calls": 0}, "must equal the 1 chain calls"),
        ({"terminal_selection": None}, "must name their terminal_selection"),
        ({"weight_versions": (None,)}, "non-negative int weight version"),
        ({"origin": RowOrigin.LEGACY}, "legacy rows carry no call modes"),
        ({"call_spans": ()}, "capture rows need one call span per call"),
        ({"call_spans": ((0, 2), (2, 4))}, "2 call spans for 1 calls"),
        ({"call_spans": ((1, 4),)}, "call spans must be contiguous, non-empty and start at 0"),
        ({"call_spans": ((0, 3),)}, "call spans cover 3 tokens of 4"),
        ({"chain_index": -1}, "chain_index must be a non-negative int"),
        ({"sample_index": -1}, "sample_index must be a non-negative int"),
        ({"rollout_id": ""}, "rollout_id must be a non-empty str"),
    ],
)
def test_row_invariants(changes, message):
    with pytest.raises(RecordInvariantError, match=re.escape(message)) as excinfo:
        _row(**changes)
    assert excinfo.value.kind == "row"


def test_legacy_row_has_no_modes_versions_or_selection():
    row = _row(origin=RowOrigin.LEGACY, text_root_calls=0, terminal_selection=None, weight_versions=(None,),
               call_spans=())
    assert row.origin is RowOrigin.LEGACY
    assert (row.token_weight_versions, row.loss_call_ids()) == ((None,) * 4, frozenset({"c0"}))
    with pytest.raises(RecordInvariantError, match="no weight versions") as excinfo:
        _row(origin=RowOrigin.LEGACY, text_root_calls=0, terminal_selection=None)
    assert excinfo.value.kind == "row"


def test_placeholder_needs_a_typed_reason_and_finite_reward():
    Placeholder("r-0", 0, 0, PlaceholderReason.RUN_FAILED, "boom", None)
    with pytest.raises(RecordInvariantError, match="reason must be a PlaceholderReason") as excinfo:
        Placeholder("r-0", 0, 0, "run_failed", "boom")
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="finite float or None") as excinfo:
        Placeholder("r-0", 0, 0, PlaceholderReason.RUN_FAILED, "boom", math.inf)
    assert excinfo.value.kind == "row"


def _two_call_row(**changes) -> TrainRow:
    fields = dict(
        token_ids=(1, 2, 3, 4, 5, 6), token_mask=(0.0, 1.0, 1.0, 0.0, 1.0, 1.0),
        generation_logprobs=(0.0, -0.1, -0.2, 0.0, -0.3, -0.4), prompt_len=1, model_call_ids=("c0", "c1"),
        weight_versions=(7, 8), token_in_calls=1, text_root_calls=1, call_spans=((0, 3), (3, 6)),
    )
    fields.update(changes)
    return _row(**fields)


def test_call_spans_expand_versions_and_name_the_loss_calls():
    row = _two_call_row()
    assert row.token_weight_versions == (7, 7, 7, 8, 8, 8)
    assert row.loss_call_ids() == {"c0", "c1"}
    carried = _two_call_row(token_mask=(0.0, 0.0, 0.0, 0.0, 1.0, 1.0), generation_logprobs=(0.0,) * 4 + (-0.3, -0.4),
                            chain_index=1)
    assert carried.loss_call_ids() == {"c1"}
    assert carried.num_generated_tokens == 2


def _kept(rows, reward=1.0, **changes):
    fields = dict(rollout_id="r-0", group_index=0, sample_index=0, rows=tuple(rows), reward=reward,
                  terminal_selection="response_id")
    fields.update(changes)
    return KeptRollout(**fields)


def test_kept_rollout_rows_are_chains_that_never_share_a_loss_call():
    first = _two_call_row()
    second = _two_call_row(token_mask=(0.0, 0.0, 0.0, 0.0, 1.0, 1.0), generation_logprobs=(0.0,) * 4 + (-0.3, -0.4),
                           model_call_ids=("c0", "c2"), chain_index=1)
    kept = _kept([first, second], yield_=RolloutYield(6, 6, (), 2))
    assert kept.num_generated_tokens == 6

    with pytest.raises(RecordInvariantError, match=re.escape("calls ['c0'] are in the loss of two rows")) as excinfo:
        _kept([first, dataclasses.replace(second, token_mask=first.token_mask,
                                          generation_logprobs=first.generation_logprobs)])
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="at least one row") as excinfo:
        _kept([])
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="row 1 must have chain_index 1") as excinfo:
        _kept([first, dataclasses.replace(second, chain_index=0)])
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="row 0 must have chain_index 0 and the rollout's reward") as excinfo:
        _kept([first], reward=0.5)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="row 0 belongs to r-9 slot 0/0") as excinfo:
        _kept([dataclasses.replace(first, rollout_id="r-9")])
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="row 0 is Placeholder") as excinfo:
        _kept([Placeholder("r-0", 0, 0, PlaceholderReason.RUN_FAILED, "boom")])
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="yield counts 5 kept tokens, rows hold 6") as excinfo:
        _kept([first, second], yield_=RolloutYield(6, 5, (), 2))
    assert excinfo.value.kind == "row"


def test_rollout_yield_counts_are_non_negative_ints():
    RolloutYield(None, 0)
    with pytest.raises(RecordInvariantError, match="kept_generated_tokens must be a non-negative int") as excinfo:
        RolloutYield(3, -1)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="chains must be a non-negative int") as excinfo:
        RolloutYield(3, 1, (), 1.0)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="served_generated_tokens must be a non-negative int or None") as excinfo:
        RolloutYield(-3, 1)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="unverifiable token counts must be non-negative ints") as excinfo:
        RolloutYield(3, 1, (("served_not_staged", -2),))
    assert excinfo.value.kind == "row"


def test_abandoned_retries_and_lineage_are_checked():
    assert RolloutYield(9, 7, (), 2, False, 1, 2, CallLineage(3, 0, 0)).abandoned_retry_tokens == 2
    assert RolloutYield(None, 7, (), 2, False, 1).abandoned_retry_calls == 1  # calls known from the manifest alone
    with pytest.raises(RecordInvariantError, match="abandoned_retry_calls must be a non-negative int") as excinfo:
        RolloutYield(9, 7, (), 2, False, -1)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="abandoned_retry_tokens come from the served report") as excinfo:
        RolloutYield(None, 7, (), 2, False, 1, 2)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="lineage must be a CallLineage or None") as excinfo:
        RolloutYield(9, 7, lineage=(3, 0, 0))
    assert excinfo.value.kind == "row"


def test_call_lineage_counts_continuations_as_token_in_plus_unresolved():
    lineage = CallLineage(token_in_calls=3, unresolved_continuations=1, branches=2)
    assert lineage.continuation_calls == 4
    with pytest.raises(RecordInvariantError, match="unresolved_continuations must be a non-negative int") as excinfo:
        CallLineage(3, -1, 0)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="branches must be a non-negative int") as excinfo:
        CallLineage(3, 0, 1.0)
    assert excinfo.value.kind == "row"


def test_a_placeholder_keeps_no_generated_token():
    Placeholder("r-0", 0, 0, PlaceholderReason.RUN_FAILED, "boom", None, None, RolloutYield(4, 0, (("run_failed", 4),)))
    with pytest.raises(RecordInvariantError, match="a placeholder keeps no generated token") as excinfo:
        Placeholder("r-0", 0, 0, PlaceholderReason.RUN_FAILED, "boom", None, None, RolloutYield(4, 1))
    assert excinfo.value.kind == "row"


def test_group_result_holds_samples_zero_to_n_minus_one_in_order():
    first = _two_call_row(rollout_id="r-0", sample_index=0)
    second = _two_call_row(rollout_id="r-0", sample_index=0, model_call_ids=("c0", "c2"), chain_index=1,
                           token_mask=(0.0, 0.0, 0.0, 0.0, 1.0, 1.0), generation_logprobs=(0.0,) * 4 + (-0.3, -0.4))
    kept = _kept([first, second])
    hole = Placeholder("r-1", 0, 1, PlaceholderReason.RUN_TIMEOUT, "slow")
    group = GroupResult(0, (kept, hole))

    assert (group.n, group.kept, group.rows, group.placeholders) == (2, (kept,), (first, second), (hole,))
    with pytest.raises(RecordInvariantError, match="entry 0 is group 0 sample 1") as excinfo:
        GroupResult(0, (hole, kept))
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="appears twice") as excinfo:
        GroupResult(0, (kept, Placeholder("r-0", 0, 1, PlaceholderReason.RUN_TIMEOUT, "slow")))
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="entry 1 is group 5") as excinfo:
        GroupResult(0, (kept, Placeholder("r-1", 5, 1, PlaceholderReason.RUN_TIMEOUT, "slow")))
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="entry 0 is TrainRow") as excinfo:
        GroupResult(0, (first,))
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="at least one entry") as excinfo:
        GroupResult(0, ())
    assert excinfo.value.kind == "row"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token_mask": (1.0, 0.0, 1.0, 1.0), "generation_logprobs": (-0.1, 0.0, -0.5, -1.5), "prompt_len": 0},
         "capture rows start with a prompt token"),
        ({"generation_logprobs": (0.0, 0.0, 0.5, -1.5)}, "a sampled token's logprob must be <= 0"),
    ],
)
def test_a_capture_row_is_one_the_trainer_takes(changes, message):
    # TrainBatch refuses both (position 0 has no prefix; a logprob is <= 0): a capture row never holds them.
    with pytest.raises(RecordInvariantError, match=re.escape(message)) as excinfo:
        _row(**changes)
    assert excinfo.value.kind == "row"
