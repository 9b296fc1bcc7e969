"""The policy worker: the train step (`PolicyCore`, no Ray), the `LossFn` it calls, its Ray shell and client.

`PolicyCore.train_step(batch, loss_fn)` calls the loss once per micro-batch holding a masked token
with right-padded [B, T] logprobs (column 0 is 0.0), advantages, the mask and `normalizer` (the
WHOLE batch's masked tokens); it returns `(loss, metrics)` of micro-batch shares the step sums
(`_max`/`_min` names combine by max/min; `CORE_METRICS` are reserved) and must be picklable. The
model stays in eval mode, so "prev" and trained logprobs come from one deterministic function;
every step reports `token_mult_prob_error` and `gen_kl_error`; masked-out positions never influence
a result. Refused as a `PolicyStepError` of a named kind: no masked token (`empty_mask`), a bad mask
(`loss_input`), a non-finite grad norm (`non_finite_grad`, no step). `PolicyWorker` wraps every failure in a
`PolicyWorkerError` naming the method; `train_planned` reads a `TrainPlan`'s rows itself and checks
their digests (nothing is trained on a mismatch). `RayPolicyClient` bounds every call by
`call_timeout_s` and checks `loss_fn` before pickling it. Set-up: `setup`; refit, checkpoints,
fingerprints: `state_io`. See docs/design-docs/policy.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import ray
import torch
from ray.actor import ActorHandle

from nemo_rl.data.errors import PolicyWorkerError, error_name
from nemo_rl.data.train import TrainBatch, TrainPlan
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig, attach_client
from nemo_rl.data_plane.partitions import read_train_batch
from nemo_rl.distributed.actor_call import (
    ActorCallError,
    ActorCallTimeoutError,
    ActorRaisedError,
    call_with_deadline,
)
from nemo_rl.distributed.shared_fs import SharedDirProbe, check_probe
from nemo_rl.models.policy import state_io
from nemo_rl.models.policy.config import LossConfig, PolicyConfig
from nemo_rl.models.policy.errors import PolicyStepError, PolicyWorkerCallError
from nemo_rl.models.policy.router_replay import ReplayStats, check_routes_fit, replaying
from nemo_rl.models.policy.setup import build_parts

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# --- the LossFn contract ----------------------------------------------------------------

# Metrics the train step computes itself; a LossFn may not return these names.
CORE_METRICS = frozenset(
    {"grad_norm", "lr", "token_mult_prob_error", "gen_kl_error", "num_tokens", "num_samples"}
)

# A metric named `<x>_max` is a maximum: micro-batch maxima combine by max, never by sum.
MAX_METRIC_SUFFIX = "_max"
MIN_METRIC_SUFFIX = "_min"


def combine_metric(name: str, total: float | None, part: float) -> float:
    """The batch value of metric `name` so far (`total`, None before the first micro-batch) with one more part."""
    if total is None:
        return part
    if name.endswith(MAX_METRIC_SUFFIX):
        return max(total, part)
    if name.endswith(MIN_METRIC_SUFFIX):
        return min(total, part)
    return total + part


@runtime_checkable
class LossFn(Protocol):
    def __call__(
        self,
        *,
        curr_logprobs: torch.Tensor,
        prev_logprobs: torch.Tensor,
        generation_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        normalizer: int,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss share and its metric shares (see the module docstring)."""
        ...


def check_loss_fn(loss_fn: object) -> LossFn:
    """`loss_fn` if it is callable; a `PolicyStepError` (`loss_fn`) with the fix otherwise."""
    if isinstance(loss_fn, LossConfig):
        raise PolicyStepError(
            "train_step got a LossConfig (the loss_fn: section), not a loss function; the policy "
            "no longer builds the GRPO loss itself (fix: pass "
            "nemo_rl.algorithms.grpo.ClippedPGLossFn.from_config(cfg.loss_fn))", kind="loss_fn"
        )
    if not callable(loss_fn):
        raise PolicyStepError(
            f"train_step got loss_fn={loss_fn!r} ({type(loss_fn).__name__}), which is not callable "
            "(fix: pass a LossFn, e.g. nemo_rl.algorithms.grpo.ClippedPGLossFn.from_config(cfg.loss_fn))", kind="loss_fn"
        )
    return loss_fn  # type: ignore[return-value]


def check_loss_output(out: object, loss_fn: object) -> tuple[torch.Tensor, dict[str, float]]:
    """The `(loss, metrics)` a LossFn returned, checked against the contract."""
    name = getattr(loss_fn, "__qualname__", type(loss_fn).__qualname__)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise PolicyStepError(f"loss_fn {name} returned {type(out).__name__}; a LossFn returns (loss, metrics)", kind="loss_fn")
    loss, metrics = out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise PolicyStepError(f"loss_fn {name} returned a loss that is not a 0-dim tensor: {loss!r}", kind="loss_fn")
    if not isinstance(metrics, dict):
        raise PolicyStepError(f"loss_fn {name} returned metrics of type {type(metrics).__name__}; expected a dict", kind="loss_fn")
    reserved = sorted(CORE_METRICS & set(metrics))
    if reserved:
        raise PolicyStepError(
            f"loss_fn {name} returned metric(s) {reserved} that the policy reports itself "
            "(fix: rename them in the loss)", kind="loss_fn"
        )
    return loss, metrics


# --- token logprobs and the micro-batch split (pure tensor helpers) ---------------------


def pad_right(rows: Sequence[Sequence[float]], pad: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rows as [B, max_len], right-padded (every real token keeps its position and causal
    context), plus a 0/1 long attention mask that is 1 exactly on real positions."""
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


# --- masked sums and the trainer/sampler mismatch metrics every loss shares -------------


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """`mask` as a bool tensor shaped like `like` (named `name` in errors); never empty."""
    if mask.shape != like.shape:
        raise PolicyStepError(f"mask shape {tuple(mask.shape)} != {name} shape {tuple(like.shape)}", kind="loss_input")
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise PolicyStepError("mask must hold only 0 and 1", kind="loss_input")
        mask = mask != 0
    if not bool(mask.any()):
        raise PolicyStepError("mask selects no token; a masked mean over zero tokens is undefined", kind="empty_mask")
    return mask


def check_same_shape(ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every keyword tensor has `ref`'s shape (the keyword names the offender)."""
    for name, t in tensors.items():
        if t.shape != ref.shape:
            raise PolicyStepError(f"{name} shape {tuple(t.shape)} != expected {tuple(ref.shape)}", kind="loss_input")


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where the bool `mask` is set."""
    # torch.where (not multiplication) so inf/nan at unselected positions cannot leak in.
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def mismatch_sums(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked sums (float64) of exp(|d|) and of exp(d) - d - 1, d = train - gen."""
    d = (train_logprobs - gen_logprobs).detach().to(torch.float64)
    mult = masked_sum(torch.exp(d.abs()), mask)
    k3 = masked_sum(torch.exp(d) - d - 1.0, mask)
    return mult, k3


def token_mult_prob_error(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over masked tokens of exp(|train - gen|); 1.0 means the logprobs agree exactly."""
    check_same_shape(train_logprobs, gen_logprobs=gen_logprobs)
    m = as_bool_mask(mask, train_logprobs, "train_logprobs")
    mult, _ = mismatch_sums(train_logprobs, gen_logprobs, m)
    return float(mult / m.sum())


def gen_kl_error(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimate of KL(P_gen || P_train): mean over masked tokens of exp(d) - d - 1, d = t - g."""
    check_same_shape(train_logprobs, gen_logprobs=gen_logprobs)
    m = as_bool_mask(mask, train_logprobs, "train_logprobs")
    _, k3 = mismatch_sums(train_logprobs, gen_logprobs, m)
    return float(k3 / m.sum())


# --- PolicyCore: the model, its optimizer and the step --------------------------------


@dataclass(frozen=True)
class _MicroBatch:
    """Padded tensors of one micro-batch of a TrainBatch (mask is False on padding)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    generation_logprobs: torch.Tensor
    advantages: torch.Tensor
    routes: torch.Tensor | None = None  # [B, T, L, K] replayed expert ids, -1 where none


def _prepare(batch: TrainBatch, idx: range, device: torch.device, replay: bool) -> _MicroBatch:
    ids, attn = pad_right([batch.token_ids[i] for i in idx], 0, torch.long)
    mask, _ = pad_right([batch.token_mask[i] for i in idx], 0, torch.long)
    gen, _ = pad_right([batch.generation_logprobs[i] for i in idx], 0.0, torch.float32)
    adv = torch.tensor([batch.advantages[i] for i in idx], dtype=torch.float32)
    routes = None
    if replay and batch.routed_experts is not None:
        routes = torch.from_numpy(batch.routed_experts[idx.start : idx.stop, : ids.shape[1]].astype("int64"))
        routes = routes.to(device)
    return _MicroBatch(
        ids.to(device), attn.to(device), mask.bool().to(device), gen.to(device), adv.to(device), routes
    )


def warmup_lr(base_lr: float, warmup_steps: int, step: int) -> float:
    """The rate of 1-based train step `step`: base_lr * min(1, step / warmup_steps)."""
    if step < 1:
        raise ValueError(f"step={step}: train steps are 1-based")
    if warmup_steps == 0:
        return base_lr
    return base_lr * min(1.0, step / warmup_steps)


class PolicyCore:
    """The in-process policy; see the module docstring for the contract."""

    def __init__(self, cfg: PolicyConfig) -> None:
        parts = build_parts(cfg)
        self._cfg, self._device, self._model = cfg, parts.device, parts.model
        self._routers, self._optimizer = parts.routers, parts.optimizer
        self._vocab_size = int(self._model.get_output_embeddings().weight.shape[0])
        self._steps_taken = 0

    @property
    def model(self) -> PreTrainedModel:
        return self._model

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self._optimizer

    @property
    def cfg(self) -> PolicyConfig:
        return self._cfg

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def steps_taken(self) -> int:
        """Optimizer steps taken (the lr warmup's k of the last step)."""
        return self._steps_taken

    def restore(self, weights: dict[str, torch.Tensor], optimizer_state: dict, steps_taken: int) -> None:
        """Replace weights, optimizer state and step count (`state_io.load_state` checked they fit)."""
        self._model.load_state_dict(weights, strict=True)
        self._optimizer.load_state_dict(optimizer_state)
        self._steps_taken = steps_taken

    def check_token_ids(self, token_ids: list[list[int]] | tuple[tuple[int, ...], ...]) -> None:
        if not token_ids:
            raise PolicyStepError("token_ids is empty; pass at least one sequence", kind="token_ids")
        for i, seq in enumerate(token_ids):
            if not seq:
                raise PolicyStepError(f"token_ids[{i}] is empty", kind="token_ids")
            for t, tok in enumerate(seq):
                if not 0 <= tok < self._vocab_size:
                    raise PolicyStepError(
                        f"token_ids[{i}][{t}]={tok} is outside the vocabulary [0, "
                        f"{self._vocab_size}) of policy.model_path={self._cfg.model_path!r}; "
                        "the tokens must come from this model's tokenizer", kind="token_ids"
                    )

    def forward_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        routes: torch.Tensor | None = None, stats: ReplayStats | None = None,
    ) -> torch.Tensor:
        input_ids, attention_mask = input_ids.to(self._device), attention_mask.to(self._device)
        with nullcontext() if routes is None else replaying(self._routers, routes, attention_mask, stats):
            logits = self._model(input_ids=input_ids, attention_mask=attention_mask).logits
        return gather_token_logprobs(logits, input_ids)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        loss_fn = check_loss_fn(loss_fn)
        self.check_token_ids(batch.token_ids)
        num_tokens = batch.num_masked_tokens
        if num_tokens == 0:
            raise PolicyStepError(
                f"TrainBatch of {batch.num_samples} samples has no masked token (all "
                "placeholders?); skip the step instead of training on nothing", kind="empty_mask"
            )
        replay = bool(self._routers)
        if replay and batch.routed_experts is not None:
            check_routes_fit(batch.routed_experts, self._routers, self._cfg.model_path)
        parts = [
            _prepare(batch, idx, self._device, replay)
            for idx in micro_batches(batch.num_samples, self._cfg.train_micro_batch_size)
        ]
        stats = ReplayStats()  # counted over the pre-update pass: one look at every token
        with torch.no_grad():
            prev = [self.forward_logprobs(p.input_ids, p.attention_mask, p.routes, stats) for p in parts]
            flat_prev = torch.cat([pv[p.loss_mask] for p, pv in zip(parts, prev)]).unsqueeze(0)
            flat_gen = torch.cat([p.generation_logprobs[p.loss_mask] for p in parts]).unsqueeze(0)
            all_tokens = torch.ones_like(flat_prev, dtype=torch.bool)
            mult_err = token_mult_prob_error(flat_prev, flat_gen, all_tokens)
            kl_err = gen_kl_error(flat_prev, flat_gen, all_tokens)

        self._optimizer.zero_grad(set_to_none=True)
        loss_metrics: dict[str, float] = {}
        for p, pv in zip(parts, prev):
            if not bool(p.loss_mask.any()):
                continue  # an all-placeholder micro-batch contributes no token and no gradient
            curr = self.forward_logprobs(p.input_ids, p.attention_mask, p.routes)
            out = loss_fn(
                curr_logprobs=curr,
                prev_logprobs=pv,
                generation_logprobs=p.generation_logprobs,
                advantages=p.advantages,
                mask=p.loss_mask,
                normalizer=num_tokens,
            )
            loss, m = check_loss_output(out, loss_fn)
            loss.backward()
            for k, v in m.items():  # shares sum to the batch value; `*_max` parts take the max
                loss_metrics[k] = combine_metric(k, loss_metrics.get(k), float(v))

        params = [q for q in self._model.parameters() if q.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self._cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            self._optimizer.zero_grad(set_to_none=True)
            raise PolicyStepError(
                f"grad norm is {grad_norm} on a batch of {batch.num_samples} samples / "
                f"{num_tokens} tokens; the step was not taken (check advantages and logprobs)", kind="non_finite_grad"
            )
        self._steps_taken += 1
        lr = warmup_lr(self._cfg.learning_rate, self._cfg.lr_warmup_steps, self._steps_taken)
        for group in self._optimizer.param_groups:
            group["lr"] = lr
        self._optimizer.step()
        return {
            "lr": lr,
            **loss_metrics,
            "grad_norm": grad_norm,
            "token_mult_prob_error": mult_err,
            "gen_kl_error": kl_err,
            "num_tokens": float(num_tokens),
            "num_samples": float(batch.num_samples),
            **(stats.metrics() if replay else {}),
        }


# --- the Ray shell around PolicyCore, and the driver's deadline-bounded client ----------

T = TypeVar("T")


def _own_node_id(_actor: object) -> str:
    return ray.get_runtime_context().get_node_id()


def _guard(method: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except PolicyWorkerError:
        raise
    except Exception as e:  # re-raised by name: the one class callers catch across Ray
        raise PolicyWorkerError(f"PolicyWorker.{method} failed: {error_name(e)}: {e}") from e


@ray.remote(num_cpus=1)
class PolicyWorker:
    def __init__(self, cfg: PolicyConfig, data_plane: DataPlaneConfig | None = None) -> None:
        self._core = _guard("__init__", PolicyCore, cfg)
        self._data_plane = data_plane
        self._client: DataPlaneClient | None = None

    def _read_plan(self, plan: TrainPlan) -> TrainBatch:
        if self._data_plane is None:
            raise PolicyWorkerError(
                "train_planned needs the data plane: spawn the policy worker with the run's DataPlaneConfig"
            )
        if self._client is None:
            self._client = attach_client(self._data_plane)
        return read_train_batch(self._client, plan)

    def train_planned(self, plan: TrainPlan, loss_fn: LossFn) -> dict[str, float]:
        batch = _guard("train_planned", self._read_plan, plan)
        return _guard("train_planned", self._core.train_step, batch, loss_fn)

    def close_data_plane(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        return _guard("get_logprobs", state_io.get_logprobs, self._core, token_ids)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        return _guard("train_step", self._core.train_step, batch, loss_fn)

    def export_weights(self, out_dir: str) -> str:
        return str(_guard("export_weights", state_io.export_weights, self._core, out_dir))

    def state_fingerprint(self) -> str:
        return _guard("state_fingerprint", state_io.state_fingerprint, self._core)

    def check_shared_dir(self, probe: SharedDirProbe, knob: str) -> None:
        import ray.util

        where = f"the policy worker on node {ray.util.get_node_ip_address()}"
        _guard("check_shared_dir", check_probe, probe, knob, where)

    def optimizer_fingerprint(self) -> str:
        return _guard("optimizer_fingerprint", state_io.optimizer_fingerprint, self._core)

    def save_state(self, out_dir: str) -> state_io.PolicyStateInfo:
        return _guard("save_state", state_io.save_state, self._core, out_dir)

    def load_state(self, in_dir: str) -> state_io.PolicyStateInfo:
        return _guard("load_state", state_io.load_state, self._core, in_dir)


class RayPolicyClient:
    """PolicyWorkerHandle over a PolicyWorker actor, with a deadline on every call."""

    def __init__(self, actor: ActorHandle, call_timeout_s: float, name: str) -> None:
        self._actor = actor
        self._timeout = call_timeout_s
        self._name = name

    @classmethod
    def spawn(
        cls, cfg: PolicyConfig, name: str = "policy_worker", data_plane: DataPlaneConfig | None = None
    ) -> RayPolicyClient:
        actor = PolicyWorker.options(num_gpus=1 if cfg.device == "cuda" else 0).remote(cfg, data_plane)
        return cls(actor, cfg.call_timeout_s, name)

    def _get(self, method: str, ref: ray.ObjectRef) -> Any:
        try:
            return call_with_deadline(ref, actor=self._name, op=method, timeout_s=self._timeout)
        except ActorRaisedError as e:
            assert e.cause is not None
            raise e.cause from None  # the worker's own PolicyWorkerError, naming the method
        except ActorCallTimeoutError as e:
            raise PolicyWorkerCallError(
                f"{self._name}.{method} missed its deadline of {self._timeout}s "
                "(policy.call_timeout_s); the worker is stuck or overloaded", kind="timeout"
            ) from e
        except ActorCallError as e:
            raise PolicyWorkerCallError(f"{self._name}.{method}: the actor died: {e.cause}", kind="died") from e

    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        return self._get("get_logprobs", self._actor.get_logprobs.remote(token_ids))

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        loss_fn = check_loss_fn(loss_fn)
        return self._get("train_step", self._actor.train_step.remote(batch, loss_fn))

    def train_planned(self, plan: TrainPlan, loss_fn: LossFn) -> dict[str, float]:
        """`train_step` on the rows the plan names, read and digest-checked by the worker itself."""
        loss_fn = check_loss_fn(loss_fn)
        return self._get("train_planned", self._actor.train_planned.remote(plan, loss_fn))

    def export_weights(self, out_dir: str | Path) -> Path:
        return Path(self._get("export_weights", self._actor.export_weights.remote(str(out_dir))))

    def state_fingerprint(self) -> str:
        return self._get("state_fingerprint", self._actor.state_fingerprint.remote())

    def node_id(self) -> str:
        """The Ray node the actor runs on, measured inside it."""
        return self._get("node_id", self._actor.__ray_call__.remote(_own_node_id))

    def check_shared_dir(self, probe: SharedDirProbe, knob: str) -> None:
        """The actor reads the driver's marker in `probe.folder`, or `PolicyWorkerError` names the knob."""
        self._get("check_shared_dir", self._actor.check_shared_dir.remote(probe, knob))

    def optimizer_fingerprint(self) -> str:
        return self._get("optimizer_fingerprint", self._actor.optimizer_fingerprint.remote())

    def save_state(self, out_dir: str | Path) -> state_io.PolicyStateInfo:
        return self._get("save_state", self._actor.save_state.remote(str(out_dir)))

    def load_state(self, in_dir: str | Path) -> state_io.PolicyStateInfo:
        return self._get("load_state", self._actor.load_state.remote(str(in_dir)))

    def kill(self) -> None:
        ray.kill(self._actor, no_restart=True)
