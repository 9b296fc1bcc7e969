"""The engine-core processes a worker reports, read as vLLM v1 lays them out, with real processes.

`engine_core_processes` reads `engine.engine_core.resources.engine_manager.processes` (vLLM's
`CoreEngineProcManager` holds `multiprocessing` processes there); the structure around real
child processes is built here, so what is checked is what the parent sees of a real SIGKILL.
The real engine core under a real worker is killed in `tests/integration/test_chaos.py`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from types import SimpleNamespace

import pytest

from nemo_rl.distributed.component_watch import ChildProcess, children_verdict
from nemo_rl.models.generation.vllm.diagnostics import engine_core_processes
from nemo_rl.models.generation.vllm.errors import EngineError

WHAT = "vLLM worker 0 engine core"


def _sleep() -> None:
    time.sleep(60)


def _async_llm(processes) -> SimpleNamespace:
    manager = SimpleNamespace(processes=processes)
    return SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager)))


def _wait_exit(proc, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while proc.exitcode is None and time.monotonic() < end:
        time.sleep(0.02)


def test_a_sigkilled_engine_core_is_seen_by_its_parent_and_named() -> None:
    proc = multiprocessing.get_context("spawn").Process(target=_sleep, name="EngineCore", daemon=True)
    proc.start()
    try:
        alive = engine_core_processes(_async_llm([proc]))
        os.kill(proc.pid, signal.SIGKILL)
        _wait_exit(proc)
        dead = engine_core_processes(_async_llm([proc]))
    finally:
        if proc.exitcode is None:
            proc.kill()
        proc.join(timeout=30)

    assert alive == [ChildProcess("EngineCore", proc.pid, None)]
    assert children_verdict(WHAT, alive) is None
    assert dead == [ChildProcess("EngineCore", proc.pid, -9)]
    assert children_verdict(WHAT, dead) == f"vLLM worker 0 engine core EngineCore (pid {proc.pid}) killed by SIGKILL"


def test_an_in_process_engine_core_has_no_process_to_watch() -> None:
    llm = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=None)))
    assert engine_core_processes(llm) == []


def test_an_engine_laid_out_otherwise_is_a_named_error_not_an_empty_list() -> None:
    with pytest.raises(EngineError, match=r"cannot find the vLLM engine-core processes \(engine.engine_core.resources"):
        engine_core_processes(SimpleNamespace(engine_core=SimpleNamespace()))
    with pytest.raises(EngineError, match="the vLLM engine manager SimpleNamespace lists no `processes`"):
        engine_core_processes(SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(
            engine_manager=SimpleNamespace()))))
