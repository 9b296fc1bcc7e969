"""FinalizerWorker logic (no Ray) and FinalizerPool on the session's shared private Ray cluster (num_cpus=2)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys
import time

import pytest
import ray
from nemo_gym.token_id_capture.staging import StagedCallBaseSnapshot

from nemo_rl.data.rows import KeptRollout, Placeholder, PlaceholderReason
from nemo_rl.data.calls import StagedRecordInvalidError
from nemo_rl.data_plane import DataPlaneConfig, attach_client
from nemo_rl.data_plane.partitions import (
    StagedKeysMissingError,
    StagingStoreUnavailableError,
    TQTokenSink,
    TQTokenSource,
)
from nemo_rl.experience.finalizer_pool import (
    FinalizerPool,
    FinalizerPoolError,
    FinalizerWorker,
    TQSourceFactory,
    evidence_placeholder,
    judge_from_source,
    split_evenly,
)
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RolloutEvidence, RunFailure

# Ray workers cannot import this test module: ship the fakes below by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = TokenCaptureConfig()
READY_TIMEOUT_S = 300.0  # actor start-up on a loaded, shared 2-core machine


def rows_whole():
    """The pool's row store in these tests: kept rollouts come back whole, so a test reads their tokens
    (a run's store writes them to the train partition: tests/unit/data_plane/test_train_partition.py)."""
    return list


class FakeSource:
    """In-memory staging source: snapshots by key, optional per-key delay, optional failure."""

    def __init__(self, snapshots: dict[str, StagedCallBaseSnapshot], delay_s: dict[str, float] | None = None,
                 error: Exception | None = None) -> None:
        self._snapshots = snapshots
        self._delay_s = delay_s or {}
        self._error = error
        self.fetched: list[list[str]] = []

    def fetch(self, staging_keys: list[str]) -> list[StagedCallBaseSnapshot]:
        self.fetched.append(list(staging_keys))
        for key in staging_keys:
            time.sleep(self._delay_s.get(key, 0.0))
        if self._error is not None:
            raise self._error
        missing = [key for key in staging_keys if key not in self._snapshots]
        if missing:
            raise StagedKeysMissingError("fake", missing)
        return [self._snapshots[key] for key in staging_keys]


class ShortSource(FakeSource):
    """Answers one snapshot fewer than asked (the TransferQueue kv_batch_get failure mode)."""

    def fetch(self, staging_keys):
        return super().fetch(staging_keys)[:-1]


class RaisingSource(FakeSource):
    """Raises outside the SnapshotSource protocol: RuntimeError for rollout r-r, TimeoutError for r-t."""

    def fetch(self, staging_keys):
        if staging_keys[0].startswith("r-r/"):
            raise RuntimeError("source bug")
        if staging_keys[0].startswith("r-t/"):
            raise TimeoutError("kv_batch_get: no answer")
        return super().fetch(staging_keys)


def failing_factory() -> FakeSource:
    raise RuntimeError("cannot reach the data plane")


def _item(chains, rollout_id, sample_index, *, group_index=0):
    chain = chains.build(rollout_id)
    evidence = RolloutEvidence(rollout_id, group_index, sample_index,
                               chains.run_result(1.0, chain.terminal.response_id), None, chain.manifest(), None, None)
    return chain, evidence


def _by_key(*chains_):
    return {s.staging_key: s for chain in chains_ for s in chain.snapshots}


# --- worker logic without Ray --------------------------------------------------------------------


def test_worker_fetches_in_manifest_order_and_verifies(chains):
    chain, item = _item(chains, "r-a", 0)
    source = FakeSource(_by_key(chain))
    reply = FinalizerWorker(lambda: source, CFG, rows_whole).finalize(item)

    assert isinstance(reply.result, KeptRollout)
    assert [row.token_ids for row in reply.result.rows] == [chain.full_sequence]
    assert source.fetched == [["r-a/call0", "r-a/call1"]]
    assert reply.started_at_s <= time.time()


def test_a_chunk_is_one_staging_read_and_one_train_write_with_each_rollouts_own_verdict(chains):
    built = [_item(chains, f"r-{k}", k) for k in range(3)]
    snapshots = _by_key(*(chain for chain, _ in built))
    del snapshots[built[1][0].snapshots[1].staging_key]  # r-1's terminal call never landed
    failed = dataclasses.replace(_item(chains, "r-f", 3)[1], run_result=None,
                                 run_failure=RunFailure(PlaceholderReason.RUN_FAILED, "agent crashed"))
    source = FakeSource(snapshots)
    writes: list[list[str]] = []

    def rows(kept):
        writes.append([k.rollout_id for k in kept])
        return list(kept)

    replies = FinalizerWorker(lambda: source, CFG, lambda: rows).finalize_many([item for _, item in built] + [failed])
    # One read for the whole chunk (the failed run's keys are not asked for); the fetch's own retry
    # without the missing key is the second.
    assert source.fetched == [["r-0/call0", "r-0/call1", "r-1/call0", "r-1/call1", "r-2/call0", "r-2/call1"],
                              ["r-0/call0", "r-0/call1", "r-1/call0", "r-2/call0", "r-2/call1"]]
    assert writes == [["r-0", "r-2"]]
    results = [reply.result for reply in replies]
    assert [type(r) for r in results] == [KeptRollout, Placeholder, KeptRollout, Placeholder]
    assert (results[1].reason, results[3].reason) == (PlaceholderReason.STAGED_RECORD_MISSING, PlaceholderReason.RUN_FAILED)
    assert len({reply.started_at_s for reply in replies}) == 1


def test_split_evenly_cuts_contiguous_chunks_that_differ_by_at_most_one():
    assert split_evenly(list("abcdefg"), 3) == [list("abc"), list("de"), list("fg")]
    assert split_evenly(list("ab"), 4) == [["a"], ["b"]]
    assert split_evenly(list("abc"), 1) == [list("abc")]
    assert split_evenly([], 2) == []


def test_absent_key_is_staged_record_missing(chains):
    chain, item = _item(chains, "r-a", 0)
    source = FakeSource({chain.snapshots[0].staging_key: chain.snapshots[0]})
    result = judge_from_source(source, item, CFG)

    assert result.reason is PlaceholderReason.STAGED_RECORD_MISSING
    assert result.detail == f"r-a/call1: {StagedKeysMissingError('fake', ['r-a/call1'])}"
    assert source.fetched == [["r-a/call0", "r-a/call1"], ["r-a/call0"]]


@pytest.mark.parametrize(
    ("error", "reason", "detail"),
    [
        (StagedRecordInvalidError("r-a/call0", "header is not JSON"), PlaceholderReason.VERIFICATION_FAILED,
         "r-a/call0: invalid_staged_record: staged record under key 'r-a/call0' is invalid: header is not JSON"),
        (StagingStoreUnavailableError("get timed out after 10s"), PlaceholderReason.DATA_PLANE_ERROR,
         "r-a/call0: StagingStoreUnavailableError: get timed out after 10s"),
    ],
)
def test_staging_fetch_errors_map_to_typed_reasons(chains, error, reason, detail):
    chain, item = _item(chains, "r-a", 0)
    result = judge_from_source(FakeSource(_by_key(chain), error=error), item, CFG)

    assert (result.reason, result.detail) == (reason, detail)


def test_short_answer_is_staged_record_missing(chains):
    chain, item = _item(chains, "r-a", 0)
    result = judge_from_source(ShortSource(_by_key(chain)), item, CFG)

    assert (result.reason, result.detail) == (
        PlaceholderReason.STAGED_RECORD_MISSING,
        "r-a/call1: the source answered 1 snapshots for 2 keys and none for r-a/call1")


def test_a_source_error_outside_the_protocol_is_a_bug_not_a_verdict(chains):
    # TQTokenSource raises StagingFetchError subclasses only; anything else is a defect and must surface.
    chain, item = _item(chains, "r-a", 0)
    worker = FinalizerWorker(lambda: FakeSource(_by_key(chain), error=TimeoutError("kv_batch_get: no answer")), CFG,
                             rows_whole)
    with pytest.raises(TimeoutError, match="kv_batch_get: no answer"):
        worker.finalize(item)


def test_foreign_manifest_is_not_fetched(chains):
    source = FakeSource({})
    evidence = RolloutEvidence("r-p", 0, 4, chains.run_result(1.0), None, chains.build("r-other").manifest(), None,
                               None)
    result = judge_from_source(source, evidence, CFG)

    assert (result.reason, result.sample_index, source.fetched) == (PlaceholderReason.CAPTURE_POISONED, 4, [])


def test_evidence_placeholder_keeps_the_runs_reward(chains):
    chain, item = _item(chains, "r-a", 2, group_index=1)
    failed = RolloutEvidence("r-b", 1, 3, None, RunFailure(PlaceholderReason.RUN_FAILED, "boom"), None, None, None)

    assert evidence_placeholder(item, PlaceholderReason.FINALIZE_TIMEOUT, "late") == Placeholder(
        "r-a", 1, 2, PlaceholderReason.FINALIZE_TIMEOUT, "late", 1.0)
    assert evidence_placeholder(failed, PlaceholderReason.FINALIZER_UNAVAILABLE, "dead") == Placeholder(
        "r-b", 1, 3, PlaceholderReason.FINALIZER_UNAVAILABLE, "dead", None)


# --- the pool on real Ray -------------------------------------------------------------------------


async def test_pool_finalizes_a_group_in_item_order(shared_ray, chains):
    built = [_item(chains, f"r-{k}", k) for k in range(4)]
    snapshots = _by_key(*(chain for chain, _ in built))
    tampered_key = built[2][0].snapshots[1].staging_key
    snapshots[tampered_key] = snapshots[tampered_key].model_copy(update={"token_ids_delta": [31, 32, 41, 99]})
    pool = FinalizerPool(2, functools.partial(FakeSource, snapshots), call_timeout_s=60.0, cfg=CFG, rows_factory=rows_whole)
    try:
        await pool.wait_ready(READY_TIMEOUT_S)
        outcomes = await pool.finalize_group([item for _, item in built])
    finally:
        pool.shutdown()

    results = [outcome.result for outcome in outcomes]
    assert [r.sample_index for r in results] == [0, 1, 2, 3]
    assert [type(r) for r in results] == [KeptRollout, KeptRollout, Placeholder, KeptRollout]
    assert (results[2].reason, results[2].detail) == (PlaceholderReason.VERIFICATION_FAILED, "corrupt_digest")
    assert all([row.token_ids for row in r.rows] == [built[k][0].full_sequence]
               for k, r in enumerate(results) if k != 2)
    assert all(outcome.queue_wait_ms is not None and outcome.queue_wait_ms >= 0.0 for outcome in outcomes)


async def test_pool_deadline_yields_finalize_timeout_and_replaces_the_stuck_worker(shared_ray, chains):
    slow_chain, slow_item = _item(chains, "r-slow", 0)
    fast_chain, fast_item = _item(chains, "r-fast", 1)
    factory = functools.partial(FakeSource, _by_key(slow_chain, fast_chain), {"r-slow/call0": 600.0})
    pool = FinalizerPool(1, factory, call_timeout_s=3.0, cfg=CFG, rows_factory=rows_whole)
    try:
        await pool.wait_ready(READY_TIMEOUT_S)
        began = time.monotonic()
        (timed_out,) = await pool.finalize_group([slow_item])
        waited_s = time.monotonic() - began
        await pool.wait_ready(READY_TIMEOUT_S)  # the replacement actor
        (after,) = await pool.finalize_group([fast_item])
    finally:
        pool.shutdown()

    assert timed_out.result == Placeholder(
        "r-slow", 0, 0, PlaceholderReason.FINALIZE_TIMEOUT, "finalizer worker 0 gave no answer within 3.0s", 1.0)
    assert timed_out.queue_wait_ms is None
    assert 3.0 <= waited_s < 10.0
    assert pool.replacements == 1
    # The replacement judges: the fast rollout's verified row, exactly.
    assert [row.token_ids for row in after.result.rows] == [fast_chain.full_sequence]


async def _until_dead(handle, timeout_s: float) -> None:
    """Return once calls on the actor fail with RayActorError (ray.kill lands asynchronously:
    a call sent right after it may still be answered)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await asyncio.wait_for(handle.ready.remote(), timeout_s)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, f"the killed actor still answers {timeout_s} s after shutdown"
        await asyncio.sleep(0.2)


async def test_dead_worker_is_finalizer_unavailable_then_replaced(shared_ray, chains):
    chain, item = _item(chains, "r-a", 0)
    pool = FinalizerPool(1, functools.partial(FakeSource, _by_key(chain)), call_timeout_s=60.0, cfg=CFG,
                         rows_factory=rows_whole)
    try:
        await pool.wait_ready(READY_TIMEOUT_S)
        assert [p.name for p in pool.probes()] == ["finalizer_0"]
        assert [await p.check() for p in pool.probes()] == [None]
        ray.kill(pool._workers[0].handle, no_restart=True)
        await _until_dead(pool._workers[0].handle, 60.0)
        (probe,) = pool.probes()
        verdict = await probe.check()
        (dead,) = await pool.finalize_group([item])
        deaths, again = pool.take_deaths(), pool.take_deaths()
        await pool.wait_ready(READY_TIMEOUT_S)
        (alive,) = await pool.finalize_group([item])
        replaced_probes = [(p.name, await p.check()) for p in pool.probes()]
    finally:
        pool.shutdown()

    assert verdict.startswith("finalizer worker finalizer_0 (Ray actor) is gone: ")
    assert dead.result.reason is PlaceholderReason.FINALIZER_UNAVAILABLE
    assert dead.result.detail.startswith("finalizer worker 0 died: ")
    assert dead.queue_wait_ms is None
    assert list(deaths) == ["finalizer_0"] and deaths["finalizer_0"].startswith("finalizer worker 0 (Ray actor) died: ")
    assert again == {}  # reported once
    assert [row.token_ids for row in alive.result.rows] == [chain.full_sequence]
    assert replaced_probes == [("finalizer_0_r1", None)]  # the replacement is watched afresh


async def test_mark_dead_replaces_an_idle_actor_at_once(shared_ray, chains):
    chain, item = _item(chains, "r-a", 0)
    pool = FinalizerPool(2, functools.partial(FakeSource, _by_key(chain)), call_timeout_s=60.0, cfg=CFG,
                         rows_factory=rows_whole)
    try:
        await pool.wait_ready(READY_TIMEOUT_S)
        old = pool._workers[1].handle
        marked, unknown = pool.mark_dead("finalizer_1"), pool.mark_dead("finalizer_7")
        names = sorted(pool.actors())
        await pool.wait_ready(READY_TIMEOUT_S)
        outcomes = await pool.finalize_group([item, item])
        await _until_dead(old, 60.0)  # the replaced actor was killed
    finally:
        pool.shutdown()

    assert (marked, unknown) == (True, False)
    assert names == ["finalizer_0", "finalizer_1_r1"] and pool.replacements == 1
    assert [type(o.result) for o in outcomes] == [KeptRollout, KeptRollout]
    assert pool.take_deaths() == {}  # taken out of rotation by the watch, not found dead by a call


async def test_a_judge_exception_is_a_finalizer_bug_not_a_placeholder(shared_ray, chains):
    # Data faults are verdicts; an exception raised inside the actor is a defect and must stop the run,
    # whatever its type. A TimeoutError raised by the task is not the pool's call deadline expiring.
    runtime_chain, runtime_item = _item(chains, "r-r", 0)
    timeout_chain, timeout_item = _item(chains, "r-t", 0)
    factory = functools.partial(RaisingSource, _by_key(runtime_chain, timeout_chain))
    pool = FinalizerPool(1, factory, call_timeout_s=60.0, cfg=CFG, rows_factory=rows_whole)
    try:
        await pool.wait_ready(READY_TIMEOUT_S)
        with pytest.raises(FinalizerPoolError, match="finalizer worker 0 raised while judging rollout r-r") as excinfo:
            await pool.finalize_group([runtime_item])
        assert excinfo.value.kind == "bug"
        began = time.monotonic()
        with pytest.raises(FinalizerPoolError, match="finalizer worker 0 raised while judging rollout r-t") as excinfo:
            outcomes = await pool.finalize_group([timeout_item])
            pytest.fail(f"a TimeoutError raised by the judge became a verdict after {time.monotonic() - began:.1f}s "
                        f"of a 60 s deadline: {outcomes[0].result}")
        assert excinfo.value.kind == "bug"
    finally:
        pool.shutdown()


async def test_a_worker_that_cannot_build_its_source_fails_loudly_by_index(shared_ray):
    pool = FinalizerPool(1, failing_factory, call_timeout_s=60.0, cfg=CFG, rows_factory=rows_whole)
    try:
        with pytest.raises(FinalizerPoolError, match="finalizer workers died while starting \\(0: ") as excinfo:
            await pool.wait_ready(READY_TIMEOUT_S)
        assert excinfo.value.kind == "start"
    finally:
        pool.shutdown()


async def test_shutdown_kills_only_this_pools_actors(shared_ray, chains):
    chain, item = _item(chains, "r-a", 0)
    factory = functools.partial(FakeSource, _by_key(chain))
    keep = FinalizerPool.from_config(TokenCaptureConfig(num_finalizer_workers=1, finalize_timeout_s=60.0), factory,
                                     rows_whole)
    drop = FinalizerPool(1, factory, 60.0, CFG, rows_factory=rows_whole)
    try:
        await asyncio.gather(keep.wait_ready(READY_TIMEOUT_S), drop.wait_ready(READY_TIMEOUT_S))
        drop.shutdown()
        with pytest.raises(FinalizerPoolError, match="after shutdown") as excinfo:
            await drop.finalize_group([item])
        assert excinfo.value.kind == "closed"
        await _until_dead(drop._workers[0].handle, 60.0)
        (kept,) = await keep.finalize_group([item])
        assert [row.token_ids for row in kept.result.rows] == [chain.full_sequence]
    finally:
        keep.shutdown()
        drop.shutdown()


@pytest.mark.integration
async def test_pool_reads_records_staged_in_the_real_data_plane(shared_plane, chains):
    data_plane = DataPlaneConfig(call_timeout_s=30.0)  # the session's plane, attached with a 30 s deadline
    partition = "finalizer_pool_test"
    chain, item = _item(chains, "r-tq", 0)
    keys = [record.staging_key for record in chain.records]
    with attach_client(data_plane) as client:
        assert all(TQTokenSink(client, partition).stage(record).ok for record in chain.staged)
        pool = FinalizerPool(1, TQSourceFactory(data_plane, partition, timeout_s=30.0), call_timeout_s=60.0,
                             cfg=CFG, rows_factory=rows_whole)
        try:
            await pool.wait_ready(READY_TIMEOUT_S)
            (staged,) = await pool.finalize_group([item])
            TQTokenSource(client, partition).clear(keys)  # retention, as the RolloutManager does
            (cleared,) = await pool.finalize_group([item])
        finally:
            pool.shutdown()

    assert isinstance(staged.result, KeptRollout)
    (row,) = staged.result.rows
    assert row.token_ids == chain.full_sequence
    assert row.generation_logprobs == (0.0,) * 4 + (-0.5, -0.25, -0.125) + (0.0,) * 2 + (-1.0, -0.75)
    assert cleared.result.reason is PlaceholderReason.STAGED_RECORD_MISSING
    assert "r-tq/call0" in cleared.result.detail


def test_pool_rejects_bad_sizes():
    with pytest.raises(FinalizerPoolError, match="num_workers must be >= 1") as excinfo:
        FinalizerPool(0, failing_factory, 1.0, CFG, rows_factory=rows_whole)
    assert excinfo.value.kind == "config"
    with pytest.raises(FinalizerPoolError, match="call_timeout_s must be > 0") as excinfo:
        FinalizerPool(1, failing_factory, 0.0, CFG, rows_factory=rows_whole)
    assert excinfo.value.kind == "config"
