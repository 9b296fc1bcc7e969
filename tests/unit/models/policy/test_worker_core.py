"""PolicyCore on a tiny random untied Qwen2: logprobs and the GRPO step (export, fingerprints: test_state_io.py).

The step is driven by the GRPO loss (`ClippedPGLossFn`), handed in as the policy's LossFn."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nemo_rl.algorithms.grpo import ClippedPGLossFn
from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy import LossConfig, PolicyConfig
from nemo_rl.models.policy.errors import PolicyLoadError, PolicyStepError
from nemo_rl.models.policy.state_io import get_logprobs, state_fingerprint
from nemo_rl.models.policy.worker import PolicyCore, warmup_lr

# The on-policy loss (weight 1): these tests pin the step itself, with placeholder generation
# logprobs of 0.0; the off-policy weight is tested in tests/unit/algorithms/test_off_policy.py.
LOSS = ClippedPGLossFn.from_config(LossConfig(behaviour_logprobs="recomputed"))
PROMPT = [3, 17, 42, 9]
GEN = [77, 5, 101, 64, 12]
SEQ = PROMPT + GEN
MASK = [0] * len(PROMPT) + [1] * len(GEN)


def _core(model_dir: Path, **overrides) -> PolicyCore:
    return PolicyCore(PolicyConfig(model_path=str(model_dir), **overrides))


def _masked_sum(lps: list[float], mask: list[int]) -> float:
    return sum(lp for lp, m in zip(lps, mask) if m)


def _batch(seqs, masks, advs, gen=None) -> TrainBatch:
    gen = gen if gen is not None else [[0.0] * len(s) for s in seqs]
    return TrainBatch(token_ids=seqs, token_mask=masks, generation_logprobs=gen, advantages=advs)


def test_get_logprobs_equals_manual_log_softmax(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir)
    seqs = [SEQ, [1, 2, 3], list(range(100, 112))]  # ragged: exercises right padding
    got = get_logprobs(core, seqs)
    for seq, lps in zip(seqs, got):
        with torch.no_grad():
            logits = core.model(input_ids=torch.tensor([seq])).logits[0]
        ref = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(seq[1:])[:, None])
        assert len(lps) == len(seq)
        assert lps[0] == 0.0
        assert torch.allclose(torch.tensor(lps[1:]), ref.squeeze(-1), atol=1e-5)


def test_positive_advantage_raises_masked_logprob_negative_lowers_it(tiny_model_dir: Path) -> None:
    for adv, sign in ((1.0, 1.0), (-1.0, -1.0)):
        core = _core(tiny_model_dir, learning_rate=1e-3)
        before = _masked_sum(get_logprobs(core, [SEQ])[0], MASK)
        fp0 = state_fingerprint(core)
        metrics = core.train_step(_batch([SEQ], [MASK], [adv]), LOSS)
        after = _masked_sum(get_logprobs(core, [SEQ])[0], MASK)
        assert sign * (after - before) > 0.01
        assert state_fingerprint(core) != fp0
        assert metrics["num_tokens"] == len(GEN)
        assert metrics["loss"] == pytest.approx(-adv, rel=1e-6)  # ratio 1 on-policy
        assert metrics["grad_norm"] > 0.0


def test_placeholder_advantage_and_unmasked_values_do_not_touch_the_update(
    tiny_model_dir: Path,
) -> None:
    other = [9, 8, 7, 6, 5, 4]
    placeholder_mask = [0] * len(other)
    # Garbage where nothing is trained: the placeholder's advantage, unmasked sampler logprobs.
    gen_a = [[0.0] * len(SEQ), [0.0] * len(other)]
    gen_b = [[-50.0] * len(PROMPT) + [0.0] * len(GEN), [float("nan")] * len(other)]
    fingerprints = []
    for adv_other, gen in ((5.0, gen_a), (-5.0, gen_b)):
        core = _core(tiny_model_dir)
        core.train_step(_batch([SEQ, other], [MASK, placeholder_mask], [1.0, adv_other], gen), LOSS)
        fingerprints.append(state_fingerprint(core))
    assert fingerprints[0] == fingerprints[1]
    # Control: training one more token of the same sequence does change the update.
    core = _core(tiny_model_dir)
    wider = [0] * (len(PROMPT) - 1) + [1] * (len(GEN) + 1)
    core.train_step(_batch([SEQ, other], [wider, placeholder_mask], [1.0, 5.0]), LOSS)
    assert state_fingerprint(core) != fingerprints[0]


def test_micro_batching_keeps_the_token_level_mean(tiny_model_dir: Path) -> None:
    seqs = [SEQ, [1, 2, 3, 4], [50, 60, 70, 80, 90, 100, 110]]
    masks = [MASK, [0, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1]]
    batch = _batch(seqs, masks, [1.0, -2.0, 0.5])
    whole, split = _core(tiny_model_dir), _core(tiny_model_dir, train_micro_batch_size=1)
    m_whole = whole.train_step(batch, LOSS)
    m_split = split.train_step(batch, LOSS)
    expected_loss = -(1.0 * 5 - 2.0 * 2 + 0.5 * 6) / 13
    assert m_whole["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert m_split["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert m_whole["grad_norm"] == pytest.approx(m_split["grad_norm"], rel=1e-4)
    for p, q in zip(whole.model.parameters(), split.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_mismatch_metrics_exact_when_gen_equals_train(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir)
    seqs = [SEQ, [1, 2, 3, 4, 5]]
    masks = [MASK, [0, 0, 1, 1, 1]]
    gen = get_logprobs(core, seqs)
    metrics = core.train_step(_batch(seqs, masks, [1.0, -1.0], gen), LOSS)
    assert metrics["token_mult_prob_error"] == 1.0
    assert metrics["gen_kl_error"] == 0.0
    # A known offset of 0.1 nats on every generated token: exp(0.1) exactly, pre-update.
    gen2 = [
        [lp - 0.1 * m for lp, m in zip(row, mask)]
        for row, mask in zip(get_logprobs(core, seqs), masks)
    ]
    metrics2 = core.train_step(_batch(seqs, masks, [1.0, -1.0], gen2), LOSS)
    assert metrics2["token_mult_prob_error"] == pytest.approx(1.1051709180756477, rel=1e-5)


def test_captured_mode_weights_tokens_and_reports_batch_metrics(tiny_model_dir: Path) -> None:
    # Micro-batches of one row: the *_max metric must be the max over them, the shares their sum.
    core = _core(tiny_model_dir, train_micro_batch_size=1)
    seqs = [SEQ, [1, 2, 3, 4, 5]]
    masks = [MASK, [0, 0, 1, 1, 1]]
    prev = get_logprobs(core, seqs)  # what train_step recomputes, bit for bit
    # Row 0 was sampled by these very weights (w = 1); row 1 by an engine that liked its first two
    # tokens 0.5 nats more (w = e^-0.5) and its last one 1 nat less (e^1 > 2: truncated to 2).
    gen = [prev[0], [lp + d for lp, d in zip(prev[1], (0.0, 0.0, 0.5, 0.5, -1.0))]]
    captured = ClippedPGLossFn.from_config(LossConfig())
    metrics = core.train_step(_batch(seqs, masks, [1.0, -1.0], gen), captured)
    assert metrics["is_weight_mean"] == pytest.approx((5 + 2 * math.exp(-0.5) + 2.0) / 8, rel=1e-6)
    assert metrics["is_weight_max"] == 2.0  # not 1.0 + 2.0: maxima combine by max
    assert metrics["is_weight_min"] == pytest.approx(math.exp(-0.5), rel=1e-5)  # row 1's, not row 0's 1.0
    assert metrics["is_truncated_fraction"] == 1 / 8
    on_policy = _core(tiny_model_dir).train_step(_batch(seqs, masks, [1.0, -1.0], prev), captured)
    assert (on_policy["is_weight_mean"], on_policy["is_weight_max"], on_policy["is_weight_min"],
            on_policy["is_truncated_fraction"]) == (1.0, 1.0, 1.0, 0.0)


def test_named_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PolicyLoadError, match="no config.json") as excinfo:
        _core(tmp_path / "missing")
    assert excinfo.value.kind == "model"
    core = _core(tiny_model_dir)
    with pytest.raises(PolicyStepError, match=r"token_ids\[0\]\[1\]=128") as excinfo:
        get_logprobs(core, [[1, 128]])
    assert excinfo.value.kind == "token_ids"
    with pytest.raises(PolicyStepError, match="no masked token") as excinfo:
        core.train_step(_batch([SEQ], [[0] * len(SEQ)], [1.0]), LOSS)
    assert excinfo.value.kind == "empty_mask"


@pytest.mark.parametrize(
    ("warmup", "expected"),
    [(0, [1e-3, 1e-3, 1e-3]), (1, [1e-3, 1e-3, 1e-3]), (4, [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])],
)
def test_warmup_lr_ramps_linearly_then_holds(warmup: int, expected: list[float]) -> None:
    got = [warmup_lr(1e-3, warmup, k) for k in range(1, len(expected) + 1)]
    assert got == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="1-based"):
        warmup_lr(1e-3, warmup, 0)


def test_train_step_applies_the_warmup_rate_to_the_optimizer(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir, learning_rate=1e-3, lr_warmup_steps=4)
    rates = [core.train_step(_batch([SEQ], [MASK], [1.0]), LOSS)["lr"] for _ in range(2)]
    assert rates == pytest.approx([2.5e-4, 5e-4], rel=1e-12)
    assert [g["lr"] for g in core._optimizer.param_groups] == pytest.approx([5e-4])


def test_first_step_moves_weights_by_the_warmup_rate(tiny_model_dir: Path) -> None:
    # A fresh AdamW's first update is lr * sign(grad) (up to eps) on every weight with a gradient:
    # the ramp's first rate bounds how far step 1 moves any weight.
    core = _core(tiny_model_dir, learning_rate=1e-3, lr_warmup_steps=10)
    before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    core.train_step(_batch([SEQ], [MASK], [1.0]), LOSS)
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in core.model.named_parameters())
    assert moved == pytest.approx(1e-4, rel=1e-3)
