"""TrainBatch invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nemo_rl.data.errors import TrainBatchError
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
    with pytest.raises(TrainBatchError, match=match):
        _batch(**overrides)


def test_unmasked_generation_logprobs_are_not_checked() -> None:
    # Only generated (masked) positions carry sampler logprobs; prompt positions are free.
    b = _batch(generation_logprobs=[[5.0, -1.0, -2.0], [float("nan"), 0.0]])
    assert b.num_masked_tokens == 2
