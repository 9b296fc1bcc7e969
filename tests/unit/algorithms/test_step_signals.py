"""Each step signal driven into the failure it exists to flag, read back at the exact value it then holds.

A signal only ever seen healthy passes when stuck at 0; here each one is built broken:
- `retention/staged_keys_remaining`: a key another group left in the real TransferQueue staging
  partition (the loop logs `TQStagingCleaner.remaining()`);
- `retention/ledger_files_remaining`: a ledger file of a rollout never retired (the loop logs
  `NemoGymEnvironment.ledger_file_count()`);
- `retention/train_keys_stray`, `retention/train_keys_remaining` (the synchronous loop's
  `clear_train_rows`): the row of a rollout masked after it was judged, and a clear that leaves a
  key behind, on the real train partition;
- `refit/engine_logprob_change` (`refit_step`): workers that ignore the new weights read 0;
- `async/trainer_wait_s` (`gather_step`): a held group under an injected clock;
- `finalize/queue_wait_ms` and `timing/finalize_s`: one finalizer actor, two groups at once (the
  second waits for the first), on real Ray; `TimedFinalizer`'s sum under an injected clock.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from nemo_gym.token_id_capture.staging import StagedCallBaseSnapshot

from nemo_rl.algorithms.async_config import AsyncRolloutsConfig
from nemo_rl.algorithms.grpo_async import RolloutProducer, TrainerClock, gather_step
from nemo_rl.algorithms.grpo_single_controller import clear_train_rows, refit_step
from tests.unit.experience.test_finalizer_pool import rows_whole
from nemo_rl.algorithms.setup import TimedFinalizer
from nemo_rl.data.rows import GroupResult, KeptRollout, RowOrigin, TrainRow
from nemo_rl.data.train import TrainPlan
from nemo_rl.data_plane import DataPlaneClient
from nemo_rl.data_plane.partitions import StagedKeysMissingError, TQStagingCleaner, TQTokenSink, TrainRowCleaner, store_many_rows
from nemo_rl.environments.gym_client import NemoGymEnvironment
from nemo_rl.environments.nemo_gym_config import NemoGymConfig
from nemo_rl.experience.finalizer_pool import FinalizerPool
from nemo_rl.experience.prompt_queue import PromptLedger
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RolloutEvidence
from nemo_rl.token_capture.metrics import finalize_metrics
from tests.unit.experience.test_staleness import group_of

# Ray workers cannot import this test module: ship the source below by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = TokenCaptureConfig()
TIMEOUT_S = 10.0
READY_TIMEOUT_S = 300.0  # actor start-up on a loaded, shared 2-core machine


# --- retention of the staging partition and the ledger ---------------------------------------------


def test_a_staged_key_another_group_left_reads_one_remaining(clients: tuple[DataPlaneClient, DataPlaneClient], chains):
    writer, reader = clients
    partition = "signals_staging"
    sink = TQTokenSink(writer, partition)
    ours, left = chains.build("g-i0"), chains.build("other-i0")
    for record in (*ours.staged, *left.staged[:1]):
        sink.stage(record)
    cleaner = TQStagingCleaner(reader, partition, TIMEOUT_S)

    orphans = cleaner.clear([ours.staged[0].staging_key], ["g-i0"], None)  # the group's second call is an orphan

    assert orphans == 1
    assert float(cleaner.remaining()) == 1.0  # what the loop logs as retention/staged_keys_remaining
    assert reader.list_keys(partition, timeout_s=TIMEOUT_S) == [left.staged[0].staging_key]
    cleaner.clear([left.staged[0].staging_key], ["other-i0"], None)
    assert float(cleaner.remaining()) == 0.0


def test_a_ledger_file_of_a_rollout_never_retired_reads_one_remaining(tmp_path: Path) -> None:
    env = NemoGymEnvironment(NemoGymConfig(), TokenCaptureConfig(enabled=True), worker_base_url="http://127.0.0.1:9/v1",
                             log_dir=tmp_path)
    env.ledger_dir.mkdir(parents=True)
    for suffix in (".lineage.jsonl", ".tokens.intents", ".tokens.lock"):
        (env.ledger_dir / f"retired-i0{suffix}").write_text("x")
    (env.ledger_dir / "kept-i0.lineage.jsonl").write_text("x")  # its group was never retired
    assert float(env.ledger_file_count()) == 4.0

    env.retire(["retired-i0"])

    assert float(env.ledger_file_count()) == 1.0  # what the loop logs as retention/ledger_files_remaining
    env.retire(["kept-i0"])
    assert float(env.ledger_file_count()) == 0.0


# --- the train partition on the synchronous path ----------------------------------------------------


def _row(rollout_id: str, sample: int) -> TrainRow:
    return TrainRow(
        rollout_id=rollout_id, group_index=0, sample_index=sample, token_ids=(5, 6, 7, 8),
        token_mask=(0.0, 0.0, 1.0, 1.0), generation_logprobs=(0.0, 0.0, -0.5, -0.25), reward=1.0, prompt_len=2,
        model_call_ids=("c0",), weight_versions=(0,), token_in_calls=0, text_root_calls=1,
        terminal_selection="response_id", origin=RowOrigin.CAPTURE, call_spans=((0, 4),), chain_index=0,
    )


def _stored(client: DataPlaneClient, partition: str, rollout_ids: list[str]) -> list[KeptRollout]:
    kept = [KeptRollout(rid, 0, i, (_row(rid, i),), 1.0, "response_id") for i, rid in enumerate(rollout_ids)]
    return store_many_rows(client, partition, kept, TIMEOUT_S, carry_prompt_ids=False)


def _plan(partition: str, rollouts: list[KeptRollout]) -> TrainPlan:
    refs = [row for rollout in rollouts for row in rollout.rows]
    return TrainPlan.of(partition, refs, [1.0] * len(refs))


class LeakyCleaner(TrainRowCleaner):
    """A clear that silently leaves one key behind: the failure `retention/train_keys_remaining` exists to flag."""

    def __init__(self, client: DataPlaneClient, partition: str, leak: str) -> None:
        super().__init__(client, partition, TIMEOUT_S)
        self.leak = leak

    def clear(self, keys):
        super().clear([key for key in keys if key != self.leak])


def test_the_row_of_a_rollout_masked_after_it_was_judged_is_one_stray_key(clients):
    writer, reader = clients
    partition = "signals_train_stray"
    stored = _stored(writer, partition, ["s-i0", "s-i1", "s-i2"])
    cleaner = TrainRowCleaner(reader, partition, TIMEOUT_S)

    metrics = clear_train_rows(cleaner, _plan(partition, stored[:2]).keys)  # s-i2 was masked after its row was stored

    assert metrics == {"retention/train_keys_cleared": 3.0, "retention/train_keys_stray": 1.0,
                       "retention/train_keys_remaining": 0.0}
    assert cleaner.remaining() == []


def test_a_clear_that_leaves_a_trained_key_reads_it_stray_and_remaining(clients):
    writer, reader = clients
    partition = "signals_train_leak"
    stored = _stored(writer, partition, ["l-i0", "l-i1"])
    leaked = stored[1].rows[0].key
    cleaner = LeakyCleaner(reader, partition, leaked)

    metrics = clear_train_rows(cleaner, _plan(partition, stored).keys)

    assert metrics == {"retention/train_keys_cleared": 3.0, "retention/train_keys_stray": 1.0,
                       "retention/train_keys_remaining": 1.0}
    assert cleaner.remaining() == [leaked]
    TrainRowCleaner(reader, partition, TIMEOUT_S).clear([leaked])
    assert cleaner.remaining() == []


# --- refit -------------------------------------------------------------------------------------------


class ProbePolicy:
    def export_weights(self, out_dir: str | Path) -> Path:
        return Path(out_dir)

    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        return [[-1.0] * len(ids) for ids in token_ids]


class ProbeWorkers:
    """Report the new version; score the probe with the weights they hold (each version moves it by 0.125)."""

    def __init__(self, apply_weights: bool) -> None:
        self.apply_weights = apply_weights
        self.held = 0

    def update_weights(self, weights_dir: Path, version: int) -> list[int]:
        if self.apply_weights:
            self.held = version
        return [version, version]

    def prompt_logprobs(self, token_ids: list[int]) -> list[list[float]]:
        return [[-1.0 - 0.125 * self.held] * len(token_ids)] * 2


def _refit_run(workers: ProbeWorkers, root: Path) -> SimpleNamespace:
    return SimpleNamespace(policy=ProbePolicy(), stack=SimpleNamespace(workers=workers), weights_root=root,
                           probe=[3, 4, 5], previous_engine_probe=[-1.0, -1.0, -1.0], served_version=0)


def test_workers_that_ignore_the_new_weights_read_no_engine_logprob_change(tmp_path: Path) -> None:
    ignoring, applying = _refit_run(ProbeWorkers(False), tmp_path / "a"), _refit_run(ProbeWorkers(True), tmp_path / "b")
    ignored = [refit_step(ignoring, step)["refit/engine_logprob_change"] for step in (1, 2)]
    applied = [refit_step(applying, step)["refit/engine_logprob_change"] for step in (1, 2)]
    assert ignored == [0.0, 0.0]
    assert applied == [0.125, 0.125]
    assert (ignoring.served_version, applying.served_version) == (2, 2)  # both reported the version: only the probe tells


# --- the async trainer's wait --------------------------------------------------------------------


async def test_a_held_group_is_the_trainers_wait_on_the_injected_clock() -> None:
    now = [100.0]
    started, release = asyncio.Event(), asyncio.Event()

    async def run_group(ticket):
        started.set()
        await release.wait()
        return group_of(ticket.group_index, [[(3,)]])

    grpo = SimpleNamespace(num_prompts_per_step=1, async_rollouts=AsyncRolloutsConfig(
        enabled=True, max_trajectory_age_steps=1, max_in_flight_groups=None))
    run = SimpleNamespace(cfg=SimpleNamespace(grpo=grpo), start_step=1, progress=lambda line: None)
    producer = RolloutProducer(PromptLedger(1, 1), run_group, end=1)
    metrics: dict[str, float] = {}
    gather = asyncio.create_task(gather_step(run, producer, 1, TrainerClock(3), metrics, clock=lambda: now[0]))
    await started.wait()  # the trainer took its start time before the group could run
    now[0] += 2.5
    release.set()
    await gather

    assert metrics["async/trainer_wait_s"] == 2.5


# --- the finalizer: queue wait and time spent ----------------------------------------------------------


class DelayedSource:
    """In-memory staging source that takes `delay_s[key]` seconds to fetch a key."""

    def __init__(self, snapshots: dict[str, StagedCallBaseSnapshot], delay_s: dict[str, float]) -> None:
        self._snapshots, self._delay_s = snapshots, delay_s

    def fetch(self, staging_keys: list[str]) -> list[StagedCallBaseSnapshot]:
        for key in staging_keys:
            time.sleep(self._delay_s.get(key, 0.0))  # the work a slow judge does
        missing = [key for key in staging_keys if key not in self._snapshots]
        if missing:
            raise StagedKeysMissingError("delayed", missing)
        return [self._snapshots[key] for key in staging_keys]


def _evidence(chains, rollout_id: str, group_index: int):
    chain = chains.build(rollout_id)
    return chain, RolloutEvidence(rollout_id, group_index, 0, chains.run_result(1.0, chain.terminal.response_id), None,
                                  chain.manifest(), None, None)


async def test_one_finalizer_and_two_groups_at_once_the_second_waits_for_the_first(shared_ray, chains):
    delay_s = 2.0
    first_chain, first = _evidence(chains, "q-g0-i0", 0)
    second_chain, second = _evidence(chains, "q-g1-i0", 1)
    snapshots = {s.staging_key: s for chain in (first_chain, second_chain) for s in chain.snapshots}
    pool = FinalizerPool(1, functools.partial(DelayedSource, snapshots, {first_chain.snapshots[0].staging_key: delay_s}),
                         call_timeout_s=60.0, cfg=CFG, rows_factory=rows_whole)
    timed = TimedFinalizer(pool)
    try:
        await pool.wait_ready(READY_TIMEOUT_S)
        (a,), (b,) = await asyncio.gather(timed.finalize_group([first]), timed.finalize_group([second]))
    finally:
        pool.shutdown()

    assert isinstance(a.result, KeptRollout) and isinstance(b.result, KeptRollout)
    assert a.queue_wait_ms is not None and b.queue_wait_ms is not None
    # The actor runs one call at a time: the second began only after the first's delay was spent.
    assert b.queue_wait_ms >= delay_s * 1000.0 > a.queue_wait_ms
    groups = [GroupResult(0, (a.result,)), GroupResult(1, (b.result,))]
    metrics = finalize_metrics(groups, [a.queue_wait_ms, b.queue_wait_ms])
    assert metrics["finalize/queue_wait_ms"] == (a.queue_wait_ms + b.queue_wait_ms) / 2 >= delay_s * 500.0
    assert metrics["finalize/queue_wait_ms_max"] == b.queue_wait_ms
    # Summed over groups: the first's delay, then the second's wait for it.
    assert timed.seconds >= 2 * delay_s


class ClockedPool:
    """A pool stand-in whose every group takes the next of `took` seconds on the injected clock."""

    def __init__(self, now: list[float], took: list[float]) -> None:
        self.now, self.took = now, took

    async def finalize_group(self, items):
        self.now[0] += self.took.pop(0)
        if not self.took:
            raise RuntimeError("the last group fails")
        return []


async def test_finalize_seconds_are_summed_over_groups_failed_ones_included() -> None:
    now = [50.0]
    timed = TimedFinalizer(ClockedPool(now, [0.25, 1.5, 0.125]), clock=lambda: now[0])
    await timed.finalize_group([])
    await timed.finalize_group([])
    assert timed.seconds == 1.75
    with pytest.raises(RuntimeError, match="the last group fails"):
        await timed.finalize_group([])
    assert timed.seconds == 1.875
