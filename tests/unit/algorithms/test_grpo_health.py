"""The loop's component-failure policy: masking, the abort verdict, recovery, metrics (pure parts)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nemo_rl.algorithms.grpo_health import (
    ComponentFailedError,
    build_watch,
    check_abort,
    component_metrics,
    recover,
    refit_deaths,
    refit_failure_error,
    step_deaths,
    unrecoverable,
    untrainable,
)
from nemo_rl.algorithms.grpo_single_controller import refit_or_name_deaths
from nemo_rl.data.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason, RowOrigin, TrainRow
from nemo_rl.distributed.component_watch import ChildProcess, ComponentWatch, Probe, Role
from nemo_rl.models.generation.vllm.client import WorkerGroup
from nemo_rl.models.generation.vllm.errors import WorkerError
from nemo_rl.token_capture.config import TokenCaptureConfig

R = PlaceholderReason


def _kept(rollout_id: str, sample_index: int) -> KeptRollout:
    row = TrainRow(
        rollout_id=rollout_id, group_index=0, sample_index=sample_index, token_ids=(1, 2, 3),
        token_mask=(0.0, 1.0, 1.0), generation_logprobs=(0.0, -0.1, -0.2), reward=1.0, prompt_len=1,
        model_call_ids=("c0",), weight_versions=(0,), token_in_calls=0, text_root_calls=1,
        terminal_selection="response_id", origin=RowOrigin.CAPTURE, call_spans=((0, 3),),
    )
    return KeptRollout(rollout_id, 0, sample_index, (row,), 1.0, "response_id")


def test_untrainable_masks_every_kept_rollout_naming_the_dead_components() -> None:
    failed = Placeholder("r-1", 0, 1, R.RUN_FAILED, "agent exploded")
    groups = [GroupResult(0, (_kept("r-0", 0), failed))]
    (masked,) = untrainable(groups, {"vllm_worker_0": "vLLM worker 0 (Ray actor) is gone: killed"})

    first = masked.entries[0]
    assert (first.reason, first.detail, first.reward, first.terminal_selection) == (
        R.COMPONENT_FAILED, "step not trained: vllm_worker_0 died: vLLM worker 0 (Ray actor) is gone: killed", 1.0,
        "response_id")
    assert masked.entries[1] is failed and masked.n == 2 and masked.kept == ()


def test_untrainable_without_a_dead_component_changes_nothing() -> None:
    groups = [GroupResult(0, (_kept("r-0", 0),))]
    assert untrainable(groups, {}) == groups


def test_check_abort_names_every_death_only_under_abort() -> None:
    deaths = {"gate": "Gym server policy_model (pid 7) killed by SIGKILL", "finalizer_0": "gone"}
    check_abort("continue", deaths, 2)
    check_abort("abort", {}, 2)
    with pytest.raises(ComponentFailedError) as caught:
        check_abort("abort", deaths, 2)

    message = str(caught.value)
    assert message.startswith("step 2: finalizer_0 died: gone; gate died: Gym server policy_model (pid 7) killed by SIGKILL.")
    assert "token_capture.on_component_failure=abort" in message


def test_component_metrics() -> None:
    assert component_metrics({"gate": "x"}, {}, 1, 2) == {
        "component/deaths": 1.0, "component/down": 0.0, "component/restarts": 1.0, "finalize/replaced_workers": 2.0}


class FakeServers:
    """The Gym servers' lifecycle an environment holds (`NemoGymEnvironment.servers`)."""

    def __init__(self, dead_servers: set[str]) -> None:
        self.dead = set(dead_servers)
        self.restarted: list[str] = []

    def server_for(self, component: str) -> str | None:
        return {"gate": "policy_model", "arith_agent": "arith_agent"}.get(component)

    def _probe(self, server: str) -> Probe:
        async def check():
            return f"{server} killed" if server in self.dead else None
        return Probe("gate" if server == "policy_model" else server, Role.ROLLOUT_PATH, check)

    def probes(self) -> list[Probe]:
        return [self._probe(server) for server in ("policy_model", "arith_agent")]

    async def restart(self, server: str) -> float:
        self.dead.discard(server)
        self.restarted.append(server)
        return 0.5


class FakeEnv:
    def __init__(self, servers: FakeServers) -> None:
        self.servers = servers


class FakeStack:
    def __init__(self, servers: FakeServers, workers: WorkerGroup | None = None) -> None:
        self.env = FakeEnv(servers)
        self.workers = workers
        self.data_plane = None  # the legacy path has no TransferQueue


class FakePool:
    def __init__(self) -> None:
        self.marked: list[str] = []
        self.deaths = {"finalizer_0": "finalizer worker 0 (Ray actor) died: boom"}

    def mark_dead(self, name: str) -> bool:
        self.marked.append(name)
        return name.startswith("finalizer_")

    def take_deaths(self) -> dict[str, str]:
        deaths, self.deaths = self.deaths, {}
        return deaths


def test_unrecoverable_is_every_dead_component_but_the_gym_servers() -> None:
    stack = FakeStack(FakeServers(set()))
    down = {"gate": "a", "vllm_worker_0": "b", "tq_storage_unit_0": "c"}
    assert unrecoverable(stack, down) == {"vllm_worker_0": "b", "tq_storage_unit_0": "c"}


def test_recover_restarts_dead_gym_servers_and_clears_them() -> None:
    servers = FakeServers({"policy_model"})
    said: list[str] = []

    async def body():
        watch = ComponentWatch(servers.probes, interval_s=0.01, probe_timeout_s=1.0)
        restarted = await recover(FakeStack(servers), watch, FakePool(), said.append)
        return restarted, watch.down()

    restarted, down = asyncio.run(body())
    assert (restarted, down, servers.restarted) == (1, {}, ["policy_model"])
    assert said == ["[health] restarted gate (Gym server policy_model) on its port in 0.5s"]


def test_step_deaths_merges_the_watch_and_the_pool() -> None:
    async def body():
        async def dead():
            return "Gym server policy_model (pid 3) killed by SIGKILL"
        watch = ComponentWatch(lambda: [Probe("gate", Role.ROLLOUT_PATH, dead)], interval_s=0.01, probe_timeout_s=1.0)
        await watch.poll()
        return step_deaths(watch, FakePool(), said.append)

    said: list[str] = []
    assert asyncio.run(body()) == {
        "gate": "Gym server policy_model (pid 3) killed by SIGKILL",
        "finalizer_0": "finalizer worker 0 (Ray actor) died: boom",
    }
    # The gate was announced by the watch when found; the pool's find is announced here.
    assert said == ["[health] finalizer_0 died: finalizer worker 0 (Ray actor) died: boom; the finalizer pool replaced it"]


# --- the legacy path's watch and the refit path (a worker's engine core that died) -------------

CORE_DEATH = "vLLM worker 0 engine core EngineCore (pid 77) killed by SIGKILL"


class FakeRemote:
    def __init__(self, answer) -> None:
        self.answer = answer

    def remote(self):
        async def call():
            return self.answer()
        return call()


class FakeWorkerHandle:
    """What `WorkerGroup.probes` calls on a worker actor: `__ray_ready__` and `engine_core_processes`."""

    def __init__(self) -> None:
        self.core_exitcode: int | None = None
        self.__ray_ready__ = FakeRemote(lambda: True)
        self.engine_core_processes = FakeRemote(lambda: [ChildProcess("EngineCore", 77, self.core_exitcode).to_wire()])


def _group(handle: FakeWorkerHandle) -> WorkerGroup:
    return WorkerGroup(handles=[handle], base_urls=["http://127.0.0.1:1/v1"], call_timeout_s=5.0)


def test_the_legacy_watch_holds_the_gym_servers_the_worker_and_its_engine_core() -> None:
    handle = FakeWorkerHandle()
    said: list[str] = []
    cfg = TokenCaptureConfig(enabled=False)

    async def body():
        watch = build_watch(FakeStack(FakeServers(set()), _group(handle)), None, cfg, said.append)
        names = [p.name for p in watch._probes()]
        alive = await watch.poll()
        handle.core_exitcode = -9
        (death,) = await watch.poll()
        return names, alive, death, watch.down()

    names, alive, death, down = asyncio.run(body())
    assert names == ["gate", "arith_agent", "vllm_worker_0", "vllm_worker_0/engine_core"]
    assert alive == []
    assert (death.name, death.role, death.detail) == ("vllm_worker_0/engine_core", Role.ROLLOUT_PATH, CORE_DEATH)
    assert down == {"vllm_worker_0/engine_core": CORE_DEATH}
    assert said == [f"[health] vllm_worker_0/engine_core died: {CORE_DEATH}; the run stops at the end of this step "
                    "(token_capture.on_component_failure=abort)"]


def test_refit_deaths_runs_a_round_now() -> None:
    handle = FakeWorkerHandle()
    handle.core_exitcode = -9

    async def body():
        watch = ComponentWatch(_group(handle).probes, interval_s=60.0, probe_timeout_s=1.0)
        return await refit_deaths(watch), await refit_deaths(None)

    assert asyncio.run(body()) == ({"vllm_worker_0/engine_core": CORE_DEATH}, {})


def test_refit_failure_error_names_the_dead_and_says_the_step_was_trained() -> None:
    error = refit_failure_error({"vllm_worker_0/engine_core": CORE_DEATH}, 3)
    assert str(error) == (
        f"step 3: refit failed: vllm_worker_0/engine_core died: {CORE_DEATH}. The step was trained, the engines were "
        "not refit; token_capture.on_component_failure=abort stops the run (resume from the last checkpoint)")


class FailingRefitWorkers:
    def update_weights(self, weights_dir, version):
        raise WorkerError(f"vLLM worker 0: refit to version {version} from {weights_dir} failed: EngineFailedError: "
                          "the vLLM engine is failed: ... EngineDeadError: EngineCore encountered an issue")


class FakeRun:
    """The parts of `GRPORun` the refit path touches; the refit itself fails as a dead engine core's does."""

    def __init__(self, tmp_path, policy: str, handle: FakeWorkerHandle) -> None:
        self.cfg = SimpleNamespace(token_capture=TokenCaptureConfig(on_component_failure=policy))
        self.stack = SimpleNamespace(workers=FailingRefitWorkers())
        self.policy = SimpleNamespace(export_weights=lambda folder: folder)
        self.weights_root = tmp_path
        self.probe = [5, 6, 2]
        self.watch = ComponentWatch(_group(handle).probes, interval_s=60.0, probe_timeout_s=1.0)
        self.pool = None
        self.said: list[str] = []
        self.progress = self.said.append
        self.logged: list[tuple[int, dict]] = []
        self.logger = SimpleNamespace(log=lambda step, metrics: self.logged.append((step, dict(metrics))))
        self.served_version = 1


def test_a_refit_failed_by_a_dead_engine_core_is_that_death_under_abort(tmp_path) -> None:
    handle = FakeWorkerHandle()
    handle.core_exitcode = -9
    run = FakeRun(tmp_path, "abort", handle)
    metrics = {"component/deaths": 0.0, "component/down": 0.0}
    with pytest.raises(ComponentFailedError) as caught:
        asyncio.run(refit_or_name_deaths(run, 2, metrics))

    assert str(caught.value).startswith(f"step 2: refit failed: vllm_worker_0/engine_core died: {CORE_DEATH}.")
    assert isinstance(caught.value.__cause__, WorkerError) and "EngineDeadError" in str(caught.value.__cause__)
    # The step that stops the run keeps its metrics line, the death counted.
    assert run.logged == [(2, {"component/deaths": 1.0, "component/down": 1.0})]


def test_a_refit_failed_by_a_dead_engine_core_is_skipped_under_continue(tmp_path) -> None:
    handle = FakeWorkerHandle()
    handle.core_exitcode = -9
    run = FakeRun(tmp_path, "continue", handle)
    metrics = {"component/deaths": 0.0}
    assert asyncio.run(refit_or_name_deaths(run, 2, metrics)) == {"refit/skipped": 1.0}

    assert metrics == {"component/deaths": 1.0, "component/down": 1.0} and run.logged == []
    assert run.said[-1] == (
        f"[step 2] refit skipped: vllm_worker_0/engine_core died: {CORE_DEATH}; the engines keep weight version 1 "
        "and the next steps are masked while it stays dead (token_capture.on_component_failure=continue)")
    assert run.watch.down() == {"vllm_worker_0/engine_core": CORE_DEATH}  # the next step's rollouts end at once


def test_a_refit_failure_with_every_component_alive_propagates_unchanged(tmp_path) -> None:
    run = FakeRun(tmp_path, "abort", FakeWorkerHandle())
    with pytest.raises(WorkerError, match="refit to version 2 .* failed: EngineFailedError"):
        asyncio.run(refit_or_name_deaths(run, 2, {}))
    assert run.logged == []
