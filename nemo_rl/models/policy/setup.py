"""The policy's set-up: the parts a `PolicyCore` is built from, made once per worker, never per step.

`build_parts(cfg)` seeds torch and sets its thread count, picks the device (a `PolicyLoadError` of
kind `device` for cuda without a visible GPU), loads the local Hugging Face causal LM in
`policy.dtype` and in eval mode (`model`, naming `policy.model_path`), lists its MoE routers when
`router_replay: replay` (`router_replay` for a dense model) and builds its AdamW.
See docs/design-docs/policy.md, "`PolicyCore`".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from nemo_rl.models.policy.config import PolicyConfig
from nemo_rl.models.policy.errors import PolicyLoadError
from nemo_rl.models.policy.router_replay import moe_routers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class CoreParts:
    """What a `PolicyCore` holds from its start: device, model, replayed routers, optimizer."""

    device: torch.device
    model: PreTrainedModel
    routers: list[nn.Module]
    optimizer: torch.optim.AdamW


def choose_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise PolicyLoadError(
            "policy.device='cuda' but this process sees no CUDA device (torch.cuda.is_available() "
            "is False; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}) (fix: run on a GPU node, or "
            "set policy.device=cpu)", kind="device"
        )
    return torch.device(name)


def load_model(model_dir: Path, dtype: str, device: torch.device) -> PreTrainedModel:
    if not (model_dir / CONFIG_FILE).is_file():
        raise PolicyLoadError(
            f"policy.model_path={str(model_dir)!r} has no {CONFIG_FILE}; "
            "point it at a local Hugging Face model folder", kind="model"
        )
    from transformers import AutoModelForCausalLM  # only the worker pays for transformers

    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), local_files_only=True
        )
    except (OSError, ValueError) as e:
        raise PolicyLoadError(
            f"policy.model_path={str(model_dir)!r} could not be loaded as a causal LM: {e}", kind="model"
        ) from e
    model.eval()
    return model.to(device)


def build_parts(cfg: PolicyConfig) -> CoreParts:
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    device = choose_device(cfg.device)
    model = load_model(Path(cfg.model_path), cfg.dtype, device)
    routers = moe_routers(model) if cfg.router_replay == "replay" else []
    if cfg.router_replay == "replay" and not routers:
        raise PolicyLoadError(
            f"policy.router_replay='replay' but policy.model_path={cfg.model_path!r} has no MoE router (a "
            "dense model has no routes to replay) (fix: set policy.router_replay=off)", kind="router_replay"
        )
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
    )
    return CoreParts(device, model, routers, optimizer)
