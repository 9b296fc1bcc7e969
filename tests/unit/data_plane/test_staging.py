"""TQTokenSink / TQTokenSource against Gym's staging contract, on a real private Ray + TQ."""

from __future__ import annotations

import json
import struct
import threading
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.staging import (
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    CallRecord,
    CaptureAdmission,
    RolloutReceipt,
    RolloutTokenCapture,
    StagedCallRecord,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
    load_golden_vectors,
    staging_key,
    verify_and_linearize,
)

from nemo_rl.data.calls import StagedRecordInvalidError, StagingFetchError, record_to_row
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig, DataPlaneTimeoutError, attach_client
from nemo_rl.data_plane.client import StageWriter
from nemo_rl.data_plane.partitions import StagedKeysMissingError, TQStagingCleaner, TQTokenSink, TQTokenSource

PARTITION = "staging_test"
CFG = DataPlaneConfig(call_timeout_s=10.0)



@pytest.fixture(scope="module")
def sink(clients: tuple[DataPlaneClient, DataPlaneClient]) -> TQTokenSink:
    return TQTokenSink(clients[0], PARTITION)


@pytest.fixture(scope="module")
def source(clients: tuple[DataPlaneClient, DataPlaneClient]) -> TQTokenSource:
    return TQTokenSource(clients[1], PARTITION)


def f64_bits(values: list[float]) -> list[bytes]:
    return [struct.pack(">d", v) for v in values]


def root_record(
    rollout_id: str,
    model_call_id: str,
    token_ids: list[int],
    mask: list[float],
    logprobs: list[float],
    *,
    weight_version: int = 0,
) -> StagedCallRecord:
    """A valid text-root record whose hashes and digest come from Gym's functions."""
    fields = {
        "schema_version": STAGING_SCHEMA_VERSION,
        "digest_version": STAGING_DIGEST_VERSION,
        "extras_digest_version": EXTRAS_DIGEST_VERSION,
        "rollout_id": rollout_id,
        "model_call_id": model_call_id,
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": len(token_ids),
        "cum_len": len(token_ids),
        "weight_version": weight_version,
        "token_ids_delta": token_ids,
        "token_mask_delta": mask,
        "generation_log_probs_delta": logprobs,
        "extras_digest": compute_extras_digest(None),
        "chain_hash": compute_chain_hash(None, token_ids),
        "cumulative_hash": hash_token_ids(token_ids),
    }
    return StagedCallRecord(**fields, digest=compute_staging_digest(**fields))


def simple_record(model_call_id: str, *, weight_version: int = 0, rollout_id: str = "r") -> StagedCallRecord:
    return root_record(
        rollout_id, model_call_id, [11, 12, 13], [0.0, 1.0, 1.0], [0.0, -0.5, -1 / 3], weight_version=weight_version
    )


def golden_record() -> StagedCallRecord:
    vectors = load_golden_vectors()
    return StagedCallRecord(**vectors["staged_call"], digest=vectors["staged_call_digest"], extras=vectors["extras"])


def test_golden_vector_round_trips_through_a_fresh_client(sink: TQTokenSink) -> None:
    record = golden_record()
    result = sink.stage(record)
    assert (result.ok, result.staging_key, result.error) == (True, "rollout-1/call-1", None)
    with attach_client(CFG) as fresh:
        fresh_source = TQTokenSource(fresh, PARTITION)
        (snapshot,) = fresh_source.fetch(["rollout-1/call-1"])
        (with_extras,) = fresh_source.fetch_records(["rollout-1/call-1"])
    assert snapshot.model_dump() == record.model_dump(exclude={"extras"})
    assert snapshot.digest == load_golden_vectors()["staged_call_digest"]
    assert f64_bits(snapshot.generation_log_probs_delta) == f64_bits(record.generation_log_probs_delta)
    assert with_extras.extras == load_golden_vectors()["extras"]
    assert with_extras.model_dump() == record.model_dump()


def test_identical_retry_is_ok_and_conflicting_reuse_is_rejected(sink: TQTokenSink, source: TQTokenSource) -> None:
    first = simple_record("retry")
    assert sink.stage(first).ok
    again = sink.stage(simple_record("retry"))
    assert (again.ok, again.staging_key) == (True, "r/retry")
    conflicting = simple_record("retry", weight_version=9)
    rejected = sink.stage(conflicting)
    assert rejected.ok is False
    assert "staging key 'r/retry' already holds a different record" in rejected.error
    assert first.digest in rejected.error and conflicting.digest in rejected.error
    (stored,) = source.fetch(["r/retry"])
    assert stored.digest == first.digest


def test_attachments_are_rejected_by_name(sink: TQTokenSink, source: TQTokenSource) -> None:
    result = sink.stage(simple_record("attach"), attachments={"pixel_values": b"..."})
    assert result.ok is False
    assert "staging key 'r/attach'" in result.error and "['pixel_values']" in result.error
    with pytest.raises(StagedKeysMissingError):
        source.fetch(["r/attach"])
    assert sink.stage(simple_record("attach"), attachments={}).ok


def test_concurrent_stage_from_eight_threads_all_land(sink: TQTokenSink, source: TQTokenSource) -> None:
    records = [simple_record(f"conc-{i}", rollout_id="conc") for i in range(8)]
    barrier = threading.Barrier(len(records) * 2)
    results: dict[int, object] = {}

    def stage(slot: int, record: StagedCallRecord) -> None:
        barrier.wait()
        results[slot] = sink.stage(record)

    # Each record is staged twice concurrently: distinct keys all land, and the racing
    # identical retries of one key stay idempotent.
    threads = [threading.Thread(target=stage, args=(i, records[i % 8])) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(not t.is_alive() for t in threads)
    assert sorted(results) == list(range(16))
    assert all(r.ok for r in results.values())
    snapshots = source.fetch([r.staging_key for r in records])
    assert [s.digest for s in snapshots] == [r.digest for r in records]


def test_fetch_preserves_order_and_returns_one_per_key(sink: TQTokenSink, source: TQTokenSource) -> None:
    records = [simple_record(f"order-{i}", weight_version=i, rollout_id="order") for i in range(10)]
    for record in records:
        assert sink.stage(record).ok
    order = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]
    snapshots = source.fetch([records[i].staging_key for i in order])
    assert len(snapshots) == 10
    assert [s.model_call_id for s in snapshots] == [f"order-{i}" for i in order]
    assert [s.weight_version for s in snapshots] == order
    assert source.fetch([]) == []


def test_missing_key_raises_naming_the_key(sink: TQTokenSink, source: TQTokenSource) -> None:
    assert sink.stage(simple_record("present")).ok
    with pytest.raises(StagedKeysMissingError) as info:
        source.fetch(["r/present", "r/never-staged"])
    assert isinstance(info.value, StagingFetchError)
    assert info.value.keys == ["r/never-staged"]
    assert "'r/never-staged'" in str(info.value)


def test_clear_retires_keys(sink: TQTokenSink, source: TQTokenSource) -> None:
    keys = [sink.stage(simple_record(f"clear-{i}", rollout_id="clear")).staging_key for i in range(3)]
    source.clear(keys[:2] + ["clear/never-staged"])
    assert [s.model_call_id for s in source.fetch(keys[2:])] == ["clear-2"]
    with pytest.raises(StagedKeysMissingError) as info:
        source.fetch(keys)
    assert info.value.keys == keys[:2]


def test_corrupt_or_misfiled_rows_are_rejected_by_key(
    clients: tuple[DataPlaneClient, DataPlaneClient], source: TQTokenSource
) -> None:
    writer = clients[0]
    tampered = record_to_row(simple_record("tampered"))
    tampered["header"] = tampered["header"].replace('"weight_version": 0', '"weight_version": 1')
    writer.put(PARTITION, "r/tampered", tampered)
    with pytest.raises(StagedRecordInvalidError, match="(?s)'r/tampered' is invalid: .*digest does not match"):
        source.fetch(["r/tampered"])
    writer.put(PARTITION, "r/elsewhere", record_to_row(simple_record("original")))
    with pytest.raises(StagedRecordInvalidError, match="'r/elsewhere' is invalid: it describes staging key 'r/original'"):
        source.fetch(["r/elsewhere"])


def test_gym_capture_core_stages_a_chain_that_linearizes(sink: TQTokenSink, source: TQTokenSource) -> None:
    """Gym's RolloutTokenCapture stages root + token_in child through the sink; Gym verifies them."""
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 3)
    rollout = f"chain-{uuid.uuid4().hex[:8]}"
    root_call = capture.begin_call(CaptureAdmission(rollout_id=rollout, model_call_id="c1", mode="text"))
    root = capture.complete_call(
        root_call, prompt_token_ids=[1, 2, 3], generated_token_ids=[4, 5], generated_logprobs=[-0.25, -1e-9]
    )
    assert root.disposition == "staged"
    prefix = [t for s in source.fetch([root.staging_key]) for t in s.token_ids_delta]
    child_admission = CaptureAdmission(
        rollout_id=rollout,
        model_call_id="c2",
        parent_call_id="c1",
        prev_len=root.cum_len,
        mode="token_in",
        staging_chain=[root.staging_key],
        parent_chain_hash=root.chain_hash,
    )
    child_call = capture.begin_call(child_admission, prefix_token_ids=prefix)
    child = capture.complete_call(
        child_call, prompt_token_ids=prefix + [6, 7], generated_token_ids=[8], generated_logprobs=[-3.5]
    )
    assert child.disposition == "staged"
    manifest = [
        CallRecord(
            **coords.model_dump(exclude={"disposition", "rollout_id"}),
            mode=mode,
            response_id=f"chatcmpl-{coords.model_call_id}",
        )
        for coords, mode in [(root, "text"), (child, "token_in")]
    ]
    receipt = RolloutReceipt(
        rollout_id=rollout, reward=1.0, manifest=manifest, terminal_model_call_id="c2", terminal_selection="declared"
    )
    row = verify_and_linearize(receipt, source.fetch([r.staging_key for r in manifest]))
    assert row.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row.token_mask == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert f64_bits(row.logprobs) == f64_bits([0.0, 0.0, 0.0, -0.25, -1e-9, 0.0, 0.0, -3.5])


def test_a_seeded_prefix_entry_equals_the_one_fetched_from_tq(sink: TQTokenSink, source: TQTokenSource) -> None:
    """The worker seeds its prefix cache with what it staged; a worker that fetches it gets the same entries."""
    from nemo_rl.models.generation.vllm.custody_state import PrefixCache

    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 0)
    seeded = PrefixCache(source, max_tokens=1000)
    rollout = f"seed-{uuid.uuid4().hex[:8]}"
    chain: list[str] = []
    prefix: list[int] = []
    parent_hash, parent_id = None, None
    for i, (tail, generated) in enumerate([([1, 2, 2**40], [4, 5]), ([6, 2**62], [8]), ([9], [10, 11, 12])]):
        admission = CaptureAdmission(
            rollout_id=rollout, model_call_id=f"c{i}", parent_call_id=parent_id, prev_len=len(prefix),
            mode="token_in" if chain else "text", staging_chain=list(chain), parent_chain_hash=parent_hash,
        )
        call = capture.begin_call(admission, prefix_token_ids=list(prefix) if chain else None)
        prompt = prefix + tail
        coords = capture.complete_call(
            call, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=[-0.5] * len(generated)
        )
        assert coords.disposition == "staged"
        # What the worker does after a staged call (custody.CustodyCore._seed_prefix_cache).
        assert seeded.seed(
            coords.staging_key, parent_key=chain[-1] if chain else None, parent_chain_hash=parent_hash,
            delta=(prompt + generated)[admission.prev_len :], cum_len=coords.cum_len, chain_hash=coords.chain_hash,
        )
        chain.append(coords.staging_key)
        prefix, parent_hash, parent_id = prompt + generated, coords.chain_hash, f"c{i}"
    fetched = PrefixCache(source, max_tokens=1000)
    assert fetched.resolve(chain, len(prefix), parent_hash) == prefix
    assert fetched.fetched_keys == 3 and seeded.fetched_keys == 0
    assert [seeded.entry(k) for k in chain] == [fetched.entry(k) for k in chain]
    assert seeded.resolve(chain, len(prefix), parent_hash) == prefix and seeded.fetched_keys == 0


# Finite floats the float32-packed digest accepts; float64 subnormals included on purpose.
_LOGPROBS = st.floats(min_value=-3.0e38, max_value=3.0e38, allow_nan=False, allow_infinity=False)


@st.composite
def deltas(draw: st.DrawFn) -> tuple[list[int], list[float], list[float]]:
    size = draw(st.integers(min_value=1, max_value=48))
    token_ids = draw(st.lists(st.integers(min_value=0, max_value=2**63 - 1), min_size=size, max_size=size))
    mask = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=size, max_size=size))
    logprobs = [draw(_LOGPROBS) if m == 1.0 else 0.0 for m in mask]
    return token_ids, mask, logprobs


@settings(max_examples=25, deadline=None)
@given(delta=deltas())
def test_random_deltas_round_trip_exactly(
    sink: TQTokenSink, source: TQTokenSource, delta: tuple[list[int], list[float], list[float]]
) -> None:
    token_ids, mask, logprobs = delta
    record = root_record("prop", uuid.uuid4().hex, token_ids, mask, logprobs)
    result = sink.stage(record)
    assert result.ok and result.staging_key == staging_key("prop", record.model_call_id)
    (snapshot,) = source.fetch([result.staging_key])
    assert snapshot.token_ids_delta == token_ids
    assert f64_bits(snapshot.token_mask_delta) == f64_bits(mask)
    assert f64_bits(snapshot.generation_log_probs_delta) == f64_bits(logprobs)
    assert snapshot.digest == record.digest


def test_cleaner_clears_named_keys_and_the_groups_orphans_only(clients: tuple[DataPlaneClient, DataPlaneClient]) -> None:
    writer, reader = clients
    partition = "retention_test"
    keys = ["g-i0/c0", "g-i0/c1", "g-i1/c0", "next-i0/c0"]
    writer.put_many(partition, keys, [{"tag": k} for k in keys])
    cleaner = TQStagingCleaner(reader, partition, timeout_s=10.0)

    # The served report names g-i0/c1 and g-i1/c0 as staged; no manifest does: they are the orphans.
    assert cleaner.clear(["g-i0/c0"], ["g-i0", "g-i1"], ["g-i0/c0", "g-i0/c1", "g-i1/c0"]) == 2
    assert reader.list_keys(partition) == ["next-i0/c0"]
    assert reader.get(partition, ["next-i0/c0"], ["tag"]) == [{"tag": "next-i0/c0"}]
    assert cleaner.clear([], ["g-i0", "g-i1"], []) == 0


def test_cleaner_without_a_served_report_finds_the_orphans_by_listing(
    clients: tuple[DataPlaneClient, DataPlaneClient]
) -> None:
    writer, reader = clients
    partition = "retention_listing_test"
    keys = ["h-i0/c0", "h-i0/c1", "next-i0/c0"]
    writer.put_many(partition, keys, [{"tag": k} for k in keys])
    assert TQStagingCleaner(reader, partition, timeout_s=10.0).clear(["h-i0/c0"], ["h-i0"], None) == 1
    assert reader.list_keys(partition) == ["next-i0/c0"]


# --- the hot path: one write per staged call --------------------------------------------------------


class RecordingStore:
    """A `StagingStore` that records every call; `failing_puts` puts raise a deadline error first."""

    def __init__(self, failing_puts: int = 0) -> None:
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self.rows: dict[str, dict] = {}
        self._failing_puts = failing_puts

    def put(self, partition, key, fields, *, timeout_s=None) -> None:
        self.calls.append(("put", partition, (key,)))
        if self._failing_puts:
            self._failing_puts -= 1
            raise DataPlaneTimeoutError("put", partition, 1.0)
        self.rows[key] = dict(fields)

    def get(self, partition, keys, fields, *, timeout_s=None):
        self.calls.append(("get", partition, tuple(keys)))
        raise AssertionError("the sink must not read")

    def clear(self, partition, keys, *, timeout_s=None) -> None:
        self.calls.append(("clear", partition, tuple(keys)))


def _stored_digest(store: RecordingStore, key: str) -> str:
    return json.loads(store.rows[key]["header"])["digest"]


def test_stage_is_one_write_and_no_read() -> None:
    store = RecordingStore()
    sink = TQTokenSink(store, "p")
    results = [sink.stage(simple_record(call)) for call in ("a", "b", "c")]
    assert [(r.ok, r.staging_key) for r in results] == [(True, "r/a"), (True, "r/b"), (True, "r/c")]
    assert store.calls == [("put", "p", ("r/a",)), ("put", "p", ("r/b",)), ("put", "p", ("r/c",))]


def test_retry_writes_nothing_and_a_conflict_leaves_the_stored_row() -> None:
    store = RecordingStore()
    sink = TQTokenSink(store, "p")
    first = simple_record("k")
    assert sink.stage(first).ok
    assert sink.stage(simple_record("k")).ok
    conflicting = simple_record("k", weight_version=9)
    rejected = sink.stage(conflicting)
    assert (rejected.ok, rejected.staging_key) == (False, "r/k")
    assert first.digest in rejected.error and conflicting.digest in rejected.error
    assert store.calls == [("put", "p", ("r/k",))]
    assert _stored_digest(store, "r/k") == first.digest


def test_a_failed_write_is_not_remembered_so_its_retry_writes() -> None:
    store = RecordingStore(failing_puts=1)
    sink = TQTokenSink(store, "p")
    with pytest.raises(DataPlaneTimeoutError):
        sink.stage(simple_record("k"))
    assert sink.stage(simple_record("k")).ok
    assert store.calls == [("put", "p", ("r/k",))] * 2


def test_remembered_digests_are_bounded_lru() -> None:
    store = RecordingStore()
    sink = TQTokenSink(store, "p", remembered_keys=2)
    for call in ("a", "b", "c"):
        assert sink.stage(simple_record(call)).ok
    # "a" was forgotten: its identical retry is written again (a blind write of the same bytes) ...
    assert sink.stage(simple_record("a")).ok
    # ... while "c" is still remembered, so a conflicting record under it is refused without a write.
    assert sink.stage(simple_record("c", weight_version=9)).ok is False
    assert [key for _, _, (key,) in store.calls] == ["r/a", "r/b", "r/c", "r/a"]
    with pytest.raises(ValueError, match="max_keys=0"):
        TQTokenSink(store, "p", remembered_keys=0)


def test_a_second_process_overwrites_and_the_stored_digest_shows_it(
    clients: tuple[DataPlaneClient, DataPlaneClient], source: TQTokenSource
) -> None:
    # Two sinks stand for two processes (no shared memory). The last write wins; what the finalizer
    # reads then carries the second record's digest, so it cannot pass as the first (whose digest
    # the gate would have committed): test_judge's tampered-snapshot test shows that verdict.
    first, second = simple_record("two-writers"), simple_record("two-writers", weight_version=5)
    assert TQTokenSink(clients[0], PARTITION).stage(first).ok
    assert TQTokenSink(clients[1], PARTITION).stage(second).ok
    (stored,) = source.fetch(["r/two-writers"])
    assert stored.digest == second.digest != first.digest


# --- write-behind staging (token_capture.stage_write=behind_reply) -----------------------------------


def test_write_behind_stage_returns_before_the_write_and_flush_is_the_barrier(
    clients: tuple[DataPlaneClient, DataPlaneClient], source: TQTokenSource
) -> None:
    writer = StageWriter(clients[0], PARTITION, timeout_s=10.0)
    sink = TQTokenSink(clients[0], PARTITION, writer=writer)
    records = [simple_record(f"behind-{i}", rollout_id="behind") for i in range(8)]
    barrier = threading.Barrier(len(records))
    results: dict[int, object] = {}

    def stage(slot: int) -> None:
        barrier.wait()
        results[slot] = sink.stage(records[slot])

    threads = [threading.Thread(target=stage, args=(i,)) for i in range(len(records))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(results[i].ok for i in range(len(records)))
    assert writer.flush(["behind"], 10.0) == {}
    # Every row landed exactly as staged (the reader is another client, as the finalizer is) ...
    assert [s.digest for s in source.fetch([r.staging_key for r in records])] == [r.digest for r in records]
    # ... in fewer writes than rows when they queued up together (never more than one per row).
    assert writer.stats["rows"] == 8 and 1 <= writer.stats["batches"] <= 8
    # An identical retry is remembered at submit time and writes nothing more.
    assert sink.stage(records[0]).ok and writer.flush(["behind"], 10.0) == {}
    assert writer.stats["rows"] == 8
    writer.close(10.0)


def test_a_prefix_source_waits_for_a_row_another_worker_is_still_writing(
    clients: tuple[DataPlaneClient, DataPlaneClient],
) -> None:
    record = simple_record("late", rollout_id="late")
    waiting = TQTokenSource(clients[1], PARTITION, timeout_s=10.0, missing_wait_s=10.0)
    writer = threading.Timer(0.3, lambda: TQTokenSink(clients[0], PARTITION).stage(record))
    writer.start()
    (snapshot,) = waiting.fetch([record.staging_key])
    writer.join()
    assert snapshot.digest == record.digest and waiting.missing_waits >= 1
    impatient = TQTokenSource(clients[1], PARTITION, timeout_s=10.0, missing_wait_s=0.2)
    started = time.monotonic()
    with pytest.raises(StagedKeysMissingError, match="never/c"):
        impatient.fetch(["never/c"])
    # It re-tried within its 0.2 s wait (each read bounded by its 10 s deadline), then named the key.
    assert time.monotonic() - started < 0.2 + 10.0
    with pytest.raises(ValueError, match="missing_wait_s=-1: must be >= 0"):
        TQTokenSource(clients[1], PARTITION, missing_wait_s=-1)
