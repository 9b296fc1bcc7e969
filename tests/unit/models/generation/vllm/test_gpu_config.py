"""The GPU flavor as configuration: the recipe validates on this CPU host, the GPU knobs are
checked, the GPU check is a pure function of (env, device nodes), and flavor=gpu on a host without
a visible CUDA device is a named GenerationSetupError before anything is started (no Ray, no venv)."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
import pytest

from nemo_rl.algorithms.grpo_config import load_master_config, policy_config
from nemo_rl.models.generation.vllm import launcher
from nemo_rl.models.generation.vllm.config import GenerationConfig, GenerationSetupError, VllmConfig
from nemo_rl.models.generation.vllm.lifecycle import engine_args
from nemo_rl.models.generation.vllm.launcher import (
    check_gpu_available,
    detect_flavor,
    resolve_flavor,
    resolved_generation,
    visible_gpu_count,
    worker_num_gpus,
)
from nemo_rl.models.policy.config import dtype_mismatch
from nemo_rl.utils.config import ConfigError

RECIPE = Path(__file__).resolve().parents[5] / "examples" / "configs" / "grpo_capture_gpu.yaml"
NO_NODES: list[str] = []
TWO = ["nvidia0", "nvidia1"]


def _gpu_recipe(*extra: str):
    return load_master_config(RECIPE, ["model.path=/models/some-hf-folder", "logger.log_dir=/tmp/gpu-run", *extra])


def test_gpu_recipe_validates_on_a_cpu_host() -> None:
    cfg = _gpu_recipe()
    vllm = cfg.generation.vllm
    assert (vllm.flavor, vllm.dtype, vllm.tensor_parallel_size) == ("gpu", "bfloat16", 1)
    assert 0.0 < vllm.gpu_memory_utilization <= 1.0
    assert cfg.model.path == "/models/some-hf-folder"
    assert cfg.token_capture.enabled is True
    pcfg = policy_config(cfg, cfg.model.path, "gpu")
    assert (pcfg.dtype, pcfg.device, pcfg.model_path, pcfg.engine_flavor) == (
        "bfloat16", "cuda", "/models/some-hf-folder", "gpu")
    assert dtype_mismatch(pcfg.dtype, vllm.dtype) is None
    assert _gpu_recipe("generation.vllm.tensor_parallel_size=4").generation.vllm.tensor_parallel_size == 4


def test_gpu_recipe_needs_a_model_path() -> None:
    with pytest.raises(ConfigError, match=r"model\.path is mandatory"):
        load_master_config(RECIPE)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("generation.vllm.tensor_parallel_size=0", r"generation\.vllm\.tensor_parallel_size=0.*>= 1"),
        ("generation.vllm.gpu_memory_utilization=1.5", r"gpu_memory_utilization=1\.5.*<= 1"),
        ("generation.vllm.gpu_memory_utilization=0", r"gpu_memory_utilization=0.*> 0"),
        ("generation.vllm.flavor=cpu", r"dtype='bfloat16' needs generation\.vllm\.flavor=gpu \(got 'cpu'\)"),
        ("generation.vllm.flavor=auto", r"dtype='bfloat16' needs generation\.vllm\.flavor=gpu \(got 'auto'\)"),
        ("generation.vllm.dtype=float64", r"generation\.vllm\.dtype"),
        ("policy.dtype=float16", r"policy\.dtype"),
        ("policy.device=tpu", r"policy\.device"),
    ],
)
def test_gpu_knobs_are_validated_with_the_key_named(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _gpu_recipe(override)


def test_tensor_parallel_needs_the_gpu_flavor() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"tensor_parallel_size=2 needs generation\.vllm\.flavor=gpu"):
        VllmConfig(flavor="cpu", tensor_parallel_size=2)
    assert VllmConfig().dtype == "float32"  # the CPU default is unchanged


@pytest.mark.parametrize(
    ("env", "nodes", "count"),
    [
        ({}, NO_NODES, 0),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, NO_NODES, 0),  # no driver: the variable alone is no GPU
        ({}, TWO, 2),
        ({"CUDA_VISIBLE_DEVICES": ""}, TWO, 0),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, TWO, 0),
        ({"CUDA_VISIBLE_DEVICES": "1"}, TWO, 1),
        ({"CUDA_VISIBLE_DEVICES": "0, 1,-1,2"}, TWO, 2),  # CUDA stops at the first invalid entry
        ({"CUDA_VISIBLE_DEVICES": "GPU-8f2a,GPU-77c1"}, TWO, 2),  # UUIDs count too
    ],
)
def test_visible_gpu_count(env, nodes, count) -> None:
    assert visible_gpu_count(env, nodes) == count


def test_flavor_gpu_on_a_host_without_gpu_is_a_named_error() -> None:
    with pytest.raises(GenerationSetupError, match=r"generation\.vllm\.flavor=gpu.*no NVIDIA device node.*fix: .*flavor=cpu") as e:
        check_gpu_available("gpu", env={}, device_nodes=NO_NODES)
    assert e.value.kind == "no_gpu"
    with pytest.raises(GenerationSetupError, match=r"CUDA_VISIBLE_DEVICES='' hides all 2 device\(s\)") as e:
        check_gpu_available("gpu", env={"CUDA_VISIBLE_DEVICES": ""}, device_nodes=TWO)
    assert e.value.kind == "no_gpu"
    with pytest.raises(GenerationSetupError, match=r"need 3 GPU\(s\) but 2 are visible.*tensor_parallel_size") as e:
        check_gpu_available("gpu", 3, env={}, device_nodes=TWO)
    assert e.value.kind == "too_few_gpus"
    assert check_gpu_available("gpu", 2, env={}, device_nodes=TWO) == 2
    assert check_gpu_available("cpu", 8, env={}, device_nodes=NO_NODES) == 0


def test_this_host_starting_the_gpu_recipe_raises_no_gpu_error() -> None:
    # The real detection (os.environ, /dev) on this CPU host, exactly as spawn_workers calls it.
    if visible_gpu_count(os.environ, launcher.nvidia_device_nodes()) > 0:
        pytest.skip("this host has a visible GPU")
    gen = _gpu_recipe().generation
    with pytest.raises(GenerationSetupError, match="generation.vllm.flavor=gpu") as e:
        resolve_flavor(gen)
    assert e.value.kind == "no_gpu"
    assert detect_flavor("auto") == "cpu"


def test_spawn_workers_checks_the_gpu_before_building_the_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "nvidia_device_nodes", lambda dev_dir="/dev": [])

    def no_venv(*a, **k):
        raise AssertionError("the venv build must not start without a GPU")

    monkeypatch.setattr(launcher, "ensure_venv", no_venv)
    with pytest.raises(GenerationSetupError) as e:
        launcher.spawn_workers(Path("/models/x"), _gpu_recipe().generation, {}, None, progress=lambda _: None)
    assert e.value.kind == "no_gpu"


def test_resolution_counts_every_gpu_the_knobs_ask_for() -> None:
    gen = GenerationConfig(num_workers=2, vllm=VllmConfig(flavor="gpu", dtype="bfloat16", tensor_parallel_size=2))
    four = [f"nvidia{i}" for i in range(4)]
    assert resolve_flavor(gen, env={}, device_nodes=four) == "gpu"
    with pytest.raises(GenerationSetupError, match="need 5 GPU") as e:
        resolve_flavor(gen, extra_gpus=1, env={}, device_nodes=four)
    assert e.value.kind == "too_few_gpus"
    assert worker_num_gpus(gen, "gpu") == 2 and worker_num_gpus(GenerationConfig(), "cpu") == 0
    assert detect_flavor("auto", env={}, device_nodes=four) == "gpu"
    assert detect_flavor("auto", env={"CUDA_VISIBLE_DEVICES": ""}, device_nodes=four) == "cpu"
    auto = GenerationConfig()
    assert resolved_generation(auto, "cpu").vllm.flavor == "cpu"
    assert resolved_generation(auto, "cpu").model_dump()["vllm"] == {**auto.model_dump()["vllm"], "flavor": "cpu"}


def test_engine_args_per_flavor() -> None:
    model = Path("/models/m")
    cpu = VllmConfig(flavor="cpu")
    assert engine_args(model, cpu) == dict(  # exactly what the CPU engine was always given
        model="/models/m", tokenizer="/models/m", dtype="float32", seed=0, enforce_eager=True,
        max_model_len=2048, kv_cache_memory_bytes=256 * 1024 * 1024, distributed_executor_backend="uni",
        enable_prefix_caching=True, disable_log_stats=True,
        worker_extension_cls="nemo_rl.models.generation.vllm.worker_extension.HostMemoryTrim",
    )
    assert engine_args(model, VllmConfig()) == engine_args(model, cpu)  # unresolved auto: CPU args
    gpu = engine_args(model, VllmConfig(flavor="gpu", dtype="bfloat16", tensor_parallel_size=2,
                                        gpu_memory_utilization=0.8))
    assert gpu["dtype"] == "bfloat16" and gpu["tensor_parallel_size"] == 2
    assert gpu["gpu_memory_utilization"] == 0.8 and gpu["distributed_executor_backend"] == "mp"
    assert "kv_cache_memory_bytes" not in gpu  # it would override gpu_memory_utilization
    assert engine_args(model, VllmConfig(flavor="gpu"))["distributed_executor_backend"] == "uni"
