"""Runs in the vLLM worker's venv: start a real engine as the worker does, then reload twice.

Usage: python reload_warning_probe.py MODEL_DIR FULL_WEIGHTS_DIR PARTIAL_WEIGHTS_DIR
Between the steps it writes marker lines to stdout, where vLLM's log lines (the engine core's too) land,
so the caller can tell which reload logged what. Exit 0 when both reloads returned.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from nemo_rl.models.generation.vllm.config import VllmConfig
from nemo_rl.models.generation.vllm.lifecycle import start_engine, wait_ready
from nemo_rl.models.generation.vllm.refit import reload_weights

MARK = "RELOAD-PROBE-MARK"


def mark(what: str) -> None:
    print(f"{MARK} {what}", flush=True)


async def main(model_dir: Path, full: Path, partial: Path) -> None:
    cfg = VllmConfig(flavor="cpu")
    _, engine = await start_engine(model_dir, cfg)
    try:
        await wait_ready(engine, cfg.startup_timeout_s)
        mark("started")
        await reload_weights(engine, full, 1)
        mark("full reloaded")
        await reload_weights(engine, partial, 2)
        mark("partial reloaded")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*(Path(a) for a in sys.argv[1:4])))
