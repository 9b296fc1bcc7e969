"""Off-policy correction: the truncated importance weight of each token against its own sampler.

w = min(exp(prev - mu), C) per masked token, mu = the generation logprob the row carries (the
engine of the weight version that served the token); "recomputed" is today's loss bit for bit.
All expectations are computed by hand from the inputs (math.exp in float64, compared to float32).
"""

from __future__ import annotations

import math
from pathlib import Path

import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.algorithms.grpo import (
    ClippedPGLossFn,
    GRPOInputError,
    grpo_clipped_loss,
    is_weight_metrics,
    truncated_is_weights,
)
from nemo_rl.algorithms.grpo_config import load_master_config
from nemo_rl.algorithms.grpo_single_controller import build_train_batch
from nemo_rl.data.errors import RecordInvariantError
from nemo_rl.data.rows import GroupResult, KeptRollout, RowOrigin, TrainRow
from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy import LossConfig
from nemo_rl.models.policy.worker import combine_metric, pad_right, token_mult_prob_error
from nemo_rl.utils.config import ConfigError, validate_section

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
C = 2.0
IDS = (5, 6, 7, 8, 9)
MASK = (0.0, 0.0, 1.0, 1.0, 1.0)
# The trainer's recomputed (proximal) logprobs of the three generated tokens: the rows share their
# tokens, so prev is the same for every row and only the sampler's record differs.
PREV = (-0.6, -0.4, -1.0)
# What the engine reported for the same three tokens at weight version 3 and at version 4.
ENGINE = {3: (-0.5, -0.75, -3.0), 4: (-0.75, -0.25, -1.25)}


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _row(rid: str, sample: int, version: int, reward: float, lps: tuple[float, ...]) -> TrainRow:
    return TrainRow(
        rollout_id=rid, group_index=0, sample_index=sample, token_ids=IDS, token_mask=MASK,
        generation_logprobs=(0.0, 0.0) + lps, reward=reward, prompt_len=2, model_call_ids=(f"{rid}-c0",),
        weight_versions=(version,), token_in_calls=1, text_root_calls=0, terminal_selection="response_id",
        origin=RowOrigin.CAPTURE, call_spans=((0, len(IDS)),),
    )


def _batch(engine: dict[int, tuple[float, ...]]) -> tuple[TrainBatch, list[int]]:
    """One group of four rollouts sampled by versions 3, 4, 3, 4, as the loop assembles it."""
    versions, rewards = [3, 4, 3, 4], [1.0, 0.0, 0.0, 0.0]
    entries = tuple(
        KeptRollout(f"r-{i}", 0, i, (_row(f"r-{i}", i, v, r, engine[v]),), r, "response_id")
        for i, (v, r) in enumerate(zip(versions, rewards))
    )
    step = build_train_batch([GroupResult(0, entries)], normalize=False, train_partition="train")
    assert isinstance(step.rows, TrainBatch)
    return step.rows, versions


def _tensors(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prev, behaviour, mask) padded as the policy pads a micro-batch."""
    gen, _ = pad_right(batch.generation_logprobs, 0.0, torch.float32)
    mask, _ = pad_right(batch.token_mask, 0, torch.long)
    prev = _t([[0.0, -2.0, *PREV]] * batch.num_samples)
    return prev, gen, mask.bool()


def _loss_fn(mode: str = "captured", cap: float = C) -> ClippedPGLossFn:
    return ClippedPGLossFn(ratio_clip_min=0.2, ratio_clip_max=0.28, behaviour_logprobs=mode, is_truncation=cap)


def _by_hand(prev: float, mu: float) -> float:
    return min(math.exp(prev - mu), C)


# ------------------------------------------------------- (a) two weight versions in one batch


def test_each_token_is_weighted_against_the_version_that_sampled_it() -> None:
    batch, versions = _batch(ENGINE)
    prev, gen, mask = _tensors(batch)
    w, truncated = truncated_is_weights(prev, gen, mask, C)
    for b, version in enumerate(versions):
        assert w[b, :2].tolist() == [1.0, 1.0]  # prompt tokens: no weight (1.0, never read)
        for k, (p, mu) in enumerate(zip(PREV, ENGINE[version])):
            assert float(w[b, 2 + k]) == pytest.approx(_by_hand(p, mu), rel=1e-6), (b, k)
            assert bool(truncated[b, 2 + k]) == (math.exp(p - mu) > C)
    # Same tokens, same prev: the rows differ only because different versions sampled them.
    assert not torch.equal(w[0], w[1]) and torch.equal(w[0], w[2]) and torch.equal(w[1], w[3])
    # Version 3's last token was far less likely under the sampler than now: truncated at C.
    assert float(w[0, 4]) == C and bool(truncated[0, 4]) and not bool(truncated[1, 4])


def test_the_loss_applies_each_tokens_weight_to_its_own_gradient() -> None:
    batch, versions = _batch(ENGINE)
    prev, gen, mask = _tensors(batch)
    adv = _t(batch.advantages)
    assert batch.advantages == (0.75, -0.25, -0.25, -0.25)
    curr = prev.clone().requires_grad_(True)
    loss, metrics = _loss_fn()(curr_logprobs=curr, prev_logprobs=prev, generation_logprobs=gen,
                               advantages=adv, mask=mask, normalizer=12)
    loss.backward()
    # On-policy ratio 1 (unclipped): d loss / d curr[b, t] = -A_b * w_bt / N.
    weights = [[_by_hand(p, mu) for p, mu in zip(PREV, ENGINE[v])] for v in versions]
    for b in range(4):
        assert curr.grad[b, :2].tolist() == [0.0, 0.0]
        for k in range(3):
            assert float(curr.grad[b, 2 + k]) == pytest.approx(-batch.advantages[b] * weights[b][k] / 12, rel=1e-6)
    flat = [x for row in weights for x in row]
    assert metrics["is_weight_mean"] == pytest.approx(sum(flat) / 12, rel=1e-6)
    assert metrics["is_weight_max"] == C
    assert metrics["is_truncated_fraction"] == pytest.approx(2 / 12)  # version 3's last token, twice
    expected = -sum(a * x for a, row in zip(batch.advantages, weights) for x in row) / 12
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6) and abs(expected) > 0.04


def test_changing_one_versions_record_changes_exactly_its_tokens_weights() -> None:
    batch, versions = _batch(ENGINE)
    prev, gen, mask = _tensors(batch)
    w, _ = truncated_is_weights(prev, gen, mask, C)
    # Version 4 reported another logprob for the middle token: only that token of its rows moves.
    moved = {3: ENGINE[3], 4: (ENGINE[4][0], -0.1, ENGINE[4][2])}
    w_moved, _ = truncated_is_weights(*_tensors(_batch(moved)[0])[:2], mask, C)
    changed = sorted(map(tuple, (w_moved != w).nonzero().tolist()))
    assert changed == [(b, 3) for b, v in enumerate(versions) if v == 4]
    assert float(w_moved[1, 3]) == pytest.approx(_by_hand(PREV[1], -0.1), rel=1e-6)
    # Swapping the two versions' records swaps the rows' weights, token for token.
    w_swapped, _ = truncated_is_weights(*_tensors(_batch({3: ENGINE[4], 4: ENGINE[3]})[0])[:2], mask, C)
    assert torch.equal(w_swapped[[0, 1, 2, 3]], w[[1, 0, 3, 2]])
    assert not torch.equal(w_swapped, w)


# ------------------------------------------------------- (b) recomputed is today's loss


def _todays_loss(curr, prev, adv, mask, lo, hi, denom):
    """The clipped loss as it was before the off-policy weight (verbatim arithmetic)."""
    adv = adv.unsqueeze(1).expand_as(curr).detach().to(curr.dtype)
    m = mask.bool()
    log_ratio = torch.where(m, curr - prev.detach(), torch.zeros_like(adv))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - lo, 1.0 + hi)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    return torch.where(m, per_token, torch.zeros_like(per_token)).sum() / denom


def test_recomputed_mode_is_todays_loss_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(7)
    prev = -torch.rand(3, 6, generator=gen) * 4
    curr_a = (prev + torch.randn(3, 6, generator=gen) * 0.3).requires_grad_(True)  # some ratios clip
    curr_b = curr_a.detach().clone().requires_grad_(True)
    adv, mask = _t([1.5, -0.7, 0.2]), torch.rand(3, 6, generator=gen) > 0.3
    garbage = torch.full((3, 6), float("nan"))  # recomputed never reads the generation logprobs
    loss, metrics = _loss_fn("recomputed")(curr_logprobs=curr_a, prev_logprobs=prev, generation_logprobs=garbage,
                                           advantages=adv, mask=mask, normalizer=20)
    ref = _todays_loss(curr_b, prev, adv, mask, 0.2, 0.28, 20.0)
    loss.backward()
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(curr_a.grad, curr_b.grad)
    n = int(mask.sum())
    assert metrics["is_weight_mean"] == n / 20 and metrics["is_weight_max"] == 1.0 and metrics["is_weight_min"] == 1.0
    assert metrics["is_truncated_fraction"] == 0.0


# ------------------------------------------------------- (c) truncation


def test_a_token_above_the_cap_gets_the_cap_and_counts_as_truncated() -> None:
    prev = _t([[0.0, -1.0, -1.0, -1.0, -1.0]])
    # exp(prev - mu): 1 (padding-like position 0 is unmasked), e^3 > C, e^-1, e^0.5, exactly 1.
    mu = _t([[0.0, -4.0, 0.0, -1.5, -1.0]])
    mask = _t([[0, 1, 1, 1, 1]]).bool()
    w, truncated = truncated_is_weights(prev, mu, mask, C)
    assert float(w[0, 1]) == C and truncated.tolist() == [[False, True, False, False, False]]
    assert float(w[0, 2]) == pytest.approx(math.exp(-1.0), rel=1e-6)
    assert float(w[0, 3]) == pytest.approx(math.exp(0.5), rel=1e-6) and float(w[0, 4]) == 1.0
    metrics = is_weight_metrics(w, truncated, mask, normalizer=8)  # a share of an 8-token batch
    assert metrics["is_truncated_fraction"] == 1 / 8 and metrics["is_weight_max"] == C
    assert metrics["is_weight_min"] == pytest.approx(math.exp(-1.0), rel=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx((C + math.exp(-1.0) + math.exp(0.5) + 1.0) / 8, rel=1e-6)
    # A larger cap lets the same token through at its full weight.
    w5, t5 = truncated_is_weights(prev, mu, mask, 25.0)
    assert float(w5[0, 1]) == pytest.approx(math.exp(3.0), rel=1e-6) and not bool(t5.any())


def test_max_metrics_combine_by_max_and_shares_by_sum() -> None:
    assert combine_metric("is_weight_max", None, 1.5) == 1.5
    assert combine_metric("is_weight_max", 1.5, 1.2) == 1.5 and combine_metric("is_weight_max", 1.2, 1.5) == 1.5
    assert combine_metric("is_weight_mean", 0.25, 0.5) == 0.75
    assert combine_metric("is_weight_min", None, 0.5) == 0.5
    assert combine_metric("is_weight_min", 0.5, 0.2) == 0.2 and combine_metric("is_weight_min", 0.2, 0.5) == 0.2


def test_a_token_the_trainer_now_finds_unlikely_shows_in_the_min_not_the_mean_or_max() -> None:
    """The async outlier this metric exists for: one token whose probability fell ~e^9-fold between
    the sampler's version and the trainer's drives `token_mult_prob_error` (a mean of exp|diff|) far
    above 1 while the mean and max weight stay near 1; only the unclamped min names it."""
    n = 1000
    prev = torch.full((1, n), -0.5)
    mu = prev.clone()
    mu[0, 7] = -0.01  # sampled as nearly certain ...
    prev[0, 7] = -9.01  # ... now e^-9 less likely
    mask = torch.ones(1, n, dtype=torch.bool)
    w, truncated = truncated_is_weights(prev, mu, mask, C)
    metrics = is_weight_metrics(w, truncated, mask, normalizer=n)
    assert metrics["is_weight_min"] == pytest.approx(math.exp(-9.0), rel=1e-5)
    assert metrics["is_weight_max"] == 1.0 and metrics["is_truncated_fraction"] == 0.0
    assert metrics["is_weight_mean"] == pytest.approx((n - 1 + math.exp(-9.0)) / n, rel=1e-6)
    assert float(token_mult_prob_error(prev, mu, mask)) == pytest.approx((n - 1 + math.exp(9.0)) / n, rel=1e-5)


def test_a_masked_token_without_a_behaviour_logprob_fails_loudly() -> None:
    prev, mask = _t([[0.0, -1.0, -1.0]]), _t([[0, 1, 1]]).bool()
    for bad in (float("nan"), float("inf"), float("-inf"), 0.5):
        with pytest.raises(GRPOInputError, match=rf"behaviour logprob \[0, 2\]={bad}.*engine that sampled it") as excinfo:
            truncated_is_weights(prev, _t([[0.0, -1.0, bad]]), mask, C)
        assert excinfo.value.kind == "loss_input"
        with pytest.raises(GRPOInputError, match="behaviour logprob") as excinfo:
            _loss_fn()(curr_logprobs=prev.clone(), prev_logprobs=prev, generation_logprobs=_t([[0.0, -1.0, bad]]),
                       advantages=_t([1.0]), mask=mask, normalizer=2)
        assert excinfo.value.kind == "loss_input"
    # Off the mask anything goes (a prompt token has no sampler).
    w, _ = truncated_is_weights(prev, _t([[float("nan"), -1.0, -1.0]]), mask, C)
    assert w.tolist() == [[1.0, 1.0, 1.0]]
    # Upstream, a batch cannot even carry such a token: TrainBatch refuses it by name.
    with pytest.raises(RecordInvariantError, match=r"generation_logprobs\[0\]\[2\]=nan on a masked token") as excinfo:
        TrainBatch(token_ids=[[1, 2, 3]], token_mask=[[0, 1, 1]], generation_logprobs=[[0.0, -1.0, float("nan")]],
                   advantages=[1.0])
    assert excinfo.value.kind == "train_batch"


def test_the_weight_carries_no_gradient() -> None:
    prev = _t([[0.0, -1.0, -2.0]])
    mu = _t([[0.0, -1.5, -1.0]]).requires_grad_(True)
    curr = prev.clone().requires_grad_(True)
    loss, _ = _loss_fn()(curr_logprobs=curr, prev_logprobs=prev, generation_logprobs=mu, advantages=_t([1.0]),
                         mask=_t([[0, 1, 1]]).bool(), normalizer=2)
    loss.backward()
    assert mu.grad is None


# ------------------------------------------------------- (d) configuration


def test_loss_config_defaults_and_errors_name_field_value_and_fix() -> None:
    cfg = LossConfig()
    assert (cfg.behaviour_logprobs, cfg.is_truncation) == ("captured", 2.0)
    assert ClippedPGLossFn.from_config(cfg) == ClippedPGLossFn(0.2, 0.2, "captured", 2.0)
    for value, fix in ((1.0, "value > 1"), (0.5, "value > 1"), ("inf", "finite number")):
        with pytest.raises(ConfigError, match=rf"loss_fn\.is_truncation={value!r}: .*\(fix: set loss_fn\.is_truncation "
                                              rf"to a {fix}\)"):
            validate_section(LossConfig, {"is_truncation": value}, "loss_fn")
    with pytest.raises(ConfigError, match=r"loss_fn\.behaviour_logprobs='engine'.*'captured'.*'recomputed'"):
        validate_section(LossConfig, {"behaviour_logprobs": "engine"}, "loss_fn")
    with pytest.raises(ConfigError, match=r"loss_fn\.is_truncation_ratio.*unknown key"):
        validate_section(LossConfig, {"is_truncation_ratio": 2.0}, "loss_fn")
    with pytest.raises(pydantic.ValidationError):
        LossConfig(is_truncation=float("nan"))


def test_loss_fn_refuses_what_the_config_refuses() -> None:
    with pytest.raises(GRPOInputError, match=r"loss_fn\.behaviour_logprobs='engine'.*\['captured', 'recomputed'\]") as excinfo:
        _loss_fn("engine")
    assert excinfo.value.kind == "loss_input"
    for cap in (1.0, float("inf"), float("nan")):
        with pytest.raises(GRPOInputError, match=rf"loss_fn\.is_truncation={cap}.*fix: ") as excinfo:
            _loss_fn("captured", cap)
        assert excinfo.value.kind == "loss_input"


def test_both_capture_and_legacy_recipes_default_to_the_captured_mode() -> None:
    for name in ("grpo_capture_tiny_cpu.yaml", "grpo_legacy_tiny_cpu.yaml"):
        cfg = load_master_config(CONFIGS / name, ["logger.log_dir=/tmp/x"])
        assert (cfg.loss_fn.behaviour_logprobs, cfg.loss_fn.is_truncation) == ("captured", 2.0), name
    cfg = load_master_config(CONFIGS / "grpo_capture_tiny_cpu.yaml",
                             ["loss_fn.behaviour_logprobs=recomputed", "loss_fn.is_truncation=3.5"])
    assert (cfg.loss_fn.behaviour_logprobs, cfg.loss_fn.is_truncation) == ("recomputed", 3.5)
    with pytest.raises(ConfigError, match=r"loss_fn\.is_truncation=1\.0"):
        load_master_config(CONFIGS / "grpo_capture_tiny_cpu.yaml", ["loss_fn.is_truncation=1.0"])


# ------------------------------------------------------- (e) mu == prev: the two modes agree


@st.composite
def _cases(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))

    def grid(elements):
        return _t(draw(st.lists(st.lists(elements, min_size=t, max_size=t), min_size=b, max_size=b)))

    prev = grid(st.floats(-20, 0, width=32))
    curr = prev + grid(st.floats(-1, 1, width=32))
    mask = grid(st.integers(0, 1)).bool()
    if not bool(mask.any()):
        mask[0, 0] = True
    adv = _t(draw(st.lists(st.floats(-5, 5, width=32), min_size=b, max_size=b)))
    cap = draw(st.floats(1.0, 100.0, exclude_min=True))
    return prev, curr, mask, adv, cap


@given(_cases())
@settings(max_examples=200, deadline=None)
def test_captured_equals_recomputed_when_the_sampler_is_the_trainer(case) -> None:
    prev, curr, mask, adv, cap = case
    out = {}
    for mode in ("captured", "recomputed"):
        c = curr.clone().requires_grad_(True)
        loss, metrics = _loss_fn(mode, cap)(curr_logprobs=c, prev_logprobs=prev, generation_logprobs=prev.clone(),
                                            advantages=adv, mask=mask, normalizer=int(mask.sum()))
        loss.backward()
        out[mode] = (loss, c.grad, metrics)
    assert torch.equal(out["captured"][0], out["recomputed"][0])
    assert torch.equal(out["captured"][1], out["recomputed"][1])
    assert out["captured"][2] == out["recomputed"][2]


def test_clipped_loss_without_weights_is_unchanged_by_the_new_argument() -> None:
    prev = _t([[-1.0, -2.0, -1.0], [-0.5, -3.0, 0.0]])
    curr = prev + torch.log(_t([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]]))
    adv, mask = _t([1.0, -1.0]), _t([[1, 1, 0], [1, 1, 0]]).bool()
    plain, _ = grpo_clipped_loss(curr, prev, None, adv, mask, 0.2, 0.28, normalizer=6)
    ones, _ = grpo_clipped_loss(curr, prev, None, adv, mask, 0.2, 0.28, normalizer=6, is_weights=torch.ones_like(prev))
    assert torch.equal(plain, ones)
    # A nan weight off the mask reaches neither the loss nor the gradient.
    weights = torch.ones_like(prev)
    weights[:, 2] = float("nan")
    c = curr.clone().requires_grad_(True)
    loss, _ = grpo_clipped_loss(c, prev, None, adv, mask, 0.2, 0.28, normalizer=6, is_weights=weights)
    loss.backward()
    assert torch.equal(loss, plain) and bool(torch.isfinite(c.grad).all()) and c.grad[:, 2].tolist() == [0.0, 0.0]
    with pytest.raises(GRPOInputError, match="is_weights shape") as excinfo:
        grpo_clipped_loss(curr, prev, None, adv, mask, 0.2, 0.28, is_weights=torch.ones(2, 2))
    assert excinfo.value.kind == "loss_input"
