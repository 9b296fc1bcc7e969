"""vLLM's reload warning is kept out of the log only for layers no checkpoint can fill.

The filter's set comes from the served model's own modules (torch modules here, vLLM's in the
engine core): a class qualifies when every instance holds only non-persistent buffers. The
records are built as vLLM's layerwise reload builds them (same logger, same format and args).
"""

from __future__ import annotations

import logging

import torch

from nemo_rl.models.generation.vllm.worker_extension import (
    RELOAD_FAILED_FORMAT,
    RELOAD_LOGGER,
    CheckpointlessReloadFilter,
    checkpointless_layer_classes,
    install_reload_filter,
)


class RotaryEmbedding(torch.nn.Module):
    """Like vLLM's: its one tensor is a cache computed at build time, never in a checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.zeros(4, 2), persistent=False)


class Norm(torch.nn.Module):
    """A persistent buffer: a checkpoint carries it, so its failed load is a real failure."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(2))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding()
        self.proj = torch.nn.Linear(2, 2)
        self.norm = Norm()


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(Block(), Block())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_only_classes_whose_every_tensor_is_a_non_persistent_buffer_qualify() -> None:
    assert checkpointless_layer_classes(_model().modules()) == frozenset({"RotaryEmbedding"})


def test_a_class_name_shared_with_a_loadable_layer_does_not_qualify() -> None:
    class Impostor(torch.nn.Module):  # same name as the rotary layer, but with a weight
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

    Impostor.__name__ = "RotaryEmbedding"
    modules = [*_model().modules(), Impostor()]
    assert checkpointless_layer_classes(modules) == frozenset()


def test_the_rotary_warning_is_dropped_and_a_real_load_failure_reaches_the_log() -> None:
    logger = logging.getLogger(f"{RELOAD_LOGGER}.test")
    logger.propagate = False
    records = _Records()
    logger.addHandler(records)
    try:
        assert install_reload_filter(_model().modules(), logger) == frozenset({"RotaryEmbedding"})
        assert install_reload_filter(_model().modules(), logger) == frozenset({"RotaryEmbedding"})
        assert sum(isinstance(f, CheckpointlessReloadFilter) for f in logger.filters) == 1  # replaced, not stacked
        logger.warning(RELOAD_FAILED_FORMAT, "RotaryEmbedding")
        logger.warning(RELOAD_FAILED_FORMAT, "Linear")
        logger.warning(RELOAD_FAILED_FORMAT, "Norm")
        logger.warning("%s: Delayed processing", "RotaryEmbedding")
    finally:
        logger.removeHandler(records)
    assert records.lines == [
        "Linear: Failed to load weights",
        "Norm: Failed to load weights",
        "RotaryEmbedding: Delayed processing",
    ]
