"""The loop's component-failure policy: masking, the abort verdict, recovery, metrics (pure parts)."""

from __future__ import annotations

import asyncio

import pytest

from nemo_rl.algorithms.grpo_health import (
    ComponentFailedError,
    check_abort,
    component_metrics,
    recover,
    step_deaths,
    unrecoverable,
    untrainable,
)
from nemo_rl.distributed.component_watch import ComponentWatch, Probe, Role
from nemo_rl.token_capture.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason, RowOrigin, TrainRow

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


class FakeEnv:
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


class FakeStack:
    def __init__(self, env: FakeEnv) -> None:
        self.env = env


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
    stack = FakeStack(FakeEnv(set()))
    down = {"gate": "a", "vllm_worker_0": "b", "tq_storage_unit_0": "c"}
    assert unrecoverable(stack, down) == {"vllm_worker_0": "b", "tq_storage_unit_0": "c"}


def test_recover_restarts_dead_gym_servers_and_clears_them() -> None:
    env = FakeEnv({"policy_model"})
    said: list[str] = []

    async def body():
        watch = ComponentWatch(env.probes, interval_s=0.01, probe_timeout_s=1.0)
        restarted = await recover(FakeStack(env), watch, FakePool(), said.append)
        return restarted, watch.down()

    restarted, down = asyncio.run(body())
    assert (restarted, down, env.restarted) == (1, {}, ["policy_model"])
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
