"""Router replay (R3) on a tiny random Qwen3-MoE built in the test (2 layers, 4 experts, top-2).

The reference is an independent forcing: a forward hook on each sparse MoE block recomputes its
output token by token from the block's own weights with the experts the test chose, weighted by
the router's softmax at those experts (renormalised over the top-k), and the router's own top-k
where the test chose none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_rl.algorithms.grpo import ClippedPGLossFn
from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy import LossConfig, PolicyConfig
from nemo_rl.models.policy.errors import PolicyLoadError, PolicyStepError
from nemo_rl.models.policy.router_replay import (
    ReplayStats,
    moe_routers,
    replaying,
)
from nemo_rl.models.policy.worker import PolicyCore
from tests.unit.models.policy.tiny_moe import EXPERTS, LAYERS, TOPK, build_tiny_qwen3_moe, free_topk

LOSS = ClippedPGLossFn.from_config(LossConfig(behaviour_logprobs="recomputed"))
SEQS = [[3, 17, 42, 9, 77, 5, 61, 12], [8, 30, 2, 55, 70]]
MASKS = [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"))


def _core(path: Path, replay: str = "replay") -> PolicyCore:
    return PolicyCore(PolicyConfig(model_path=str(path), router_replay=replay, train_micro_batch_size=1))


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    t = max(map(len, SEQS))
    ids = torch.tensor([s + [0] * (t - len(s)) for s in SEQS])
    attn = torch.tensor([[1] * len(s) + [0] * (t - len(s)) for s in SEQS])
    return ids, attn


def _reference(model, forced: torch.Tensor):
    """Hooks that recompute every sparse MoE block's output from its weights with `forced` [B, T, L, K]."""
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]

    def make(layer, block):
        def hook(_m, args, _out):
            x = args[0]
            b, t, h = x.shape
            flat = x.reshape(-1, h)
            probs = torch.softmax(flat @ block.gate.weight.T, dim=-1, dtype=torch.float)
            own = torch.topk(probs, TOPK, dim=-1).indices
            chosen = forced[:, :, layer].reshape(-1, TOPK)
            out = []
            for n in range(flat.shape[0]):
                experts = chosen[n] if (chosen[n] >= 0).all() else own[n]
                w = probs[n, experts] / probs[n, experts].sum()
                y = torch.zeros(h)
                for e, we in zip(experts.tolist(), w):
                    gate, up = (block.experts.gate_up_proj[e] @ flat[n]).chunk(2)
                    y = y + we * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
                out.append(y)
            return torch.stack(out).reshape(b, t, h)

        return hook

    return [block.register_forward_hook(make(layer, block)) for layer, block in enumerate(blocks)]


def _other_experts(free: torch.Tensor) -> torch.Tensor:
    """For every (token, layer), a top-2 set that differs from the free one."""
    return torch.stack([(free[..., 0] + 1) % EXPERTS, (free[..., 0] + 2) % EXPERTS], dim=-1)


def _logits(model, ids, attn, routes=None, stats=None):
    if routes is None:
        return model(input_ids=ids, attention_mask=attn).logits
    with replaying(moe_routers(model), routes, attn, stats):
        return model(input_ids=ids, attention_mask=attn).logits


def test_replayed_logits_equal_a_forced_forward_and_differ_from_free_routing(moe_dir: Path) -> None:
    model = _core(moe_dir).model
    ids, attn = _padded()
    free = free_topk(model, ids, attn)
    forced = _other_experts(free)
    forced[0, :3] = -1  # some tokens keep free routing (a prompt)
    with torch.no_grad():
        replayed = _logits(model, ids, attn, forced)
        free_logits = _logits(model, ids, attn)
        hooks = _reference(model, forced)
        reference = model(input_ids=ids, attention_mask=attn).logits
        for h in hooks:
            h.remove()
        all_sentinel = _logits(model, ids, attn, torch.full_like(forced, -1))
        own_routes = _logits(model, ids, attn, free)
    real = attn.bool()
    torch.testing.assert_close(replayed[real], reference[real], rtol=1e-5, atol=1e-5)
    assert (replayed[real] - free_logits[real]).abs().max() > 1e-3
    # Causal: before the first replayed token the logits are free routing (up to expert batching).
    torch.testing.assert_close(replayed[0, :3], free_logits[0, :3], rtol=1e-6, atol=1e-6)
    assert torch.equal(all_sentinel, free_logits)  # the sentinel everywhere is free routing, bit for bit
    torch.testing.assert_close(own_routes, free_logits, rtol=1e-6, atol=1e-6)  # replaying its own choice


def test_gradient_reaches_the_routers_as_in_the_forced_forward(moe_dir: Path) -> None:
    model = _core(moe_dir).model
    ids, attn = _padded()
    forced = _other_experts(free_topk(model, ids, attn))
    grads = []
    for use_reference in (False, True):
        model.zero_grad(set_to_none=True)
        if use_reference:
            hooks = _reference(model, forced)
            logits = model(input_ids=ids, attention_mask=attn).logits
            for h in hooks:
                h.remove()
        else:
            logits = _logits(model, ids, attn, forced)
        logits[attn.bool()].logsumexp(-1).sum().backward()
        grads.append([r.weight.grad.clone() for r in moe_routers(model)])
    for replayed, reference in zip(*grads):
        assert replayed.abs().sum() > 0
        torch.testing.assert_close(replayed, reference, rtol=1e-4, atol=1e-6)


def test_train_step_reports_replay_coverage_and_flags_a_disagreement(moe_dir: Path) -> None:
    core = _core(moe_dir)
    ids, attn = _padded()
    free = free_topk(core.model, ids, attn).numpy().astype(np.int16)
    free[~attn.bool().numpy()] = -1
    free[0, :4] = -1  # the first row's prompt: no route (4 tokens x 2 layers)
    real_pairs = int(attn.sum()) * LAYERS  # 13 tokens x 2 layers
    replayed_pairs = real_pairs - 4 * LAYERS
    batch = dict(token_ids=SEQS, token_mask=MASKS, generation_logprobs=[[0.0] * len(s) for s in SEQS],
                 advantages=[1.0, -1.0])
    agreeing = core.train_step(TrainBatch(**batch, routed_experts=free.copy()), LOSS)
    assert agreeing["router_replay/replayed_token_fraction"] == replayed_pairs / real_pairs
    assert agreeing["router_replay/disagreement_fraction"] == 0.0

    core = _core(moe_dir)  # the same weights as before the step
    disagreeing = free.copy()
    pair = free[1, 3, 1].tolist()  # one (token, layer) of the second row gets another expert set
    disagreeing[1, 3, 1] = [pair[0], next(e for e in range(EXPERTS) if e not in pair)]
    metrics = core.train_step(TrainBatch(**batch, routed_experts=disagreeing), LOSS)
    assert metrics["router_replay/disagreement_fraction"] == 1 / replayed_pairs
    assert metrics["router_replay/replayed_token_fraction"] == replayed_pairs / real_pairs
    stats = ReplayStats()
    assert stats.metrics() == {"router_replay/replayed_token_fraction": 0.0, "router_replay/disagreement_fraction": 0.0}
    assert "router_replay/disagreement_fraction" not in _core(moe_dir, "off").train_step(TrainBatch(**batch), LOSS)


def test_routes_that_do_not_fit_the_model_are_refused_by_name(moe_dir: Path) -> None:
    core = _core(moe_dir)
    batch = dict(token_ids=SEQS[:1], token_mask=MASKS[:1], generation_logprobs=[[0.0] * 8], advantages=[1.0])
    routes = np.full((1, 8, LAYERS, TOPK), -1, np.int16)
    for bad, match in (
        (np.full((1, 8, 3, TOPK), -1, np.int16), r"\(layers, top-k\)=\(3, 2\) but policy.model_path=.* has 2 MoE "
                                                 r"layers of top-2"),
        (np.full((1, 8, LAYERS, 1), -1, np.int16), r"\(layers, top-k\)=\(2, 1\)"),
        (np.where(np.arange(8)[None, :, None, None] == 5, 4, routes).astype(np.int16), "expert id 4 but .* has 4 experts"),
        (np.where(np.arange(8)[None, :, None, None] == 5, 1, routes).astype(np.int16),
         r"routed_experts\[0, 5, 0\] = \[1, 1\] repeats an expert"),
    ):
        with pytest.raises(PolicyStepError, match=match) as excinfo:
            core.train_step(TrainBatch(**batch, routed_experts=bad), LOSS)
        assert excinfo.value.kind == "route_fit"


def test_replay_on_a_dense_model_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(PolicyLoadError, match=r"router_replay='replay' but .* has no MoE router.*"
                                              r"set policy.router_replay=off") as excinfo:
        _core(tiny_model_dir)
    assert excinfo.value.kind == "router_replay"
    with pytest.raises(ValueError, match="router_replay"):
        PolicyConfig(model_path="x", router_replay="on")
