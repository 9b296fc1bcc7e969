"""ComponentWatch: deaths found once, named, by role; busy is not dead; real processes as probes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest

from nemo_rl.distributed.component_watch import (
    DATA_PLANE_KINDS,
    ChildProcess,
    Component,
    ComponentDeath,
    ComponentKind,
    ComponentWatch,
    Probe,
    Role,
    actor_children_probe,
    any_down,
    children_verdict,
    exit_description,
    process_probe,
)


class Switch:
    """A component whose death the test decides; counts how often it was probed."""

    def __init__(self, name: str, role: Role, hang: bool = False) -> None:
        self.name, self.role, self.hang = name, role, hang
        self.detail: str | None = None
        self.checks = 0

    async def check(self) -> str | None:
        self.checks += 1
        if self.hang:
            await asyncio.Event().wait()
        return self.detail

    def probe(self) -> Probe:
        return Probe(self.name, self.role, self.check)


def _watch(switches, announced=None, interval_s=0.01, probe_timeout_s=0.05) -> ComponentWatch:
    return ComponentWatch(lambda: [s.probe() for s in switches], interval_s=interval_s,
                          probe_timeout_s=probe_timeout_s,
                          on_death=(announced.append if announced is not None else lambda d: None))


@pytest.mark.parametrize("code, words", [
    (-9, "killed by SIGKILL"), (-15, "killed by SIGTERM"), (0, "exited with code 0"), (3, "exited with code 3"),
    (-99, "killed by signal 99"),
])
def test_exit_description(code: int, words: str) -> None:
    assert exit_description(code) == words


async def test_a_death_is_recorded_once_named_and_reported() -> None:
    gate, finalizer = Switch("gate", Role.ROLLOUT_PATH), Switch("finalizer_0", Role.OFF_PATH)
    announced: list[ComponentDeath] = []
    watch = _watch([gate, finalizer], announced)

    assert await watch.poll() == [] and watch.down() == {} and not watch.rollout_path_down.is_set()
    gate.detail = "Gym server policy_model (pid 12) killed by SIGKILL"
    (death,) = await watch.poll()
    again = await watch.poll()

    assert (death.name, death.role, death.detail) == ("gate", Role.ROLLOUT_PATH, gate.detail)
    assert death.describe() == "gate died: Gym server policy_model (pid 12) killed by SIGKILL"
    assert again == [] and announced == [death]
    assert gate.checks == 2  # a dead component is not probed again
    assert watch.down() == {"gate": gate.detail} and watch.rollout_path_down.is_set()
    assert watch.take_deaths() == [death] and watch.take_deaths() == []


async def test_an_off_path_death_does_not_take_the_rollout_path_down() -> None:
    finalizer = Switch("finalizer_0", Role.OFF_PATH)
    watch = _watch([finalizer])
    finalizer.detail = "finalizer worker 0 (Ray actor) is gone: killed"
    (death,) = await watch.poll()

    assert death.role is Role.OFF_PATH
    assert watch.down() == {} and not watch.rollout_path_down.is_set()
    assert list(watch.dead()) == ["finalizer_0"]


async def test_recovered_clears_the_component_and_the_event() -> None:
    gate, worker = Switch("gate", Role.ROLLOUT_PATH), Switch("vllm_worker_0", Role.ROLLOUT_PATH)
    watch = _watch([gate, worker])
    gate.detail = worker.detail = "gone"
    await watch.poll()
    watch.recovered("gate")
    still = watch.rollout_path_down.is_set()
    watch.recovered("vllm_worker_0")

    assert still and watch.down() == {} and not watch.rollout_path_down.is_set()
    gate.detail = worker.detail = None
    checks = gate.checks
    assert await watch.poll() == []  # probed again after recovery, alive
    assert gate.checks == checks + 1


PROBE_TIMEOUT_S = 0.05
SLACK_S = 5.0  # scheduling on a loaded, shared machine


async def test_a_probe_that_does_not_answer_is_busy_not_dead() -> None:
    worker = Switch("vllm_worker_0", Role.ROLLOUT_PATH, hang=True)
    watch = _watch([worker], probe_timeout_s=PROBE_TIMEOUT_S)
    began = time.monotonic()

    assert await watch.poll() == [] and watch.down() == {}
    assert time.monotonic() - began < PROBE_TIMEOUT_S + SLACK_S  # the probe never answers: its deadline ended the poll


async def test_watching_polls_in_the_background_until_the_body_ends() -> None:
    tq = Switch("tq_storage_unit_0", Role.ROLLOUT_PATH)
    watch = _watch([tq], interval_s=0.01)
    async with watch.watching():
        tq.detail = "TransferQueue storage_unit_0 (Ray actor) is gone: killed"
        await asyncio.wait_for(watch.rollout_path_down.wait(), 5.0)
    checks = tq.checks
    await asyncio.sleep(0.05)

    assert watch.down() == {"tq_storage_unit_0": tq.detail}
    assert tq.checks == checks  # the polling task stopped with the body


async def test_probes_are_asked_for_every_round() -> None:
    """A replaced component (a new finalizer actor, a restarted server) is watched as it is now."""
    first, second = Switch("finalizer_0", Role.OFF_PATH), Switch("finalizer_0_r1", Role.OFF_PATH)
    current = [first]
    watch = ComponentWatch(lambda: [s.probe() for s in current], interval_s=0.01, probe_timeout_s=0.05)
    await watch.poll()
    current = [second]
    await watch.poll()

    assert (first.checks, second.checks) == (1, 1)


def test_bad_cadence_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s=0 and probe_timeout_s=1 must be > 0"):
        ComponentWatch(lambda: [], interval_s=0, probe_timeout_s=1)


async def test_process_probe_names_a_killed_child_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        probe = process_probe("gate", Role.ROLLOUT_PATH, proc, "Gym server policy_model")
        alive = await probe.check()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        dead = await probe.check()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    assert alive is None
    assert dead == f"Gym server policy_model (pid {proc.pid}) killed by SIGKILL"


# --- processes a component started itself (vLLM's engine core under its worker actor) ---------


def test_children_verdict_names_every_dead_child_and_nothing_while_all_run() -> None:
    running, killed, exited = ChildProcess("EngineCore", 41, None), ChildProcess("EngineCore_DP1", 42, -9), \
        ChildProcess("EngineCore_DP2", 43, 0)

    assert children_verdict("vLLM worker 0 engine core", [running]) is None
    assert children_verdict("vLLM worker 0 engine core", []) is None
    assert children_verdict("vLLM worker 0 engine core", [running, killed, exited]) == (
        "vLLM worker 0 engine core EngineCore_DP1 (pid 42) killed by SIGKILL; "
        "vLLM worker 0 engine core EngineCore_DP2 (pid 43) exited with code 0")


def test_child_process_wire_round_trip_and_validation() -> None:
    child = ChildProcess("EngineCore", 7, -9)
    assert ChildProcess.from_wire(child.to_wire()) == child
    assert ChildProcess.from_wire({"name": "EngineCore", "pid": 7, "exitcode": None}).exitcode is None
    with pytest.raises(ValueError, match="a child process needs a name and a pid > 0, got name='' pid=7"):
        ChildProcess("", 7, None)


async def test_actor_children_probe_names_a_dead_child_and_leaves_a_gone_actor_to_its_own_probe() -> None:
    import ray

    answers: list = [[ChildProcess("EngineCore", 9, None).to_wire()], [ChildProcess("EngineCore", 9, -9).to_wire()],
                     ray.exceptions.RayActorError()]

    async def report():
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    probe = actor_children_probe("vllm_worker_0/engine_core", Role.ROLLOUT_PATH, report, "vLLM worker 0 engine core")
    assert (probe.name, probe.role) == ("vllm_worker_0/engine_core", Role.ROLLOUT_PATH)
    assert await probe.check() is None
    assert await probe.check() == "vLLM worker 0 engine core EngineCore (pid 9) killed by SIGKILL"
    assert await probe.check() is None  # the actor is gone: `vllm_worker_0`'s probe names that, once


@pytest.mark.parametrize("name", [
    "gate", "arith_agent", "vllm_worker_0", "vllm_worker_3/engine_core", "vllm_worker_1/engine_core_2",
    "tq_controller", "tq_storage_unit_0", "finalizer_2", "finalizer_1_r3",
])
def test_a_component_name_reads_back_as_the_same_name(name: str) -> None:
    assert Component.parse(name).name == name


def test_components_are_kinds_with_an_index_and_a_part() -> None:
    assert Component.parse("vllm_worker_3/engine_core") == Component(ComponentKind.VLLM_WORKER, 3, "engine_core")
    assert Component.engine_core(1).name == "vllm_worker_1/engine_core"
    assert Component.engine_core(1, 1, 2).name == "vllm_worker_1/engine_core_1"
    assert Component.parse("finalizer_1_r3") == Component(ComponentKind.FINALIZER, 1, generation=3)
    assert Component.parse("gate") == Component(ComponentKind.GYM_SERVER, server="gate")
    assert Component(ComponentKind.TQ_STORAGE_UNIT, 0).name == "tq_storage_unit_0"
    with pytest.raises(ValueError, match="takes an index"):
        Component(ComponentKind.VLLM_WORKER)
    with pytest.raises(ValueError, match="only a vLLM worker has a part"):
        Component(ComponentKind.FINALIZER, 0, "engine_core")
    with pytest.raises(ValueError, match="only a Gym server has a server name"):
        Component(ComponentKind.TQ_CONTROLLER, server="x")


def test_any_down_asks_about_kinds_not_prefixes() -> None:
    down = {"vllm_worker_0/engine_core": "killed", "gate": "exited"}
    assert any_down(down, ComponentKind.VLLM_WORKER)
    assert not any_down(down, *DATA_PLANE_KINDS)
    assert any_down(["tq_storage_unit_1"], *DATA_PLANE_KINDS)
    assert not any_down([], ComponentKind.GYM_SERVER)
