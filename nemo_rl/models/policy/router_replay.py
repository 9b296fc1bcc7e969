"""Router replay (R3) in the policy: each MoE router follows the experts the engine recorded.

`moe_routers(model)` lists a model's top-k routers in layer order (Qwen3-MoE, Mixtral; another
router class is refused by name). Inside `replaying(routers, routes, attention_mask, stats)`
every router call is rewritten per token, for its layer l, by `replay_selection`: where the
token's K replayed ids `routes[b, t, l]` hold no sentinel (-1), indices = those ids and weights =
softmax(router logits) gathered at them (renormalised over the K when the router renormalises
its own top-k); elsewhere the router's own top-k and weights, unchanged. The weights stay
functions of the router's logits, so the loss's gradient reaches the router as through free
top-k (R3); a call with nothing to replay returns the router's output untouched. `ReplayStats`
counts, over real (unpadded) tokens, replayed (token, layer) pairs and those whose replayed set
differs from the trainer's own free top-k. `check_routes_fit` refuses routes whose (L, K) or ids
do not fit the model. See docs/design-docs/policy.md, "Router replay (R3)".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nemo_rl.data.train import ROUTE_SENTINEL
from nemo_rl.models.policy.errors import PolicyLoadError, PolicyStepError

# Router classes whose forward returns (logits, top-k weights, top-k indices) from softmax + top-k,
# and whether each renormalises its top-k weights (name -> rule).
_RENORMALISES = {
    "Qwen3MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
    "MixtralTopKRouter": lambda router: True,
}


@dataclass
class ReplayStats:
    """Counts over real tokens: (token, layer) pairs seen, replayed, and replayed but unlike free top-k."""

    pairs: int = 0
    replayed: int = 0
    disagreeing: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "router_replay/replayed_token_fraction": self.replayed / self.pairs if self.pairs else 0.0,
            "router_replay/disagreement_fraction": self.disagreeing / self.replayed if self.replayed else 0.0,
        }


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, one per MoE layer, in layer order."""
    routers = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in _RENORMALISES:
            routers.append(module)
        elif kind.endswith("Router"):
            raise PolicyLoadError(
                f"policy.router_replay='replay': module {name!r} is a {kind}, a router this policy cannot replay "
                f"(supported: {sorted(_RENORMALISES)}) (fix: set policy.router_replay=off)", kind="router_replay"
            )
    return routers


def check_routes_fit(routes: np.ndarray, routers: list[nn.Module], model_path: str) -> None:
    """Raise `PolicyStepError` (`route_fit`) unless `routes` [n, T, L, K] fit: L routers of top-k K, ids distinct and < E."""
    layers, topk = routes.shape[2], routes.shape[3]
    want = (len(routers), int(routers[0].top_k))
    if (layers, topk) != want:
        raise PolicyStepError(
            f"TrainBatch.routed_experts has (layers, top-k)=({layers}, {topk}) but policy.model_path={model_path!r} "
            f"has {want[0]} MoE layers of top-{want[1]} (fix: train the model the engine served)", kind="route_fit"
        )
    num_experts = int(routers[0].num_experts)
    if routes.size and int(routes.max()) >= num_experts:
        raise PolicyStepError(
            f"TrainBatch.routed_experts holds expert id {int(routes.max())} but policy.model_path={model_path!r} "
            f"has {num_experts} experts per layer (fix: train the model the engine served)", kind="route_fit"
        )
    ordered = np.sort(routes, axis=-1)
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != ROUTE_SENTINEL)
    if repeated.any():
        where = tuple(int(i) for i in np.argwhere(repeated)[0][:3])
        raise PolicyStepError(
            f"TrainBatch.routed_experts[{where[0]}, {where[1]}, {where[2]}] = {routes[where].tolist()} repeats an "
            "expert; a token's top-k experts are distinct (fix: the engine's route capture is corrupt)", kind="route_fit"
        )


def replay_selection(
    logits: torch.Tensor, replayed: torch.Tensor, top_k: int, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, indices, use, free_indices) for logits [N, E] and replayed ids [N, K] (-1 = sentinel).

    `use[n]` is True where token n's K ids hold no sentinel; see the module contract for the rule.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    _, free = torch.topk(probs, top_k, dim=-1)
    use = (replayed != ROUTE_SENTINEL).all(dim=-1)
    indices = torch.where(use[:, None], replayed, free)
    weights = probs.gather(-1, indices)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices, use, free


def _count(stats: ReplayStats, use: torch.Tensor, replayed: torch.Tensor, free: torch.Tensor, real: torch.Tensor) -> None:
    differ = (torch.sort(replayed, dim=-1).values != torch.sort(free, dim=-1).values).any(dim=-1)
    stats.pairs += int(real.sum())
    stats.replayed += int((use & real).sum())
    stats.disagreeing += int((use & real & differ).sum())


def _hook(layer: int, routes: torch.Tensor, real: torch.Tensor, stats: ReplayStats | None):
    renormalise = None

    def rewrite(router: nn.Module, _args: tuple, output: tuple) -> tuple:
        nonlocal renormalise
        logits, scores, _ = output
        replayed = routes[:, :, layer, :].reshape(-1, routes.shape[-1])
        if replayed.shape[0] != logits.shape[0]:
            raise PolicyStepError(
                f"layer {layer}: the router saw {logits.shape[0]} tokens, the routes cover {replayed.shape[0]}", kind="route_fit"
            )
        if renormalise is None:
            renormalise = _RENORMALISES[type(router).__name__](router)
        weights, indices, use, free = replay_selection(logits, replayed, int(router.top_k), renormalise)
        if stats is not None:
            _count(stats, use, replayed, free, real)
        if not bool(use.any()):
            return output
        return logits, weights.to(scores.dtype), indices

    return rewrite


@contextmanager
def replaying(
    routers: list[nn.Module], routes: torch.Tensor, attention_mask: torch.Tensor, stats: ReplayStats | None = None
) -> Iterator[None]:
    """Within the block, forwards of [B, T] inputs replay `routes` [B, T, L, K] (see the module contract)."""
    real = attention_mask.reshape(-1).bool()
    handles = [r.register_forward_hook(_hook(layer, routes, real, stats)) for layer, r in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
