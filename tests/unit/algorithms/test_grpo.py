"""Tests for the pure GRPO math: hand-computed values, edge cases and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.algorithms.grpo import (
    ADVANTAGE_EPS,
    ClippedPGLossFn,
    GRPOInputError,
    compute_group_advantages,
    gen_kl_error,
    grpo_clipped_loss,
    token_mult_prob_error,
)
from nemo_rl.models.policy.errors import PolicyStepError

# ---------------------------------------------------------------- advantages


def test_advantages_hand_computed_normalized() -> None:
    # Group 1: [1, 0, 0, 0]: mean 0.25, Bessel std 0.5 -> [1.5, -0.5, -0.5, -0.5] (up to eps).
    # Group 2: [2, 4, 6, 8]: mean 5, std sqrt(20/3).
    adv = compute_group_advantages(
        [1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0], 4, True, [True] * 8
    )
    s1 = 0.5 + ADVANTAGE_EPS
    s2 = math.sqrt(20.0 / 3.0) + ADVANTAGE_EPS
    assert adv == pytest.approx(
        [0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1, -3 / s2, -1 / s2, 1 / s2, 3 / s2],
        rel=1e-12,
    )


def test_advantages_hand_computed_unnormalized() -> None:
    adv = compute_group_advantages([1.0, 0.0, 0.0, 0.0], 4, False, [True] * 4)
    assert adv == [0.75, -0.25, -0.25, -0.25]


def test_all_equal_rewards_give_exact_zero() -> None:
    adv = compute_group_advantages([0.1, 0.1, 0.1, 1.0, 1.0, 1.0], 3, True, [True] * 6)
    assert adv == [0.0] * 6


def test_placeholder_is_zero_and_excluded_from_statistics() -> None:
    # The placeholder's reward (here 100) must not move the baseline of its group.
    adv = compute_group_advantages([1.0, 0.0, 100.0], 3, False, [True, True, False])
    assert adv == [0.5, -0.5, 0.0]
    # Normalized: valid [1, 0]: mean 0.5, Bessel std sqrt(0.5).
    adv_n = compute_group_advantages([1.0, 0.0, float("nan")], 3, True, [True, True, False])
    s = math.sqrt(0.5) + ADVANTAGE_EPS
    assert adv_n == pytest.approx([0.5 / s, -0.5 / s, 0.0], rel=1e-12)
    assert adv_n[2] == 0.0


def test_group_with_one_valid_sample_has_zero_advantage() -> None:
    assert compute_group_advantages([1.0, 0.0], 2, True, [True, False]) == [0.0, 0.0]
    assert compute_group_advantages([1.0, 0.0], 2, True, [False, False]) == [0.0, 0.0]


@pytest.mark.parametrize(
    ("rewards", "group_size", "valid", "match"),
    [
        ([1.0, 0.0, 1.0], 2, [True] * 3, "not a multiple of group_size"),
        ([1.0, 0.0], 2, [True], "len\\(valid\\)"),
        ([1.0, 0.0], 0, [True, True], "group_size=0"),
        ([1.0, float("inf")], 2, [True, True], "rewards\\[1\\]=inf"),
    ],
)
def test_advantage_input_errors(rewards, group_size, valid, match) -> None:
    with pytest.raises(GRPOInputError, match=match) as excinfo:
        compute_group_advantages(rewards, group_size, True, valid)
    assert excinfo.value.kind == "loss_input"


@st.composite
def _groups(draw):
    group_size = draw(st.integers(1, 6))
    n_groups = draw(st.integers(1, 4))
    n = group_size * n_groups
    reward = st.floats(-10, 10, allow_nan=False, allow_subnormal=False)
    rewards = draw(st.lists(reward, min_size=n, max_size=n))
    valid = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return rewards, group_size, valid


@given(_groups(), st.booleans())
@settings(max_examples=200, deadline=None)
def test_advantages_sum_to_zero_over_valid_samples(case, normalize) -> None:
    rewards, group_size, valid = case
    adv = compute_group_advantages(rewards, group_size, normalize, valid)
    for start in range(0, len(rewards), group_size):
        idx = range(start, start + group_size)
        assert all(adv[i] == 0.0 for i in idx if not valid[i])
        vals = [rewards[i] for i in idx if valid[i]]
        group_adv = [adv[i] for i in idx if valid[i]]
        if len(vals) >= 2 and min(vals) != max(vals):
            mean = math.fsum(vals) / len(vals)
            raw_std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
            scale = 1.0 / (raw_std + ADVANTAGE_EPS) if normalize else 1.0
            # The only error is the rounding of the mean: a few ulps of the largest reward.
            tol = 4 * len(vals) * 2.3e-16 * max(abs(v) for v in vals) * scale
            assert abs(math.fsum(group_adv)) <= tol
            if normalize and raw_std > 1e-6 * max(abs(v) for v in vals):
                # (skipped when the spread is within rounding noise of the rewards themselves)
                std = math.sqrt(math.fsum(a * a for a in group_adv) / (len(vals) - 1))
                assert std == pytest.approx(raw_std / (raw_std + ADVANTAGE_EPS), rel=1e-6)
        else:
            assert group_adv == [0.0] * len(vals)


# ---------------------------------------------------------------- loss


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_clipped_loss_hand_computed() -> None:
    # Four masked tokens with ratios 1.5, 0.5, 0.5, 1.5 and advantages 1, 1, -1, -1,
    # clip range [0.8, 1.2]:
    #   r=1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped)
    #   r=0.5, A=+1: max(-0.5, -0.8) = -0.5
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8 (clipped)
    #   r=1.5, A=-1: max( 1.5,  1.2) =  1.5
    # Token mean: (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15. A fifth, unmasked token holds inf/nan.
    prev = _t([[-1.0, -2.0, -1.0], [-0.5, -3.0, 0.0]])
    curr = prev + torch.log(_t([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]]))
    curr[0, 2] = float("inf")
    adv = _t([[1.0, 1.0, float("nan")], [-1.0, -1.0, 5.0]])
    mask = _t([[1, 1, 0], [1, 1, 0]])
    curr.requires_grad_(True)
    loss, metrics = grpo_clipped_loss(curr, prev, None, adv, mask, 0.2, 0.2)
    assert float(loss.detach()) == pytest.approx(0.15, rel=1e-6)
    assert metrics["loss"] == pytest.approx(0.15, rel=1e-6)
    assert metrics["clip_fraction"] == 0.5
    assert metrics["probs_ratio"] == pytest.approx(1.0, rel=1e-6)
    assert metrics["num_tokens"] == 4.0
    assert "token_mult_prob_error" not in metrics
    loss.backward()
    # d/dcurr of -A * r / N for unclipped tokens is -A * r / 4; clipped tokens get 0.
    expected = _t([[0.0, -0.5 / 4, 0.0], [0.0, -1.5 / 4 * -1.0, 0.0]])
    assert torch.allclose(curr.grad, expected, atol=1e-7)


def test_loss_per_sample_advantages_and_normalizer() -> None:
    prev = _t([[-1.0, -1.0], [-1.0, -1.0]])
    mask = _t([[0, 1], [1, 1]])
    loss, metrics = grpo_clipped_loss(
        prev.clone(), prev, prev, _t([2.0, -1.0]), mask, 0.2, 0.2, normalizer=6
    )
    # Per-token terms: -2, 1, 1 (ratio 1); summed and divided by the global count 6.
    assert float(loss) == pytest.approx(0.0, abs=1e-7)
    assert metrics["num_tokens"] == 3.0
    assert metrics["token_mult_prob_error"] == pytest.approx(0.5)  # 3 ones / 6
    assert metrics["gen_kl_error"] == 0.0
    with pytest.raises(GRPOInputError, match="normalizer=2") as excinfo:
        grpo_clipped_loss(prev, prev, None, _t([1.0, 1.0]), mask, 0.2, 0.2, normalizer=2)
    assert excinfo.value.kind == "loss_input"


def test_loss_input_errors() -> None:
    x = _t([[-1.0, -1.0]])
    with pytest.raises(PolicyStepError) as excinfo:
        grpo_clipped_loss(x, x, None, _t([1.0]), _t([[0, 0]]), 0.2, 0.2)
    assert excinfo.value.kind == "empty_mask"
    with pytest.raises(GRPOInputError, match="mask must hold only 0 and 1") as excinfo:
        grpo_clipped_loss(x, x, None, _t([1.0]), _t([[0, 2]]), 0.2, 0.2)
    assert excinfo.value.kind == "loss_input"
    with pytest.raises(GRPOInputError, match="prev_logprobs shape") as excinfo:
        grpo_clipped_loss(x, _t([[-1.0]]), None, _t([1.0]), _t([[0, 1]]), 0.2, 0.2)
    assert excinfo.value.kind == "loss_input"
    with pytest.raises(GRPOInputError, match="ratio_clip_min=1.0") as excinfo:
        grpo_clipped_loss(x, x, None, _t([1.0]), _t([[0, 1]]), 1.0, 0.2)
    assert excinfo.value.kind == "loss_input"


def test_clipped_pg_loss_fn_is_grpo_clipped_loss() -> None:
    prev = _t([[-1.0, -2.0, -1.0], [-0.5, -3.0, 0.0]])
    curr = prev + torch.log(_t([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]]))
    adv, mask = _t([1.0, -1.0]), _t([[1, 1, 0], [1, 1, 0]]).bool()
    fn = ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.28, behaviour_logprobs="recomputed", is_truncation=2.0)
    loss, metrics = fn(curr_logprobs=curr, prev_logprobs=prev, generation_logprobs=torch.zeros_like(prev),
                       advantages=adv, mask=mask, normalizer=6)
    ref_loss, ref = grpo_clipped_loss(curr, prev, None, adv, mask, 0.2, 0.28, normalizer=6)
    assert torch.equal(loss, ref_loss)
    # Weight 1 on the 4 masked tokens: mean share 4/6, max 1, nothing truncated.
    assert metrics == {"loss": ref["loss"], "clip_fraction": ref["clip_fraction"],
                       "is_weight_mean": 4 / 6, "is_weight_max": 1.0, "is_weight_min": 1.0,
                       "is_truncated_fraction": 0.0}
    with pytest.raises(GRPOInputError, match=r"loss_fn.ratio_clip_min=1.0") as excinfo:
        ClippedPGLossFn(ratio_clip_min=1.0, ratio_clip_max=0.2, behaviour_logprobs="captured", is_truncation=2.0)
    assert excinfo.value.kind == "loss_input"
    with pytest.raises(GRPOInputError, match=r"loss_fn.ratio_clip_max=-0.1") as excinfo:
        ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=-0.1, behaviour_logprobs="captured", is_truncation=2.0)
    assert excinfo.value.kind == "loss_input"


@st.composite
def _token_batches(draw):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    flat = st.floats(-5, 5, allow_nan=False, width=32)

    def grid(elements):
        return draw(st.lists(st.lists(elements, min_size=t, max_size=t), min_size=b, max_size=b))

    adv = grid(flat)
    lp = grid(st.floats(-20, 0, width=32))
    mask = grid(st.integers(0, 1))
    if not any(any(row) for row in mask):
        mask[0][0] = 1
    return _t(adv), _t(lp), _t(mask)


@given(_token_batches())
@settings(max_examples=200, deadline=None)
def test_loss_at_ratio_one_is_minus_masked_mean_advantage(case) -> None:
    adv, lp, mask = case
    loss, _ = grpo_clipped_loss(lp.clone(), lp, None, adv, mask, 0.2, 0.28)
    expected = -float((adv.double() * mask).sum() / mask.sum())
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-5)


# ---------------------------------------------------------------- mismatch metrics


def test_mismatch_metrics_hand_computed() -> None:
    train = _t([[0.0, -1.0, -2.0, float("nan")]])
    gen = _t([[5.0, -1.5, -1.0, 0.0]])
    mask = _t([[0, 1, 1, 0]])
    # d = train - gen on masked tokens: 0.5, -1.0
    assert token_mult_prob_error(train, gen, mask) == pytest.approx(
        (math.exp(0.5) + math.exp(1.0)) / 2, rel=1e-7
    )
    assert gen_kl_error(train, gen, mask) == pytest.approx(
        ((math.exp(0.5) - 0.5 - 1) + (math.exp(-1.0) + 1.0 - 1)) / 2, rel=1e-7
    )


def test_mismatch_metrics_exact_when_equal_and_empty_mask_error() -> None:
    x = _t([[-0.3, -1.7, -2.2]])
    mask = _t([[0, 1, 1]])
    assert token_mult_prob_error(x, x.clone(), mask) == 1.0
    assert gen_kl_error(x, x.clone(), mask) == 0.0
    with pytest.raises(PolicyStepError) as excinfo:
        token_mult_prob_error(x, x, _t([[0, 0, 0]]))
    assert excinfo.value.kind == "empty_mask"
    with pytest.raises(PolicyStepError) as excinfo:
        gen_kl_error(x, x, torch.zeros(1, 3, dtype=torch.bool))
    assert excinfo.value.kind == "empty_mask"
