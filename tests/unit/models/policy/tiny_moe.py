"""A tiny random Qwen3-MoE (2 layers, 4 experts, top-2), built in a second, and its free routing."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from nemo_rl.models.policy.router_replay import moe_routers

LAYERS, EXPERTS, TOPK, VOCAB = 2, 4, 2, 96


def build_tiny_qwen3_moe(out_dir: Path) -> Path:
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=TOPK,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # routers far from uniform, so free top-k is well defined
        for router in moe_routers(model):
            router.weight.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    return out_dir


def free_topk(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """[B, T, L, K] the model's own top-k experts (sorted), recorded by hooks on its routers."""
    seen = []
    hooks = [r.register_forward_hook(lambda _m, _a, out: seen.append(out[2])) for r in moe_routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=attn)
    finally:
        for h in hooks:
            h.remove()
    b, t = ids.shape
    return torch.stack([s.reshape(b, t, TOPK) for s in seen], dim=2).sort(dim=-1).values
