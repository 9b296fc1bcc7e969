"""Methods our engine adds to vLLM's worker (`worker_extension_cls`), called by `collective_rpc`.

`HostMemoryTrim.trim_host_memory()` runs in the engine-core process: a full garbage collection,
then glibc's `malloc_trim(0)`; True when pages were released, False when none were or the C
library has none (nothing is wrong then). `refit.reload_weights` calls it after every refit, inside the
reload deadline. `HostMemoryTrim.quiet_checkpointless_reloads()` runs once per engine start: it keeps
vLLM's "<Layer>: Failed to load weights" reload warning out of the log for the layer classes of the
served model that hold no tensor a checkpoint can carry (every own tensor a non-persistent buffer,
e.g. a rotary embedding's cos/sin cache), and only for those; any other layer's warning, a real load
failure, still reaches the log. Importable without vLLM (a plain mixin, resolved by qualified name
in the engine-core process).
Why: docs/design-docs/vllm-worker-capture.md, "Returning the engine core's heap" and "Refit".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Iterable
from typing import Any

TRIM_METHOD = "trim_host_memory"
QUIET_METHOD = "quiet_checkpointless_reloads"
QUALNAME = "nemo_rl.models.generation.vllm.worker_extension.HostMemoryTrim"
# vLLM's layerwise reload logs this (logger, format) pair for a layer of which no weight was loaded.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_FAILED_FORMAT = "%s: Failed to load weights"


def trim_process_heap() -> bool:
    """gc.collect(), then malloc_trim(0) where the C library has it; True if pages were released."""
    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def holds_no_checkpoint_tensor(module: Any) -> bool:
    """True when `module` owns tensors and none of them is in its state dict (non-persistent buffers only)."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    own += [name for name, _ in module.named_buffers(recurse=False)]
    persistent_own = [key for key in module.state_dict(keep_vars=True) if "." not in key]
    return bool(own) and not persistent_own


def checkpointless_layer_classes(modules: Iterable[Any]) -> frozenset[str]:
    """Class names every instance of which holds no checkpoint tensor (a name shared with any other layer is out)."""
    benign: set[str] = set()
    loadable: set[str] = set()
    for module in modules:
        name = type(module).__name__
        if holds_no_checkpoint_tensor(module):
            benign.add(name)
        elif any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            loadable.add(name)
    return frozenset(benign - loadable)


class CheckpointlessReloadFilter(logging.Filter):
    """Drops the reload-failed record of a layer class in `layer_classes`; passes every other record."""

    def __init__(self, layer_classes: frozenset[str]) -> None:
        super().__init__()
        self.layer_classes = layer_classes

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == RELOAD_FAILED_FORMAT and len(args) == 1 and args[0] in self.layer_classes)


def install_reload_filter(modules: Iterable[Any], logger: logging.Logger | None = None) -> frozenset[str]:
    """Install (or replace) the filter for `modules` on vLLM's reload logger; returns the quieted class names."""
    target = logger if logger is not None else logging.getLogger(RELOAD_LOGGER)
    for old in [f for f in target.filters if isinstance(f, CheckpointlessReloadFilter)]:
        target.removeFilter(old)
    classes = checkpointless_layer_classes(modules)
    target.addFilter(CheckpointlessReloadFilter(classes))
    return classes


class HostMemoryTrim:
    """Mixed into vLLM's worker class by `worker_extension_cls` (`get_model` is vLLM's worker method)."""

    def trim_host_memory(self) -> bool:
        return trim_process_heap()

    def quiet_checkpointless_reloads(self) -> list[str]:
        return sorted(install_reload_filter(self.get_model().modules()))  # type: ignore[attr-defined]
