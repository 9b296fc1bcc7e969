"""The async loop's checkpoint: the prompt ledger in `trainer_state.json` (format 2) and its resume.

Round trip of any ledger the ops of the prompt-ledger property test can reach (through the file,
then `ledger_to_resume`): the restored ledger re-dispatches exactly the drawn, unconsumed prompts
first, each under a generation its checkpoint never issued, and the rollout ids of a new launch
are fresh because the run id is. Format-1 files (the synchronous loop's) read and resume as before;
a snapshot that contradicts its state or the recipe is refused, naming field, value and fix. The
checkpoint hook snapshots on the event loop, before the groups still running change the ledger.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from examples.arith.gym_task import TASK as ARITH_TASK
from nemo_rl.algorithms.async_config import AsyncRolloutsConfig
from nemo_rl.algorithms.grpo_async import ledger_for
from nemo_rl.algorithms.grpo_checkpoint import (
    TRAINER_STATE_FILE,
    TrainerState,
    ledger_to_resume,
    read_trainer_state,
    write_trainer_state,
)
from nemo_rl.algorithms.grpo_single_controller import log_and_checkpoint
from nemo_rl.environments.gym_client import TaskPromptSource
from nemo_rl.environments.task import RowSampling
from nemo_rl.experience.prompt_queue import LedgerSnapshot, PendingState, PromptLedger
from nemo_rl.utils.checkpoint import CheckpointError, CheckpointingConfig, capture_rng_states
from tests.unit.experience.test_prompt_queue import OPS, Simulation, run_step

RNG = capture_rng_states()
DIGEST = "cd" * 32
FORMAT_1_KEYS = ["engine_probe", "format", "masked_streak", "num_prompts_per_step", "optimizer_fingerprint",
                 "policy_fingerprint", "policy_steps_taken", "prompt_batch_digest", "rng", "seed", "step",
                 "weight_version"]


def _state(step: int, p: int = 2, ledger: LedgerSnapshot | None = None, **changes) -> TrainerState:
    fields = dict(step=step, weight_version=step, masked_streak=0, seed=7, num_prompts_per_step=p,
                  prompt_batch_digest=DIGEST, policy_fingerprint=DIGEST, optimizer_fingerprint=DIGEST,
                  policy_steps_taken=step, engine_probe=(-0.5,), rng=RNG,
                  format=1 if ledger is None else 2, prompt_ledger=ledger)
    return TrainerState(**{**fields, **changes})


def _ledger_with_groups_in_flight() -> PromptLedger:
    """P=2, cap 6, step 2 committed: p4 running, p5 finished, p6 dropped stale (queued, 1 dispatch)."""
    ledger = PromptLedger(2, 6)
    run_step(ledger)
    run_step(ledger)
    running, finished, dropped = ledger.dispatch(), ledger.dispatch(), ledger.dispatch()
    ledger.finish(finished)
    ledger.finish(dropped)
    ledger.drop_stale(dropped)
    assert running.position == 4
    return ledger


@settings(max_examples=150, deadline=None)
@given(per_step=st.integers(1, 3), extra=st.integers(0, 4),
       ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 63)), max_size=60))
def test_any_ledger_round_trips_through_the_file_and_resumes_its_prompts_first(tmp_path_factory, per_step, extra, ops):
    sim = Simulation(per_step, per_step + extra)
    for op, arg in ops:
        sim.do(op, arg)
    if sim.ledger.step == 0:
        sim.drain(1)  # a checkpoint follows a committed step
    ledger = sim.ledger
    snapshot = ledger.snapshot()
    folder = tmp_path_factory.mktemp("ckpt")
    write_trainer_state(folder, _state(ledger.step, per_step, snapshot))
    state = read_trainer_state(folder)
    assert state.format == 2 and state.prompt_ledger == snapshot

    restored = ledger_to_resume(state, per_step, per_step + extra)
    pending = [p.position for p in snapshot.pending]
    assert (restored.step, restored.in_flight, restored.queued) == (ledger.step, 0, tuple(pending))
    assert restored.snapshot().model_dump(exclude={"pending"}) == snapshot.model_dump(exclude={"pending"})
    # every pending prompt is queued now, with the dispatch count it had
    assert [(p.position, p.generations) for p in restored.snapshot().pending] == [
        (p.position, p.generations) for p in snapshot.pending]

    issued_before = {(t.position, t.generation) for t in ledger.live()}  # and every earlier generation
    old_ids = set(sim.rollout_ids)
    redispatched = []
    while restored.queued:  # dispatch what the cap allows, finish it, commit steps to free the cap
        while restored.queued and restored.can_dispatch():
            redispatched.append(restored.dispatch())
        for ticket in restored.live(PendingState.IN_FLIGHT):
            restored.finish(ticket)
        if restored.queued and (head := restored.head()) is not None:
            restored.commit_step(restored.step + 1, head)
    # the drawn, unconsumed prompts come first, in position order, before any new draw ...
    assert [t.position for t in redispatched] == pending
    by_position = {p.position: p.generations for p in snapshot.pending}
    for ticket in redispatched:
        # ... under the generation after the last one the checkpoint knows of: never one issued before it
        assert ticket.generation == by_position[ticket.position]
        assert all(g < ticket.generation for (q, g) in issued_before if q == ticket.position)
        # and the new launch's run id keeps their rollout ids apart from every id ever issued
        assert old_ids.isdisjoint(ticket.rollout_ids(f"run{sim.launch + 1}", sim.n))


def test_the_new_run_id_is_what_keeps_rollout_ids_fresh_after_the_checkpoint():
    ledger = _ledger_with_groups_in_flight()
    snapshot = ledger.snapshot()
    # Dispatched after the checkpoint, then the process is killed: the dropped p6 again, a new p7.
    after = [ledger.dispatch(), ledger.dispatch()]
    assert [t.key for t in after] == ["p6.g1", "p7.g0"]
    restored = ledger_to_resume(_state(2, ledger=snapshot), 2, 6)
    again = [restored.dispatch() for _ in range(4)]
    assert [t.key for t in again] == ["p4.g1", "p5.g1", "p6.g1", "p7.g0"]
    # p4 and p5, in flight at the checkpoint, get a generation it never issued; p6 and p7 repeat the
    # killed process's (the checkpoint never saw those dispatches) ...
    assert again[2:] == after
    # ... so their rollout ids differ only because setup mints a fresh run id per launch
    for old, new in zip(after, again[2:]):
        assert set(old.rollout_ids("grpo-aaaa", 4)).isdisjoint(new.rollout_ids("grpo-bbbb", 4))
        assert old.rollout_ids("grpo-aaaa", 4) == new.rollout_ids("grpo-aaaa", 4)


def test_a_format_1_checkpoint_is_written_as_before_and_resumes_with_nothing_in_flight(tmp_path: Path):
    state = _state(3)
    write_trainer_state(tmp_path, state)
    saved = json.loads((tmp_path / TRAINER_STATE_FILE).read_text())
    assert sorted(saved) == FORMAT_1_KEYS and saved["format"] == 1
    assert read_trainer_state(tmp_path) == state
    ledger = ledger_to_resume(state, 2, 4)
    assert (ledger.step, ledger.next_position, ledger.queued, ledger.in_flight, ledger.max_in_flight) == (3, 6, (), 0, 4)
    fresh = ledger_to_resume(None, 2, 4)
    assert (fresh.step, fresh.next_position, fresh.max_in_flight) == (0, 0, 4)


def _resumed_run(state: TrainerState | None, p: int = 2, cap: int | None = 4):
    grpo = SimpleNamespace(num_prompts_per_step=p, async_rollouts=AsyncRolloutsConfig(
        enabled=True, max_trajectory_age_steps=1, max_in_flight_groups=cap))
    said: list[str] = []
    return SimpleNamespace(cfg=SimpleNamespace(grpo=grpo), resumed_from=state, progress=said.append, said=said)


def test_ledger_for_restores_the_snapshot_and_says_what_it_re_dispatches():
    snapshot = _ledger_with_groups_in_flight().snapshot()
    run = _resumed_run(_state(2, ledger=snapshot), cap=6)
    ledger = ledger_for(run)
    assert (ledger.step, ledger.queued, ledger.max_in_flight) == (2, (4, 5, 6), 6)
    assert run.said == ["[async] restored the prompt ledger of step 2: positions [4, 5, 6] are dispatched first (in "
                        "flight at the checkpoint, as position.new generation: ['p4.g1', 'p5.g1']), then new draws "
                        "from 7"]
    run = _resumed_run(_state(3))
    assert ledger_for(run).next_position == 6
    assert run.said == ["[async] the checkpoint of step 3 holds no prompt ledger (format 1, the synchronous loop's: "
                        "nothing was in flight); drawing from position 6"]
    run = _resumed_run(None)
    assert (ledger_for(run).next_position, run.said) == (0, [])


def test_a_state_whose_snapshot_contradicts_it_is_refused_naming_the_field():
    snapshot = _ledger_with_groups_in_flight().snapshot()  # step 2, groups_per_step 2
    with pytest.raises(ValidationError, match="format=2 with prompt_ledger absent"):
        _state(2, format=2)
    with pytest.raises(ValidationError, match="format=1 with prompt_ledger set"):
        _state(2, ledger=snapshot, format=1)
    with pytest.raises(ValidationError, match=r"prompt_ledger.step=2 but step=3"):
        _state(3, ledger=snapshot)
    with pytest.raises(ValidationError, match=r"prompt_ledger.groups_per_step=2 but num_prompts_per_step=3"):
        _state(2, p=3, ledger=snapshot)
    with pytest.raises(ValidationError, match="Input should be 1 or 2"):
        _state(2, format=3)


def test_a_damaged_snapshot_in_the_file_is_a_corrupt_checkpoint(tmp_path: Path):
    write_trainer_state(tmp_path, _state(2, ledger=_ledger_with_groups_in_flight().snapshot()))
    path = tmp_path / TRAINER_STATE_FILE
    good = json.loads(path.read_text())
    for damage, says in (
        (lambda d: d.update(step=3), r"prompt_ledger.step=2 but step=3"),
        (lambda d: d["prompt_ledger"]["pending"].pop(1), r"pending positions \[4, 6\] must be exactly 4..6"),
        (lambda d: d["prompt_ledger"].update(surprise=1), r"prompt_ledger.surprise\s+Extra inputs are not permitted"),
        (lambda d: d.pop("prompt_ledger"), "format=2 with prompt_ledger absent"),
    ):
        data = json.loads(json.dumps(good))
        damage(data)
        path.write_text(json.dumps(data))
        with pytest.raises(CheckpointError, match=f"(?s)not a valid TrainerState: .*{says}.*fix: delete") as raised:
            read_trainer_state(tmp_path)
        assert raised.value.kind == "corrupt"


def test_a_snapshot_that_consumed_undrawn_prompts_is_refused():
    with pytest.raises(ValidationError, match=r"next_draw=3 < 4 \(= step 2 x groups_per_step 2\)"):
        LedgerSnapshot(groups_per_step=2, step=2, next_draw=3, pending=())


def test_a_snapshot_of_another_batch_size_is_refused_for_the_recipe_with_the_fix():
    state = _state(2, ledger=_ledger_with_groups_in_flight().snapshot())
    with pytest.raises(CheckpointError, match=(
            r"grpo.num_prompts_per_step=3 but the prompt ledger of the checkpoint of step 2 has groups_per_step=2: "
            r"its positions would name other prompts \(fix: set grpo.num_prompts_per_step=2, or start a new run "
            r"without checkpointing.resume\)")) as raised:
        ledger_to_resume(state, 3, 6)
    assert raised.value.kind == "mismatch"
    with pytest.raises(CheckpointError, match="grpo.num_prompts_per_step=1 .* groups_per_step=2") as raised:
        ledger_to_resume(_state(2), 1, 1)  # format 1 alike: its positions are the step's
    assert raised.value.kind == "mismatch"


class _Policy:
    """Saves a file; blocks in the save (the checkpoint's thread) until the test lets it go."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.saving = threading.Event()  # set once the save runs

    def save_state(self, folder: Path):
        folder.mkdir()
        (folder / "weights").write_bytes(b"w")
        self.saving.set()
        if not self.release.wait(timeout=30):
            raise TimeoutError("the test never released the save")
        return SimpleNamespace(policy_fingerprint=DIGEST, optimizer_fingerprint=DIGEST, steps_taken=2)


async def test_the_checkpoint_hook_snapshots_the_ledger_on_the_loop_before_the_save_runs(tmp_path: Path):
    sampling = RowSampling(temperature=1.0, top_p=1.0, max_output_tokens=8)
    release = threading.Event()
    logged: list[int] = []
    run = SimpleNamespace(
        cfg=SimpleNamespace(checkpointing=CheckpointingConfig(enabled=True, save_period=1, checkpoint_dir=str(tmp_path)),
                            grpo=SimpleNamespace(seed=7, num_prompts_per_step=2, max_num_steps=5)),
        policy=_Policy(release), prompts=TaskPromptSource(ARITH_TASK, 7, sampling), served_version=2, masked_streak=0,
        previous_engine_probe=[-0.5], progress=lambda _: None, logger=SimpleNamespace(log=lambda s, m: logged.append(s)),
    )
    ledger = _ledger_with_groups_in_flight()
    before = ledger.snapshot()

    async def group_comes_back_during_the_save():
        assert await asyncio.to_thread(run.policy.saving.wait, 30), "the save never ran"
        ledger.finish(ledger.live(PendingState.IN_FLIGHT)[0])  # p4 finishes, and p6 is dispatched again
        ledger.dispatch()
        release.set()

    racer = asyncio.create_task(group_comes_back_during_the_save())
    await log_and_checkpoint(run, 2, {"x": 1.0}, 2, ledger)
    await racer
    state = read_trainer_state(tmp_path / "step_2")
    assert logged == [2] and state.format == 2 and state.prompt_ledger == before
    assert [(p.position, p.state) for p in state.prompt_ledger.pending] == [
        (4, PendingState.IN_FLIGHT), (5, PendingState.FINISHED), (6, PendingState.QUEUED)]
    assert ledger.snapshot() != before  # the ledger did change while the save ran
