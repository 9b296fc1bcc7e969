"""A real engine's refit logs no known-benign reload warning, and a real load failure still shows.

vLLM's layerwise reload warns "<Layer>: Failed to load weights" for every layer no weight reached.
For the rotary embedding that is every reload and means nothing (its one tensor is a computed
cache no checkpoint holds), so the worker keeps it out of the log
(`worker_extension.quiet_checkpointless_reloads`). The proof that the filter hides nothing else:
a reload from a folder that lacks one real weight must still print that layer's warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from examples.arith.tiny_model import TinyModelConfig, ensure_tiny_model
from nemo_rl.models.generation.vllm.config import VllmConfig
from nemo_rl.models.generation.vllm.lifecycle import cpu_engine_env
from nemo_rl.utils.venvs import REPO_ROOT, ensure_venv, venv_python, vllm_spec

pytestmark = pytest.mark.integration

PROBE = REPO_ROOT / "tests" / "integration" / "reload_warning_probe.py"
PROBE_TIMEOUT_S = 600
DROPPED = "model.layers.0.mlp.down_proj.weight"  # vLLM serves it in a RowParallelLinear


def _weights_without(model_dir: Path, out: Path, dropped: str) -> Path:
    out.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
            continue
        tensors = load_file(f)
        save_file({k: v for k, v in tensors.items() if k != dropped}, out / f.name, metadata={"format": "pt"})
    return out


def _section(stderr: str, start: str, end: str) -> str:
    lines = stderr.splitlines()
    i = lines.index(f"RELOAD-PROBE-MARK {start}")
    j = lines.index(f"RELOAD-PROBE-MARK {end}")
    return "\n".join(lines[i + 1 : j])


def test_a_refit_is_quiet_about_the_rotary_cache_and_loud_about_a_missing_weight(tmp_path: Path) -> None:
    model_dir = ensure_tiny_model(TinyModelConfig())
    tensors = {k for f in model_dir.glob("*.safetensors") for k in load_file(f)}
    assert DROPPED in tensors, sorted(tensors)[:8]
    partial = _weights_without(model_dir, tmp_path / "partial", DROPPED)
    python = venv_python(ensure_venv(vllm_spec("cpu")))
    proc = subprocess.run(
        [str(python), str(PROBE), str(model_dir), str(model_dir), str(partial)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        env={**os.environ, **cpu_engine_env(VllmConfig(flavor="cpu")), "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 0, f"probe exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    full_reload = _section(proc.stdout, "started", "full reloaded")
    partial_reload = _section(proc.stdout, "full reloaded", "partial reloaded")
    assert "Failed to load weights" not in full_reload, full_reload
    failed = [line for line in partial_reload.splitlines() if "Failed to load weights" in line]
    assert len(failed) == 1 and "RowParallelLinear: Failed to load weights" in failed[0], partial_reload
