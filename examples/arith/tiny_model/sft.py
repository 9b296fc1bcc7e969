"""Random initialisation and the supervised warm start of the tiny Qwen2 policy.

Contract:
- `init_model(cfg, eos_token_id, pad_token_id)` returns an untied float32 `Qwen2ForCausalLM`
  whose weights are a pure function of `cfg` (torch RNG seeded from `cfg.seed`).
- `train_sft(model, examples, cfg, progress)` runs `cfg.sft_steps` AdamW steps on
  next-token cross-entropy restricted to assistant tokens (`loss_mask`), with a fixed data
  order drawn from `cfg.seed`, and returns the per-step losses. Run under
  `deterministic_torch(cfg)`, equal inputs give bit-identical weights.
- `deterministic_torch` sets the thread count, deterministic algorithms and the seeds for its
  block and restores the previous global torch settings afterwards.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from examples.arith.tiny_model.config import TinyModelConfig
from examples.arith.tiny_model.encoding import EncodedTranscript


class SFTError(RuntimeError):
    """The warm start could not run or diverged."""


@contextmanager
def deterministic_torch(cfg: TinyModelConfig) -> Iterator[None]:
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    rng_state = torch.get_rng_state()
    torch.set_num_threads(cfg.num_threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_rng_state(rng_state)


def qwen2_config(cfg: TinyModelConfig, eos_token_id: int, pad_token_id: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        initializer_range=cfg.init_std,
        # Untied always: vLLM's CPU refit leaves a tied model's packed lm_head stale.
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
        attn_implementation="sdpa",
    )


def init_model(cfg: TinyModelConfig, eos_token_id: int, pad_token_id: int) -> Qwen2ForCausalLM:
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(qwen2_config(cfg, eos_token_id, pad_token_id))
    return model.to(torch.float32)


def lr_at(step: int, cfg: TinyModelConfig) -> float:
    """Linear warmup to `learning_rate`, then cosine decay to a tenth of it."""
    warmup = math.ceil(cfg.warmup_fraction * cfg.sft_steps)
    if step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.sft_steps - warmup)
    return cfg.learning_rate * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def batch_order(n_examples: int, cfg: TinyModelConfig) -> list[list[int]]:
    """Fixed data order: epochs of seeded permutations, cut into batches."""
    rng = random.Random(cfg.seed)
    flat: list[int] = []
    needed = cfg.sft_steps * cfg.sft_batch_size
    while len(flat) < needed:
        perm = list(range(n_examples))
        rng.shuffle(perm)
        flat += perm
    return [flat[i * cfg.sft_batch_size : (i + 1) * cfg.sft_batch_size] for i in range(cfg.sft_steps)]


@dataclass(frozen=True)
class SharedPrefixBatch:
    """A batch split into the prefix all rows share and right-padded per-row suffixes.

    `target[b, j]` marks suffix position j of row b as a training target, predicted from the
    hidden state just before it; the prefix never holds a target or the state predicting one.
    """

    prefix: torch.Tensor  # [1, P]
    suffix: torch.Tensor  # [B, S]
    target: torch.Tensor  # [B, S] bool

    def __post_init__(self) -> None:
        if self.suffix.shape != self.target.shape:
            raise ValueError(f"suffix {tuple(self.suffix.shape)} and target {tuple(self.target.shape)} differ")
        if bool(self.target[:, 0].any()):
            raise ValueError("a target at suffix position 0 would be predicted from the shared prefix")


def _common_prefix_length(rows: list[tuple[int, ...]]) -> int:
    first = rows[0]
    length = min(len(r) for r in rows)
    for row in rows[1:]:
        n = 0
        while n < length and row[n] == first[n]:
            n += 1
        length = n
    return length


def collate(examples: list[EncodedTranscript], pad_token_id: int) -> SharedPrefixBatch:
    """Split off the longest shared prefix that ends before every row's first target's predictor."""
    first_targets = [e.loss_mask.index(True) for e in examples]
    split = min(_common_prefix_length([e.ids for e in examples]), min(first_targets) - 1)
    width = max(len(e.ids) for e in examples) - split
    suffix = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    target = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, e in enumerate(examples):
        n = len(e.ids) - split
        suffix[row, :n] = torch.tensor(e.ids[split:], dtype=torch.long)
        target[row, :n] = torch.tensor(e.loss_mask[split:], dtype=torch.bool)
    prefix = torch.tensor([examples[0].ids[:split]], dtype=torch.long)
    return SharedPrefixBatch(prefix=prefix, suffix=suffix, target=target)


def masked_loss(model: Qwen2ForCausalLM, batch: SharedPrefixBatch) -> torch.Tensor:
    """Mean next-token cross-entropy over the batch's targets.

    The shared prefix runs once and its key/value cache (with grad) is repeated across rows, so
    the long system+tools turn is not recomputed per row. Right padding under a causal mask
    never influences real positions, so no attention mask is needed; logits are computed only
    where a target follows, which keeps the lm_head cost to the assistant tokens.
    """
    rows = batch.suffix.shape[0]
    split = batch.prefix.shape[1]
    cache = None
    if split > 0:
        cache = model.model(input_ids=batch.prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(rows)
    positions = torch.arange(split, split + batch.suffix.shape[1]).unsqueeze(0).expand(rows, -1)
    hidden = model.model(
        input_ids=batch.suffix, position_ids=positions, past_key_values=cache, use_cache=cache is not None
    ).last_hidden_state
    select = batch.target[:, 1:]
    logits = model.lm_head(hidden[:, :-1][select])
    return F.cross_entropy(logits, batch.suffix[:, 1:][select])


def train_sft(
    model: Qwen2ForCausalLM,
    examples: list[EncodedTranscript],
    cfg: TinyModelConfig,
    pad_token_id: int,
    progress: Callable[[str], None],
) -> list[float]:
    if not examples:
        raise SFTError("train_sft got no examples; set TinyModelConfig.sft_examples >= 1")
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
        weight_decay=cfg.weight_decay,
        foreach=False,
    )
    model.train()
    losses: list[float] = []
    for step, indices in enumerate(batch_order(len(examples), cfg)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = masked_loss(model, collate([examples[i] for i in indices], pad_token_id))
        if not torch.isfinite(loss):
            raise SFTError(f"sft loss is {loss.item()} at step {step}; lower learning_rate={cfg.learning_rate}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % cfg.log_every == 0 or step == cfg.sft_steps - 1:
            window = losses[-cfg.log_every :]
            progress(
                f"sft step {step + 1}/{cfg.sft_steps} mean loss {sum(window) / len(window):.4f} "
                f"(last {len(window)}) lr {lr_at(step, cfg):.2e}"
            )
    model.eval()
    return losses
