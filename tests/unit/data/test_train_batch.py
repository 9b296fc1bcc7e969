"""TrainBatch invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_rl.data.errors import RecordInvariantError
from nemo_rl.data.train import TrainBatch


def _batch(**overrides) -> TrainBatch:
    fields = dict(
        token_ids=[[1, 2, 3], [4, 5]],
        token_mask=[[0, 1, 1], [0, 0]],
        generation_logprobs=[[0.0, -1.0, -2.0], [0.0, 0.0]],
        advantages=[1.0, 0.0],
    )
    fields.update(overrides)
    return TrainBatch(**fields)


def test_valid_batch_is_frozen_tuples() -> None:
    b = _batch(token_ids=[torch.tensor([1, 2, 3]).tolist(), np.array([4, 5])],
               token_mask=[[0, True, 1.0], [0, 0]])
    assert b.token_ids == ((1, 2, 3), (4, 5))
    assert all(type(t) is int for row in b.token_ids for t in row)
    assert b.token_mask == ((0, 1, 1), (0, 0))
    assert b.num_samples == 2
    assert b.num_masked_tokens == 2
    with pytest.raises(AttributeError):
        b.advantages = (0.0, 0.0)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(token_ids=[]), "token_ids is empty"),
        (dict(advantages=[1.0]), r"len\(advantages\)=1 != len\(token_ids\)=2"),
        (dict(token_mask=[[0, 1], [0, 0]]), r"len\(token_mask\[0\]\)=2"),
        (dict(generation_logprobs=[[0.0, -1.0, -2.0], [0.0]]), r"generation_logprobs\[1\]"),
        (dict(token_mask=[[0, 2, 1], [0, 0]]), "holds 2"),
        (dict(token_mask=[[1, 1, 1], [0, 0]]), r"token_mask\[0\]\[0\]=1"),
        (dict(token_ids=[[1, 2, 3], [4]], token_mask=[[0, 1, 1], [0]],
              generation_logprobs=[[0.0, -1.0, -2.0], [0.0]]), "at least 2"),
        (dict(token_ids=[[1, -2, 3], [4, 5]]), "non-negative ints"),
        (dict(generation_logprobs=[[0.0, 0.5, -2.0], [0.0, 0.0]]), r"\[0\]\[1\]=0.5"),
        (dict(generation_logprobs=[[0.0, float("nan"), -2.0], [0.0, 0.0]]), "nan"),
        (dict(advantages=[float("inf"), 0.0]), r"advantages\[0\]=inf"),
    ],
)
def test_batch_invariants(overrides, match) -> None:
    with pytest.raises(RecordInvariantError, match=match) as excinfo:
        _batch(**overrides)
    assert excinfo.value.kind == "train_batch"


def test_unmasked_generation_logprobs_are_not_checked() -> None:
    # Only generated (masked) positions carry sampler logprobs; prompt positions are free.
    b = _batch(generation_logprobs=[[5.0, -1.0, -2.0], [float("nan"), 0.0]])
    assert b.num_masked_tokens == 2


# --- routed experts (R3): [n, max_len, L, K] int16, sentinel -1 where a token has no route -------------


def test_batch_routes_stacks_rows_with_the_sentinel_where_a_row_has_none_and_past_its_end() -> None:
    from nemo_rl.data.train import ROUTE_SENTINEL, batch_routes

    first = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)
    routes = batch_routes([first, None], [3, 2])
    assert routes.dtype == np.int16 and routes.shape == (2, 3, 2, 2)
    assert np.array_equal(routes[0], first)
    assert (routes[1] == ROUTE_SENTINEL).all()
    assert batch_routes([None, None], [3, 2]) is None  # a dense model: no routes at all
    b = _batch(routed_experts=routes)
    assert np.array_equal(b.routed_experts, routes) and not b.routed_experts.flags.writeable
    assert b == _batch(routed_experts=routes.copy()) and b != _batch() and _batch() == _batch()
    other = routes.copy()
    other[0, 1, 0, 0] = 7
    assert b != _batch(routed_experts=other)


def test_batch_routes_refuses_rows_of_different_models() -> None:
    from nemo_rl.data.train import batch_routes

    with pytest.raises(RecordInvariantError, match=r"rows disagree on \(layers, top-k\) \[\(2, 2\), \(3, 2\)\]") as excinfo:
        batch_routes([np.zeros((3, 2, 2), np.int16), np.zeros((2, 3, 2), np.int16)], [3, 2])
    assert excinfo.value.kind == "train_batch"


@pytest.mark.parametrize(
    ("routes", "match"),
    [
        (np.zeros((2, 3, 2, 2), np.int32), r"int16 ndarray \[n, max_len, L, K\], got int32"),
        (np.zeros((2, 3, 2), np.int16), r"got int16 of shape \(2, 3, 2\)"),
        (np.full((2, 4, 2, 2), -1, np.int16), r"shape \(2, 4, 2, 2\) does not fit the batch: need \(2, 3,"),
        (np.full((2, 3, 2, 2), -2, np.int16), "holds -2; ids are >= 0, -1 is the sentinel"),
        (np.zeros((2, 3, 2, 2), np.int16), r"routed_experts\[1\] has routes past the row's end \(2 tokens\)"),
    ],
)
def test_bad_routes_are_refused_by_name(routes, match) -> None:
    with pytest.raises(RecordInvariantError, match=match) as excinfo:
        _batch(routed_experts=routes)
    assert excinfo.value.kind == "train_batch"
