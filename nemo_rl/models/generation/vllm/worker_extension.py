"""Methods our engine adds to vLLM's worker (`worker_extension_cls`), called by `collective_rpc`.

Contract:
- `HostMemoryTrim.trim_host_memory()` runs in the engine-core process: a full garbage
  collection, then glibc's `malloc_trim(0)`, which returns freed heap pages to the OS. Returns
  True when pages were released, False when none were (or the C library has no `malloc_trim`,
  e.g. musl: nothing to call, and nothing is wrong).
- Why: on the CPU engine, the heap of the engine core grows with every step of generations and
  refits while the memory is free but not returned (measured: ~10 MiB per step of 64 rollouts
  without the trim, ~1-4 MiB with it, decelerating). `VllmEngine` calls it after every refit,
  inside the reload deadline.
- Importable without vLLM (it is a plain mixin); vLLM resolves it by qualified name in the
  engine-core process, whose `sys.path` includes this repository (`PYTHONPATH` of the worker).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

TRIM_METHOD = "trim_host_memory"
QUALNAME = "nemo_rl.models.generation.vllm.worker_extension.HostMemoryTrim"


def trim_process_heap() -> bool:
    """gc.collect(), then malloc_trim(0) where the C library has it; True if pages were released."""
    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


class HostMemoryTrim:
    """Mixed into vLLM's worker class by `worker_extension_cls`."""

    def trim_host_memory(self) -> bool:
        return trim_process_heap()
