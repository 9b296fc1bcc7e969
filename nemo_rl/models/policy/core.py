"""PolicyCore: a Hugging Face causal LM (float32 on CPU by default), trained with a given loss.

Owns the model and its AdamW optimizer, no Ray: `get_logprobs`, `train_step(batch, loss_fn)`,
`export_weights` (the safetensors layout vLLM reloads), fingerprints, `save_state` / `load_state`.
Promises: the model stays in eval mode (no dropout), so reference and trained logprobs come from
one deterministic function; a step recomputes "prev" logprobs over the same micro-batches as
`get_logprobs` and reports their mismatch against the generation's; a restored state is checked
bit for bit against its recorded fingerprints. Refuses, by a named error: a batch without a
masked token (`EmptyMaskError`), a non-finite grad norm (`NonFiniteGradientError`, no step
taken), tied embeddings on export for the CPU engine, and a checkpoint that does not fit (`PolicyCheckpointError`).
With `router_replay: replay` the step's forwards replay the batch's routes (`router_replay`).
See docs/design-docs/policy.md, "`PolicyCore`".
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.errors import (
    EmptyMaskError,
    NonFiniteGradientError,
    PolicyError,
    PolicyDeviceError,
    PolicyLoadError,
    TokenIdOutOfRangeError,
    WeightExportError,
)
from nemo_rl.models.policy.loss import (
    LossFn,
    check_loss_fn,
    check_loss_output,
    combine_metric,
    gather_token_logprobs,
    gen_kl_error,
    micro_batches,
    pad_right,
    token_mult_prob_error,
)
from nemo_rl.models.policy.router_replay import (
    ReplayStats,
    RouterReplayConfigError,
    check_routes_fit,
    moe_routers,
    replaying,
)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
OPTIMIZER_FILE = "optimizer.pt"
POLICY_STATE_FILE = "policy_state.json"
POLICY_STATE_FORMAT = 1


class PolicyCheckpointError(PolicyError):
    """A policy checkpoint cannot be written, or does not fit this policy (the message names why)."""


@dataclass(frozen=True)
class PolicyStateInfo:
    """What `save_state` wrote / `load_state` restored: the step counter and both fingerprints."""

    steps_taken: int
    policy_fingerprint: str
    optimizer_fingerprint: str

    def __post_init__(self) -> None:
        if self.steps_taken < 0:
            raise ValueError(f"steps_taken={self.steps_taken}: a count of optimizer steps is >= 0")
        for name in ("policy_fingerprint", "optimizer_fingerprint"):
            value = getattr(self, name)
            if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
                raise ValueError(f"{name}={value!r}: not a sha256 hex digest")


@dataclass(frozen=True)
class _MicroBatch:
    """Padded tensors of one micro-batch of a TrainBatch (mask is False on padding)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    generation_logprobs: torch.Tensor
    advantages: torch.Tensor
    routes: torch.Tensor | None = None  # [B, T, L, K] replayed expert ids, -1 where none


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise PolicyDeviceError(
            "policy.device='cuda' but this process sees no CUDA device (torch.cuda.is_available() "
            "is False; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}) (fix: run on a GPU node, or "
            "set policy.device=cpu)"
        )
    return torch.device(name)


def _load_model(model_dir: Path, dtype: str, device: torch.device) -> PreTrainedModel:
    if not (model_dir / CONFIG_FILE).is_file():
        raise PolicyLoadError(
            f"policy.model_path={str(model_dir)!r} has no {CONFIG_FILE}; "
            "point it at a local Hugging Face model folder"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), local_files_only=True
        )
    except (OSError, ValueError) as e:
        raise PolicyLoadError(
            f"policy.model_path={str(model_dir)!r} could not be loaded as a causal LM: {e}"
        ) from e
    model.eval()
    return model.to(device)


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
        torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self._cfg = cfg
        self._model_dir = Path(cfg.model_path)
        self._device = _device(cfg.device)
        self._model = _load_model(self._model_dir, cfg.dtype, self._device)
        self._vocab_size = int(self._model.get_output_embeddings().weight.shape[0])
        self._routers = moe_routers(self._model) if cfg.router_replay == "replay" else []
        if cfg.router_replay == "replay" and not self._routers:
            raise RouterReplayConfigError(
                f"policy.router_replay='replay' but policy.model_path={cfg.model_path!r} has no MoE router (a "
                "dense model has no routes to replay) (fix: set policy.router_replay=off)"
            )
        self._optimizer = torch.optim.AdamW(
            self._model.parameters(),
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
        )
        self._steps_taken = 0

    @property
    def model(self) -> PreTrainedModel:
        return self._model

    def _check_token_ids(self, token_ids: list[list[int]] | tuple[tuple[int, ...], ...]) -> None:
        if not token_ids:
            raise TokenIdOutOfRangeError("token_ids is empty; pass at least one sequence")
        for i, seq in enumerate(token_ids):
            if not seq:
                raise TokenIdOutOfRangeError(f"token_ids[{i}] is empty")
            for t, tok in enumerate(seq):
                if not 0 <= tok < self._vocab_size:
                    raise TokenIdOutOfRangeError(
                        f"token_ids[{i}][{t}]={tok} is outside the vocabulary [0, "
                        f"{self._vocab_size}) of policy.model_path={self._cfg.model_path!r}; "
                        "the tokens must come from this model's tokenizer"
                    )

    def _forward_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        routes: torch.Tensor | None = None, stats: ReplayStats | None = None,
    ) -> torch.Tensor:
        input_ids, attention_mask = input_ids.to(self._device), attention_mask.to(self._device)
        with nullcontext() if routes is None else replaying(self._routers, routes, attention_mask, stats):
            logits = self._model(input_ids=input_ids, attention_mask=attention_mask).logits
        return gather_token_logprobs(logits, input_ids)

    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        self._check_token_ids(token_ids)
        out: list[list[float]] = []
        with torch.no_grad():
            for idx in micro_batches(len(token_ids), self._cfg.train_micro_batch_size):
                rows = [token_ids[i] for i in idx]
                ids, attn = pad_right(rows, 0, torch.long)
                lp = self._forward_logprobs(ids, attn)
                out.extend(lp[j, : len(row)].tolist() for j, row in enumerate(rows))
        return out

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        loss_fn = check_loss_fn(loss_fn)
        self._check_token_ids(batch.token_ids)
        num_tokens = batch.num_masked_tokens
        if num_tokens == 0:
            raise EmptyMaskError(
                f"TrainBatch of {batch.num_samples} samples has no masked token (all "
                "placeholders?); skip the step instead of training on nothing"
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
            prev = [self._forward_logprobs(p.input_ids, p.attention_mask, p.routes, stats) for p in parts]
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
            curr = self._forward_logprobs(p.input_ids, p.attention_mask, p.routes)
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
            raise NonFiniteGradientError(
                f"grad norm is {grad_norm} on a batch of {batch.num_samples} samples / "
                f"{num_tokens} tokens; the step was not taken (check advantages and logprobs)"
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

    def export_weights(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        emb_in = self._model.get_input_embeddings().weight
        emb_out = self._model.get_output_embeddings().weight
        tied = self._model.config.tie_word_embeddings or emb_in.data_ptr() == emb_out.data_ptr()
        if tied and self._cfg.engine_flavor == "cpu":
            raise WeightExportError(
                f"policy.model_path={self._cfg.model_path!r} ties input and output embeddings; "
                "vLLM's reload_weights would keep a stale lm_head on the CPU engine (generation.vllm.flavor=cpu). "
                "Use an untied model (tie_word_embeddings=false), or the GPU engine"
            )
        out.mkdir(parents=True, exist_ok=True)
        stale = sorted(
            f.name
            for f in out.iterdir()
            if f.name != WEIGHTS_FILE
            and (f.name.endswith(".safetensors") or f.name.endswith(".safetensors.index.json"))
        )
        if stale:
            raise WeightExportError(
                f"export dir {str(out)!r} already holds other weight files {stale}; a reload "
                "would read them too. Export into an empty folder"
            )
        # Clones: a tied lm_head shares the embedding's storage, which safetensors writes once per name.
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in self._model.state_dict().items()}
        partial = out / (WEIGHTS_FILE + ".partial")
        save_file(tensors, str(partial), metadata={"format": "pt"})
        shutil.copyfile(self._model_dir / CONFIG_FILE, out / CONFIG_FILE)
        os.replace(partial, out / WEIGHTS_FILE)
        return out

    def state_fingerprint(self) -> str:
        h = hashlib.sha256()
        for name, t in sorted(self._model.state_dict().items()):
            _hash_tensor(h, name, t)
        return h.hexdigest()

    def optimizer_fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(f"steps_taken|{self._steps_taken}|".encode())
        state = self._optimizer.state_dict()
        for i, group in enumerate(state["param_groups"]):
            # Hyperparameters are plain numbers/bools/None (AdamW); a tensor here would be a new
            # optimizer this fingerprint does not know, and json.dumps says so (TypeError).
            h.update(f"group|{i}|{json.dumps(group, sort_keys=True)}|".encode())
        for index in sorted(state["state"]):
            for key, value in sorted(state["state"][index].items()):
                if isinstance(value, torch.Tensor):
                    _hash_tensor(h, f"state|{index}|{key}", value)
                else:
                    h.update(f"state|{index}|{key}|{value!r}|".encode())
        return h.hexdigest()

    def _state_info(self) -> PolicyStateInfo:
        return PolicyStateInfo(self._steps_taken, self.state_fingerprint(), self.optimizer_fingerprint())

    def save_state(self, out_dir: str | Path) -> PolicyStateInfo:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        present = sorted(p.name for p in out.iterdir())
        if present:
            raise PolicyCheckpointError(
                f"save_state into {str(out)!r}: the folder already holds {present}; a checkpoint is written "
                "into an empty folder (fix: pass a new folder)"
            )
        info = self._state_info()
        # Clones: tied embeddings share storage, which safetensors refuses to write twice.
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in self._model.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        torch.save(self._optimizer.state_dict(), out / OPTIMIZER_FILE)
        record = {
            "format": POLICY_STATE_FORMAT,
            "steps_taken": info.steps_taken,
            "policy_fingerprint": info.policy_fingerprint,
            "optimizer_fingerprint": info.optimizer_fingerprint,
            "torch_rng": torch.get_rng_state().numpy().tobytes().hex(),
            "cuda_rng": [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
            if self._device.type == "cuda" else [],
        }
        with open(out / POLICY_STATE_FILE, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return info

    def _read_state_record(self, folder: Path) -> dict:
        path = folder / POLICY_STATE_FILE
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise PolicyCheckpointError(f"load_state: {str(folder)!r} has no {POLICY_STATE_FILE}; not a policy checkpoint") from e
        except json.JSONDecodeError as e:
            raise PolicyCheckpointError(f"load_state: {path} is not valid JSON ({e.msg})") from e
        if not isinstance(record, dict) or record.get("format") != POLICY_STATE_FORMAT:
            raise PolicyCheckpointError(
                f"load_state: {path} has format {record.get('format') if isinstance(record, dict) else record!r}; "
                f"this code reads format {POLICY_STATE_FORMAT}"
            )
        return record

    def _check_hyperparameters(self, groups: list[dict], folder: Path) -> None:
        want = {"betas": (self._cfg.adam_beta1, self._cfg.adam_beta2), "weight_decay": self._cfg.weight_decay}
        fields = {"betas": "policy.adam_beta1/adam_beta2", "weight_decay": "policy.weight_decay"}
        for i, group in enumerate(groups):
            for key, value in want.items():
                saved = tuple(group[key]) if key == "betas" else group[key]
                if saved != value:
                    raise PolicyCheckpointError(
                        f"load_state: the optimizer in {str(folder)!r} was saved with {key}={saved} (param group "
                        f"{i}) but {fields[key]} gives {value}; the restored optimizer would keep the saved value "
                        f"(fix: set {fields[key]} back to {saved}, or start a new run without resuming)"
                    )

    def _check_fits(self, weights: dict[str, torch.Tensor], optimizer_state: dict, folder: Path) -> None:
        """Everything that could refuse the checkpoint, checked before any state is touched."""
        own = self._model.state_dict()
        if set(weights) != set(own):
            raise PolicyCheckpointError(
                f"load_state: the weights in {str(folder)!r} do not fit policy.model_path={self._cfg.model_path!r}: "
                f"missing {sorted(set(own) - set(weights))[:5]}, unexpected {sorted(set(weights) - set(own))[:5]}"
            )
        for name, tensor in sorted(weights.items()):
            if tensor.shape != own[name].shape or tensor.dtype != own[name].dtype:
                raise PolicyCheckpointError(
                    f"load_state: the weights in {str(folder)!r} do not fit policy.model_path={self._cfg.model_path!r}: "
                    f"{name} is {tuple(tensor.shape)} {tensor.dtype} there, {tuple(own[name].shape)} {own[name].dtype} here"
                )
        groups = optimizer_state["param_groups"]
        sizes, own_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in self._optimizer.param_groups]
        if sizes != own_sizes:
            raise PolicyCheckpointError(
                f"load_state: the optimizer state in {str(folder)!r} covers parameter groups of sizes {sizes}, this "
                f"model's optimizer has {own_sizes}; it belongs to another model"
            )
        self._check_hyperparameters(groups, folder)

    def load_state(self, in_dir: str | Path) -> PolicyStateInfo:
        folder = Path(in_dir)
        record = self._read_state_record(folder)
        try:
            weights = load_file(str(folder / WEIGHTS_FILE), device=str(self._device))
            optimizer_state = torch.load(folder / OPTIMIZER_FILE, map_location=self._device, weights_only=True)
        except (OSError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            raise PolicyCheckpointError(f"load_state: cannot read the checkpoint in {str(folder)!r}: {type(e).__name__}: {e}") from e
        self._check_fits(weights, optimizer_state, folder)
        self._model.load_state_dict(weights, strict=True)
        self._optimizer.load_state_dict(optimizer_state)
        self._steps_taken = int(record["steps_taken"])
        torch.set_rng_state(_bytes_tensor(record["torch_rng"]))
        if self._device.type == "cuda":
            torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in record["cuda_rng"]])
        info = self._state_info()
        saved = PolicyStateInfo(record["steps_taken"], record["policy_fingerprint"], record["optimizer_fingerprint"])
        if info != saved:
            raise PolicyCheckpointError(
                f"load_state: the state restored from {str(folder)!r} is not the state that was saved "
                f"(restored {info}, recorded {saved}); the checkpoint is damaged"
            )
        return info


def _hash_tensor(h: "hashlib._Hash", label: str, t: torch.Tensor) -> None:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    h.update(f"{label}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(data.numpy().tobytes())


def _bytes_tensor(hex_text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(hex_text), dtype=torch.uint8).clone()
