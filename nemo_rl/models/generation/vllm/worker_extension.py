"""Methods our engine adds to vLLM's worker (`worker_extension_cls`), called by `collective_rpc`.

`HostMemoryTrim.trim_host_memory()` runs in the engine-core process: a full garbage collection,
then glibc's `malloc_trim(0)`; True when pages were released, False when none were or the C
library has none (nothing is wrong then). `refit.reload_weights` calls it after every refit, inside the
reload deadline. Importable without vLLM (a plain mixin, resolved by qualified name in the
engine-core process).
Why: docs/design-docs/vllm-worker-capture.md, "Returning the engine core's heap".
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
