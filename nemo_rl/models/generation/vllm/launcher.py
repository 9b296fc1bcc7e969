"""Driver-side launch of vLLM generation workers in their flavored venv, with deadlines.

Owns `resolve_flavor` (GPU detection), `worker_env`, and `spawn_workers` / `await_workers`, which
hand the actor class (`worker.VllmGenerationWorker`) to Ray and return a `client.WorkerGroup`
(the driver's handle on the running workers). Promises: the flavor and the placement plan are
checked before the venv build or any engine starts (`GenerationSetupError`, `RayClusterError`
of kind `placement`), and so are parser names the worker does not apply yet
(`check_parsers_served`); `spawn_workers` returns base URLs as soon as the ports are open, so other
components start while engines load; every start-up call has the start-up deadline and a dead
or hung actor surfaces as `WorkerError` naming the operation (the group shut down first).
Worker `i` is built with `worker_index=i`; the run's control bearer is minted here and kept on
`WorkerGroup.control_token` (never printed or logged).
See docs/design-docs/vllm-worker-capture.md, "The launcher".
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from nemo_rl.distributed.actor_call import ActorCallError, ActorCallTimeoutError, call_with_deadline, deadline_left
from nemo_rl.distributed.placement import alive_nodes, node_affinity, plan_worker_placement
from nemo_rl.models.generation.vllm.client import WORKERS, WorkerGroup
from nemo_rl.models.generation.vllm.config import GenerationConfig, GenerationSetupError
from nemo_rl.models.generation.vllm.errors import WorkerError
from nemo_rl.models.generation.vllm.lifecycle import cpu_engine_env
from nemo_rl.models.generation.vllm.tool_parsers import TOOL_CALL_PARSERS
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker
from nemo_rl.utils.venvs import REPO_ROOT, ensure_venv, venv_python, vllm_spec

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def nvidia_device_nodes(dev_dir: str = "/dev") -> list[str]:
    """The per-GPU device nodes (`nvidia0`, `nvidia1`, ...) the NVIDIA driver created, sorted."""
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return []
    return sorted(n for n in names if re.fullmatch(r"nvidia\d+", n))


def visible_gpu_count(env: Mapping[str, str], device_nodes: Sequence[str]) -> int:
    """CUDA devices a process started here may use, decided without initialising CUDA.

    No NVIDIA device node means no GPU. `CUDA_VISIBLE_DEVICES`, when set, narrows the nodes as
    CUDA does: its entries up to the first empty or negative one (so "" and "-1" hide all).
    """
    if not device_nodes:
        return 0
    raw = env.get(CUDA_VISIBLE_DEVICES)
    if raw is None:
        return len(device_nodes)
    count = 0
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count


def _no_gpu_reason(env: Mapping[str, str], device_nodes: Sequence[str]) -> str:
    if not device_nodes:
        return "no NVIDIA device node (/dev/nvidia<N>) exists on this host"
    return f"{CUDA_VISIBLE_DEVICES}={env.get(CUDA_VISIBLE_DEVICES)!r} hides all {len(device_nodes)} device(s)"


def check_gpu_available(
    flavor: str,
    gpus_needed: int = 1,
    *,
    env: Mapping[str, str] | None = None,
    device_nodes: Sequence[str] | None = None,
) -> int:
    """For flavor=gpu: the number of visible GPUs, or `GenerationSetupError` (`no_gpu`, `too_few_gpus`).

    Pure given `env` and `device_nodes` (default: `os.environ` and `/dev`); other flavors need
    no GPU and return 0. Cheap: call it before anything expensive (Ray, venv build, engines).
    """
    if flavor != "gpu":
        return 0
    env = os.environ if env is None else env
    nodes = nvidia_device_nodes() if device_nodes is None else list(device_nodes)
    count = visible_gpu_count(env, nodes)
    if count == 0:
        raise GenerationSetupError(
            f"generation.vllm.flavor=gpu but no CUDA device is visible: {_no_gpu_reason(env, nodes)} "
            "(fix: run on a GPU node with the NVIDIA driver, or set generation.vllm.flavor=cpu "
            "with generation.vllm.dtype=float32, policy.dtype=float32 and policy.device=cpu)",
            kind="no_gpu",
        )
    if count < gpus_needed:
        raise GenerationSetupError(
            f"the GPU knobs need {gpus_needed} GPU(s) but {count} are visible "
            f"({CUDA_VISIBLE_DEVICES}={env.get(CUDA_VISIBLE_DEVICES, '<unset>')!r}, "
            f"{len(nodes)} device node(s)) (fix: lower generation.num_workers x "
            "generation.vllm.tensor_parallel_size (+1 for policy.device=cuda), or make more GPUs visible)",
            kind="too_few_gpus",
        )
    return count


def detect_flavor(requested: str, *, env: Mapping[str, str] | None = None,
                  device_nodes: Sequence[str] | None = None) -> str:
    """`requested` unless it is auto; auto is gpu iff at least one CUDA device is visible."""
    if requested != "auto":
        return requested
    env = os.environ if env is None else env
    nodes = nvidia_device_nodes() if device_nodes is None else device_nodes
    return "gpu" if visible_gpu_count(env, nodes) > 0 else "cpu"


def resolve_flavor(gen: GenerationConfig, *, extra_gpus: int = 0, env: Mapping[str, str] | None = None,
                   device_nodes: Sequence[str] | None = None) -> str:
    """The flavor the workers run ("cpu" or "gpu"), checked against the visible GPUs.

    flavor=gpu needs `num_workers * tensor_parallel_size + extra_gpus` visible GPUs (pass
    extra_gpus=1 when the policy takes a GPU too); else `GenerationSetupError`.
    """
    flavor = detect_flavor(gen.vllm.flavor, env=env, device_nodes=device_nodes)
    needed = gen.num_workers * gen.vllm.tensor_parallel_size + extra_gpus
    check_gpu_available(flavor, needed, env=env, device_nodes=device_nodes)
    return flavor


def check_parsers_served(gen: GenerationConfig) -> None:
    """`GenerationSetupError` for a parser name the config takes but the worker does not apply yet.

    The config takes every name of vLLM's registries (`parser_names.py`); the worker's chat path
    still parses with `tool_parsers.TOOL_CALL_PARSERS` and no reasoning parser until it calls
    `parsers.py` (issue 33, item 1). Checked before the venv build and the engines, so such a
    recipe fails at once instead of serving replies its knob does not shape.
    """
    if gen.tool_call_parser not in TOOL_CALL_PARSERS:
        raise GenerationSetupError(
            f"generation.tool_call_parser={gen.tool_call_parser!r} is a name of vLLM's registry, but the worker's "
            f"chat path applies only {sorted(TOOL_CALL_PARSERS)} until it parses through parsers.py (fix: set "
            "generation.tool_call_parser to one of those)",
            kind="tool_call_parser",
        )
    if gen.reasoning_parser is not None:
        raise GenerationSetupError(
            f"generation.reasoning_parser={gen.reasoning_parser!r} is a name of vLLM's registry, but the worker's "
            "chat path applies no reasoning parser until it parses through parsers.py (fix: set "
            "generation.reasoning_parser=null)",
            kind="reasoning_parser",
        )


def worker_num_gpus(gen: GenerationConfig, flavor: str) -> int:
    """GPUs Ray reserves per worker actor (it sets the actor's CUDA_VISIBLE_DEVICES to them)."""
    return gen.vllm.tensor_parallel_size if flavor == "gpu" else 0


def resolved_generation(gen: GenerationConfig, flavor: str) -> GenerationConfig:
    """`gen` with `vllm.flavor` replaced by the resolved flavor (what the worker's engine reads)."""
    return gen.model_copy(update={"vllm": gen.vllm.model_copy(update={"flavor": flavor})})


def worker_env(gen: GenerationConfig, flavor: str) -> dict[str, str]:
    env = {
        "PYTHONPATH": str(REPO_ROOT),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if flavor == "cpu":
        env.update(cpu_engine_env(gen.vllm))
    return env


@dataclass
class PendingWorkers:
    """Worker actors with open (503) endpoints whose engines are starting (see `spawn_workers`)."""

    group: WorkerGroup
    base_urls: list[str]
    engine_refs: list[Any]
    deadline: float  # time.monotonic() by which the workers must serve
    timeout_s: float


def _startup_get(group: WorkerGroup, refs: list[Any], deadline: float, timeout_s: float, what: str) -> list[Any]:
    """ray.get within the start-up deadline; the group is shut down before any error propagates."""
    try:
        return call_with_deadline(refs, actor=WORKERS, op=what, timeout_s=deadline_left(deadline))
    except ActorCallTimeoutError as e:
        group.shutdown()
        raise WorkerError(
            f"vLLM workers did not {what} within generation.vllm.startup_timeout_s={timeout_s:.0f}"
        ) from e
    except ActorCallError as e:
        group.shutdown()
        raise WorkerError(f"vLLM worker failed to {what}: {e.cause}") from e
    except ray.exceptions.RayError as e:
        group.shutdown()
        raise WorkerError(f"vLLM worker failed to {what}: {e}") from e


def spawn_workers(
    model_dir: Path,
    gen: GenerationConfig,
    token_capture_cfg: dict,
    data_plane_cfg: dict | None,
    *,
    progress: Callable[[str], None] = print,
) -> PendingWorkers:
    """Build (or reuse) the venv, create the actors, open their ports and start their engines.

    Returns once every worker has a base URL (its routes answer 503 until `await_workers`), so
    the caller can point the Gym servers at it while vLLM loads. The venv build is not under the
    start-up deadline (it prints its own progress and is bounded by its installer); the rest is.
    """
    flavor = resolve_flavor(gen)  # GenerationSetupError here, before the venv build and the engines
    check_parsers_served(gen)
    nodes = alive_nodes(ray.get_runtime_context().get_node_id())
    # RayClusterError (placement) here, before the venv build and the engines.
    plan = plan_worker_placement(gen.num_workers, nodes, gen.vllm.placement, worker_num_gpus(gen, flavor))
    venv = ensure_venv(vllm_spec(flavor), progress=progress)
    deadline = time.monotonic() + gen.vllm.startup_timeout_s
    actor_cls = ray.remote(num_cpus=0)(VllmGenerationWorker)
    worker_cfg = resolved_generation(gen, flavor).model_dump()
    handles = [
        actor_cls.options(
            name=None,
            max_concurrency=1000,
            num_gpus=worker_num_gpus(gen, flavor),
            runtime_env={"py_executable": str(venv_python(venv)), "env_vars": worker_env(gen, flavor)},
            **node_affinity(plan[i]),
        ).remote(str(model_dir), worker_cfg, token_capture_cfg, data_plane_cfg, worker_index=i)
        for i in range(gen.num_workers)
    ]
    ips = {n.node_id: n.ip for n in nodes}
    where = ", ".join(f"{i}->{ips[n]}" if n is not None else f"{i}->ray" for i, n in enumerate(plan))
    progress(f"[generation] starting {len(handles)} vLLM worker(s) ({flavor}) from {model_dir}; "
             f"placement={gen.vllm.placement} ({where}), bind={gen.vllm.bind}")
    control_token = secrets.token_urlsafe(32)
    group = WorkerGroup(handles=handles, base_urls=[], call_timeout_s=gen.vllm.call_timeout_s,
                        control_token=control_token, planned_nodes=list(plan))
    # bind first: the ports must exist (answering 503) before anyone is pointed at them.
    base_urls = _startup_get(
        group, [h.bind.remote(control_token) for h in handles], deadline, gen.vllm.startup_timeout_s, "open their ports"
    )
    return PendingWorkers(
        group=group,
        base_urls=base_urls,
        engine_refs=[h.start_engine.remote() for h in handles],
        deadline=deadline,
        timeout_s=gen.vllm.startup_timeout_s,
    )


def await_workers(pending: PendingWorkers, *, progress: Callable[[str], None] = print) -> WorkerGroup:
    """Wait for the engines, then let every worker serve; the group is shut down on failure.

    When token capture is enabled the data plane must be running before this is called: `serve`
    attaches the staging sink before the first request is let through.
    """
    group = pending.group
    _startup_get(group, pending.engine_refs, pending.deadline, pending.timeout_s, "start their engines")
    group.base_urls = _startup_get(
        group, [h.serve.remote() for h in group.handles], pending.deadline, pending.timeout_s, "start serving"
    )
    progress(f"[generation] workers ready at {', '.join(group.base_urls)}")
    return group
