"""Pure tensor helpers: padding, micro-batch split, token logprob gather."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nemo_rl.models.policy.worker import gather_token_logprobs, micro_batches, pad_right


def test_pad_right() -> None:
    ids, attn = pad_right([[5, 6, 7], [8]], 0, torch.long)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert attn.tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="at least one row"):
        pad_right([], 0, torch.long)


@given(st.integers(0, 50), st.integers(1, 9))
def test_micro_batches_cover_in_order(n: int, size: int) -> None:
    chunks = micro_batches(n, size)
    assert [i for c in chunks for i in c] == list(range(n))
    assert all(1 <= len(c) <= size for c in chunks)


def test_gather_matches_log_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11)
    ids = torch.randint(0, 11, (2, 4))
    got = gather_token_logprobs(logits, ids)
    ref = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == (2, 4)
    assert torch.equal(got[:, 0], torch.zeros(2))
    assert torch.allclose(got[:, 1:], ref, atol=1e-6)
