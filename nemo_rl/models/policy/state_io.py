"""The policy's state outside a train step: the refit export and probe, checkpoints, fingerprints.

Free functions over a `PolicyCore` (the train step owns the model and optimizer; this module only
reads them, and writes them back through `PolicyCore.restore`); none runs in a train step.
`export_weights` writes the safetensors layout vLLM reloads (a refit); `get_logprobs` is the
trainer's side of the refit probe; `save_state` / `load_state` write and restore the whole
training state (weights, AdamW state, step count, RNG states); `state_fingerprint` /
`optimizer_fingerprint` are sha256 digests of the weights and the optimizer. Promises: a restored
state is checked bit for bit against its recorded fingerprints, and a checkpoint that does not
fit is refused before any state changes (`PolicyStateError`, `checkpoint`); tied embeddings are
refused on export for the CPU engine and a folder holding other weight files is never exported
into (`PolicyStateError`, `export`). See docs/design-docs/policy.md, "Checkpoints and the refit export".
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nemo_rl.data.errors import error_name
from nemo_rl.models.policy.errors import PolicyStateError
from nemo_rl.models.policy.setup import CONFIG_FILE

if TYPE_CHECKING:  # the worker module imports this one
    from nemo_rl.models.policy.worker import PolicyCore

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
POLICY_STATE_FILE = "policy_state.json"
POLICY_STATE_FORMAT = 1


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


def _cpu_tensors(core: PolicyCore) -> dict[str, torch.Tensor]:
    # Clones: a tied lm_head shares the embedding's storage, which safetensors writes once per name.
    return {k: v.detach().cpu().clone().contiguous() for k, v in core.model.state_dict().items()}


def export_weights(core: PolicyCore, out_dir: str | Path) -> Path:
    """Write `model.safetensors` (atomically renamed into place) + `config.json` into `out_dir`."""
    out = Path(out_dir)
    model, cfg = core.model, core.cfg
    emb_in = model.get_input_embeddings().weight
    emb_out = model.get_output_embeddings().weight
    tied = model.config.tie_word_embeddings or emb_in.data_ptr() == emb_out.data_ptr()
    if tied and cfg.engine_flavor == "cpu":
        raise PolicyStateError(
            f"policy.model_path={cfg.model_path!r} ties input and output embeddings; "
            "vLLM's reload_weights would keep a stale lm_head on the CPU engine (generation.vllm.flavor=cpu). "
            "Use an untied model (tie_word_embeddings=false), or the GPU engine", kind="export"
        )
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(
        f.name
        for f in out.iterdir()
        if f.name != WEIGHTS_FILE
        and (f.name.endswith(".safetensors") or f.name.endswith(".safetensors.index.json"))
    )
    if stale:
        raise PolicyStateError(
            f"export dir {str(out)!r} already holds other weight files {stale}; a reload "
            "would read them too. Export into an empty folder", kind="export"
        )
    partial = out / (WEIGHTS_FILE + ".partial")
    save_file(_cpu_tensors(core), str(partial), metadata={"format": "pt"})
    shutil.copyfile(Path(cfg.model_path) / CONFIG_FILE, out / CONFIG_FILE)
    os.replace(partial, out / WEIGHTS_FILE)
    return out


def get_logprobs(core: PolicyCore, token_ids: list[list[int]]) -> list[list[float]]:
    """Per sequence, log p(token_t | tokens_<t) (0.0 at t = 0), in the train step's micro-batches."""
    from nemo_rl.models.policy.worker import micro_batches, pad_right  # here: the worker imports this module

    core.check_token_ids(token_ids)
    out: list[list[float]] = []
    with torch.no_grad():
        for idx in micro_batches(len(token_ids), core.cfg.train_micro_batch_size):
            rows = [token_ids[i] for i in idx]
            ids, attn = pad_right(rows, 0, torch.long)
            lp = core.forward_logprobs(ids, attn)
            out.extend(lp[j, : len(row)].tolist() for j, row in enumerate(rows))
    return out


def state_fingerprint(core: PolicyCore) -> str:
    """sha256 over (name, dtype, shape, bytes) of every state-dict entry, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(core.model.state_dict().items()):
        _hash_tensor(h, name, t)
    return h.hexdigest()


def optimizer_fingerprint(core: PolicyCore) -> str:
    """sha256 over the steps taken, every param group's hyperparameters and every state tensor."""
    h = hashlib.sha256()
    h.update(f"steps_taken|{core.steps_taken}|".encode())
    state = core.optimizer.state_dict()
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


def _state_info(core: PolicyCore) -> PolicyStateInfo:
    return PolicyStateInfo(core.steps_taken, state_fingerprint(core), optimizer_fingerprint(core))


def save_state(core: PolicyCore, out_dir: str | Path) -> PolicyStateInfo:
    """Write the weights, the optimizer state and `policy_state.json` into an empty (or new) folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    present = sorted(p.name for p in out.iterdir())
    if present:
        raise PolicyStateError(
            f"save_state into {str(out)!r}: the folder already holds {present}; a checkpoint is written "
            "into an empty folder (fix: pass a new folder)", kind="checkpoint"
        )
    info = _state_info(core)
    save_file(_cpu_tensors(core), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    torch.save(core.optimizer.state_dict(), out / OPTIMIZER_FILE)
    record = {
        "format": POLICY_STATE_FORMAT,
        "steps_taken": info.steps_taken,
        "policy_fingerprint": info.policy_fingerprint,
        "optimizer_fingerprint": info.optimizer_fingerprint,
        "torch_rng": torch.get_rng_state().numpy().tobytes().hex(),
        "cuda_rng": [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
        if core.device.type == "cuda" else [],
    }
    with open(out / POLICY_STATE_FILE, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return info


def _read_state_record(folder: Path) -> dict:
    path = folder / POLICY_STATE_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise PolicyStateError(f"load_state: {str(folder)!r} has no {POLICY_STATE_FILE}; not a policy checkpoint", kind="checkpoint") from e
    except json.JSONDecodeError as e:
        raise PolicyStateError(f"load_state: {path} is not valid JSON ({e.msg})", kind="checkpoint") from e
    if not isinstance(record, dict) or record.get("format") != POLICY_STATE_FORMAT:
        raise PolicyStateError(
            f"load_state: {path} has format {record.get('format') if isinstance(record, dict) else record!r}; "
            f"this code reads format {POLICY_STATE_FORMAT}", kind="checkpoint"
        )
    return record


def _check_hyperparameters(core: PolicyCore, groups: list[dict], folder: Path) -> None:
    cfg = core.cfg
    want = {"betas": (cfg.adam_beta1, cfg.adam_beta2), "weight_decay": cfg.weight_decay}
    fields = {"betas": "policy.adam_beta1/adam_beta2", "weight_decay": "policy.weight_decay"}
    for i, group in enumerate(groups):
        for key, value in want.items():
            saved = tuple(group[key]) if key == "betas" else group[key]
            if saved != value:
                raise PolicyStateError(
                    f"load_state: the optimizer in {str(folder)!r} was saved with {key}={saved} (param group "
                    f"{i}) but {fields[key]} gives {value}; the restored optimizer would keep the saved value "
                    f"(fix: set {fields[key]} back to {saved}, or start a new run without resuming)", kind="checkpoint"
                )


def _check_fits(core: PolicyCore, weights: dict[str, torch.Tensor], optimizer_state: dict, folder: Path) -> None:
    """Everything that could refuse the checkpoint, checked before any state is touched."""
    own, model_path = core.model.state_dict(), core.cfg.model_path
    if set(weights) != set(own):
        raise PolicyStateError(
            f"load_state: the weights in {str(folder)!r} do not fit policy.model_path={model_path!r}: "
            f"missing {sorted(set(own) - set(weights))[:5]}, unexpected {sorted(set(weights) - set(own))[:5]}", kind="checkpoint"
        )
    for name, tensor in sorted(weights.items()):
        if tensor.shape != own[name].shape or tensor.dtype != own[name].dtype:
            raise PolicyStateError(
                f"load_state: the weights in {str(folder)!r} do not fit policy.model_path={model_path!r}: "
                f"{name} is {tuple(tensor.shape)} {tensor.dtype} there, {tuple(own[name].shape)} {own[name].dtype} here", kind="checkpoint"
            )
    groups = optimizer_state["param_groups"]
    sizes, own_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in core.optimizer.param_groups]
    if sizes != own_sizes:
        raise PolicyStateError(
            f"load_state: the optimizer state in {str(folder)!r} covers parameter groups of sizes {sizes}, this "
            f"model's optimizer has {own_sizes}; it belongs to another model", kind="checkpoint"
        )
    _check_hyperparameters(core, groups, folder)


def load_state(core: PolicyCore, in_dir: str | Path) -> PolicyStateInfo:
    """Restore what `save_state` wrote into `core`, bit for bit, and check it against the record."""
    folder = Path(in_dir)
    record = _read_state_record(folder)
    try:
        weights = load_file(str(folder / WEIGHTS_FILE), device=str(core.device))
        optimizer_state = torch.load(folder / OPTIMIZER_FILE, map_location=core.device, weights_only=True)
    except (OSError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise PolicyStateError(f"load_state: cannot read the checkpoint in {str(folder)!r}: {error_name(e)}: {e}", kind="checkpoint") from e
    _check_fits(core, weights, optimizer_state, folder)
    core.restore(weights, optimizer_state, int(record["steps_taken"]))
    torch.set_rng_state(_bytes_tensor(record["torch_rng"]))
    if core.device.type == "cuda":
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in record["cuda_rng"]])
    info = _state_info(core)
    saved = PolicyStateInfo(record["steps_taken"], record["policy_fingerprint"], record["optimizer_fingerprint"])
    if info != saved:
        raise PolicyStateError(
            f"load_state: the state restored from {str(folder)!r} is not the state that was saved "
            f"(restored {info}, recorded {saved}); the checkpoint is damaged", kind="checkpoint"
        )
    return info


def _hash_tensor(h: "hashlib._Hash", label: str, t: torch.Tensor) -> None:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    h.update(f"{label}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(data.numpy().tobytes())


def _bytes_tensor(hex_text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(hex_text), dtype=torch.uint8).clone()
