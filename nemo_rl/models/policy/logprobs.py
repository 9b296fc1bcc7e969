"""Pure tensor helpers of the policy: right padding, micro-batch split, token logprob gather.

Invariants:
- `pad_right` keeps every row's values at positions [0, len) and fills the rest with `pad`;
  the attention mask is 1 exactly on real positions. Right padding leaves every real token's
  position id and causal context unchanged, so its logits match an unpadded forward.
- `gather_token_logprobs(logits, ids)[b, t]` = log softmax(logits[b, t - 1])[ids[b, t]] for
  t >= 1, and 0.0 at t = 0 (the first token has no prefix).
- `micro_batches(n, size)` covers range(n) in order with consecutive chunks of at most `size`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_right(
    rows: Sequence[Sequence[float]], pad: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged rows into [B, max_len] (right-padded) plus a 0/1 long attention mask."""
    if not rows:
        raise ValueError("pad_right needs at least one row")
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=dtype)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        attn[i, : len(row)] = 1
    return out, attn


def micro_batches(n: int, size: int) -> list[range]:
    """Consecutive index ranges of at most `size` covering range(n)."""
    if size < 1:
        raise ValueError(f"micro-batch size={size} must be >= 1")
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def gather_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Logprob of each token given its prefix, [B, T]; column 0 is 0.0."""
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    logits = logits[:, :-1].float()
    target = input_ids[:, 1:].unsqueeze(-1)
    # gather - logsumexp avoids materialising a second [B, T, V] log-softmax tensor.
    picked = logits.gather(-1, target).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    first = torch.zeros((input_ids.shape[0], 1), dtype=picked.dtype, device=picked.device)
    return torch.cat([first, picked], dim=1)
