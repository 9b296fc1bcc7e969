"""TrainRow / Placeholder / GroupResult invariants."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from nemo_rl.token_capture.rows import (
    GroupResult,
    Placeholder,
    PlaceholderReason,
    RowInvariantError,
    RowOrigin,
    TrainRow,
)


def _row(**changes) -> TrainRow:
    fields = dict(
        rollout_id="r-0", group_index=0, sample_index=0,
        token_ids=(1, 2, 3, 4), token_mask=(0.0, 0.0, 1.0, 1.0), generation_logprobs=(0.0, 0.0, -0.5, -1.5),
        reward=1.0, prompt_len=2, model_call_ids=("c0",), weight_versions=(7,),
        token_in_calls=0, text_root_calls=1, terminal_selection="response_id", origin=RowOrigin.CAPTURE,
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
        ({"text_root_calls": 0}, "must equal the 1 terminal-chain calls"),
        ({"terminal_selection": None}, "must name their terminal_selection"),
        ({"weight_versions": (None,)}, "non-negative int weight version"),
        ({"origin": RowOrigin.LEGACY}, "legacy rows carry no call modes"),
        ({"sample_index": -1}, "sample_index must be a non-negative int"),
        ({"rollout_id": ""}, "rollout_id must be a non-empty str"),
    ],
)
def test_row_invariants(changes, message):
    with pytest.raises(RowInvariantError, match=re.escape(message)):
        _row(**changes)


def test_legacy_row_has_no_modes_versions_or_selection():
    row = _row(origin=RowOrigin.LEGACY, text_root_calls=0, terminal_selection=None, weight_versions=(None,))
    assert row.origin is RowOrigin.LEGACY
    with pytest.raises(RowInvariantError, match="no weight versions"):
        _row(origin=RowOrigin.LEGACY, text_root_calls=0, terminal_selection=None)


def test_placeholder_needs_a_typed_reason_and_finite_reward():
    Placeholder("r-0", 0, 0, PlaceholderReason.RUN_FAILED, "boom", None)
    with pytest.raises(RowInvariantError, match="reason must be a PlaceholderReason"):
        Placeholder("r-0", 0, 0, "run_failed", "boom")
    with pytest.raises(RowInvariantError, match="finite float or None"):
        Placeholder("r-0", 0, 0, PlaceholderReason.RUN_FAILED, "boom", math.inf)


def test_group_result_holds_samples_zero_to_n_minus_one_in_order():
    row = _row(rollout_id="r-0", sample_index=0)
    hole = Placeholder("r-1", 0, 1, PlaceholderReason.RUN_TIMEOUT, "slow")
    group = GroupResult(0, (row, hole))

    assert (group.n, group.rows, group.placeholders) == (2, (row,), (hole,))
    with pytest.raises(RowInvariantError, match="entry 0 is group 0 sample 1"):
        GroupResult(0, (hole, row))
    with pytest.raises(RowInvariantError, match="appears twice"):
        GroupResult(0, (row, Placeholder("r-0", 0, 1, PlaceholderReason.RUN_TIMEOUT, "slow")))
    with pytest.raises(RowInvariantError, match="entry 1 is group 5"):
        GroupResult(0, (row, Placeholder("r-1", 5, 1, PlaceholderReason.RUN_TIMEOUT, "slow")))
    with pytest.raises(RowInvariantError, match="at least one entry"):
        GroupResult(0, ())
