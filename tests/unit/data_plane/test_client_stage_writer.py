"""The write-behind stage writer (pure logic over a fake batch store; the real TQ test is in test_staging)."""

from __future__ import annotations

import threading
import time

import pytest

from nemo_rl.data_plane import DataPlaneBugError, DataPlaneTimeoutError
from nemo_rl.data_plane.client import ParentRows, StageWriter


class GatedStore:
    """A `BatchStore` whose puts block until released; records every batch; can fail or crash."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.rows: dict[str, dict] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_next: list[BaseException] = []

    def put_many(self, partition, keys, rows, *, timeout_s=None) -> None:
        self.entered.set()
        assert self.gate.wait(10), "test store gate never opened"
        self.batches.append(list(keys))
        if self.fail_next:
            raise self.fail_next.pop(0)
        self.rows.update(zip(keys, rows))


def _writer(store: GatedStore, **kw) -> StageWriter:
    return StageWriter(store, "p", timeout_s=5.0, **kw)


def test_rows_queued_during_a_write_share_the_next_write() -> None:
    store = GatedStore()
    store.gate.clear()
    writer = _writer(store)
    writer.submit("r1", "r1/a", {"v": 1})
    assert store.entered.wait(5)  # the first row's write is in flight (blocked)
    for call in ("b", "c", "d"):
        writer.submit("r1", f"r1/{call}", {"v": call})
    writer.submit("r2", "r2/a", {"v": 2})
    store.gate.set()
    assert writer.flush(["r1", "r2"], 5.0) == {}
    assert store.batches == [["r1/a"], ["r1/b", "r1/c", "r1/d", "r2/a"]]
    assert sorted(store.rows) == ["r1/a", "r1/b", "r1/c", "r1/d", "r2/a"]
    assert (writer.stats["rows"], writer.stats["batches"], writer.stats["max_batch_rows"]) == (5, 2, 4)
    writer.close(5.0)


def test_a_batch_is_capped_at_max_batch_rows() -> None:
    store = GatedStore()
    store.gate.clear()
    writer = _writer(store, max_batch=2)
    writer.submit("r", "r/0", {})
    assert store.entered.wait(5)
    for i in range(1, 6):
        writer.submit("r", f"r/{i}", {})
    store.gate.set()
    assert writer.flush(["r"], 5.0) == {}
    assert store.batches == [["r/0"], ["r/1", "r/2"], ["r/3", "r/4"], ["r/5"]]
    writer.close(5.0)


def test_flush_waits_for_the_rollouts_rows_and_not_for_others() -> None:
    store = GatedStore()
    store.gate.clear()
    writer = _writer(store)
    writer.submit("slow", "slow/a", {})
    assert store.entered.wait(5)
    started = time.monotonic()
    assert writer.flush(["other"], 5.0) == {}  # nothing of "other" is pending: no wait
    assert time.monotonic() - started < 5.0  # a flush that waited for the gated row would end at its 5 s deadline
    threading.Timer(0.2, store.gate.set).start()
    assert writer.flush(["slow"], 5.0) == {}
    assert time.monotonic() - started >= 0.2
    assert writer.pending_rows() == 0
    writer.close(5.0)


def test_a_failed_write_is_reported_once_per_key_with_the_error() -> None:
    store = GatedStore()
    error = DataPlaneTimeoutError("put", "p", 5.0)
    store.fail_next.append(error)
    writer = _writer(store)
    writer.submit("r1", "r1/a", {})
    lost = {"r1/a": f"staging write failed: DataPlaneTimeoutError: {error}"}
    assert writer.flush(["r1"], 5.0) == lost
    assert writer.flush(["r1"], 5.0) == lost  # kept: a lost row stays lost until it is evicted
    writer.submit("r1", "r1/b", {})  # the writer keeps serving after a data-plane error
    assert writer.flush(["r1"], 5.0) == lost
    assert "r1/b" in store.rows and writer.stats["failed_rows"] == 1
    writer.close(5.0)


def test_the_flush_deadline_withdraws_queued_rows_and_abandons_the_write_in_flight() -> None:
    store = GatedStore()
    store.gate.clear()
    writer = _writer(store, max_batch=1)
    seeded: list[str] = []
    writer.submit("r1", "r1/a", {})
    assert store.entered.wait(5)  # r1/a is in a (slow) write
    writer.submit("r1", "r1/b", {})  # queued behind it
    assert writer.when_written("r1/a", lambda: seeded.append("a")) and writer.when_written("r1/b", lambda: seeded.append("b"))
    not_finished = "staging write not finished within token_capture.stage_timeout_s=0.1s"
    lost = {
        "r1/a": f"{not_finished}: abandoned in its write, a late landing is never used",
        "r1/b": f"{not_finished}: withdrawn from the queue, never written",
    }
    assert writer.flush(["r1"], 0.1) == lost
    assert writer.pending_rows() == 0  # nothing of r1 is left pending behind the report
    store.gate.set()  # the slow write lands after the report called it lost
    writer.submit("r2", "r2/a", {})
    assert writer.flush(["r2"], 5.0) == {}
    assert store.batches == [["r1/a"], ["r2/a"]]  # the withdrawn row was never written
    # The late landing changes nothing: both stay lost, neither can be a parent, neither seeded anything.
    assert writer.wait_keys(["r1/a", "r1/b"], 5.0) == ParentRows(lost, ())
    assert not writer.when_written("r1/a", lambda: seeded.append("late"))
    assert seeded == []
    assert writer.flush(["r1"], 5.0) == lost
    assert (writer.stats["abandoned_rows"], writer.stats["withdrawn_rows"], writer.stats["late_rows_landed"]) == (1, 1, 1)
    writer.close(5.0)


def test_when_written_runs_after_the_write_and_before_a_waiting_child_wakes() -> None:
    store = GatedStore()
    store.gate.clear()
    writer = _writer(store)
    seen: list[tuple[str, bool]] = []
    writer.submit("r1", "r1/a", {})
    assert store.entered.wait(5)
    assert writer.when_written("r1/a", lambda: seen.append(("cb", "r1/a" in store.rows)))
    threading.Timer(0.1, store.gate.set).start()
    assert writer.wait_keys(["r1/a"], 5.0) == ParentRows({}, ())
    seen.append(("woken", True))
    assert seen == [("cb", True), ("woken", True)]  # ran once the row was in the store, before the waiter woke
    assert writer.when_written("r1/a", lambda: seen.append(("now", True)))  # already written: runs at once
    assert seen[-1] == ("now", True)
    error = DataPlaneTimeoutError("put", "p", 5.0)
    store.gate.clear()
    store.fail_next.append(error)
    writer.submit("r1", "r1/b", {})
    assert writer.when_written("r1/b", lambda: seen.append(("never", True)))  # pending: registered
    store.gate.set()
    writer.flush(["r1"], 5.0)
    assert not writer.when_written("r1/b", lambda: seen.append(("never", True)))  # lost: never runs
    assert not writer.when_written("other/x", lambda: seen.append(("never", True)))  # unvouched: never runs
    assert ("never", True) not in seen
    writer.close(5.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the bug surfaces there
def test_a_bug_in_a_when_written_callback_stops_the_writer() -> None:
    store = GatedStore()
    writer = _writer(store)
    writer.submit("r1", "r1/a", {})
    writer.flush(["r1"], 5.0)

    def broken() -> None:
        raise KeyError("seed")

    store.gate.clear()
    writer.submit("r1", "r1/b", {})
    assert store.entered.wait(5)
    assert writer.when_written("r1/b", broken)
    store.gate.set()
    writer.flush(["r1"], 5.0)
    with pytest.raises(DataPlaneBugError, match=r"stopped on KeyError: 'seed'") as stopped:
        writer.submit("r1", "r1/c", {})
    assert stopped.value.kind == "stage_writer"
    writer.close(5.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the bug surfaces there
def test_a_bug_in_the_write_fails_queued_rows_and_stops_the_writer() -> None:
    store = GatedStore()
    store.gate.clear()
    store.fail_next.append(KeyError("schema"))
    writer = _writer(store)
    writer.submit("r1", "r1/a", {})
    assert store.entered.wait(5)
    writer.submit("r1", "r1/b", {})  # queued behind the write that crashes
    store.gate.set()
    failures = writer.flush(["r1"], 5.0)
    assert failures == {"r1/a": "stage writer crashed: KeyError: 'schema'", "r1/b": "stage writer crashed: KeyError: 'schema'"}
    with pytest.raises(DataPlaneBugError, match=r"stopped on KeyError: 'schema'; staging key 'r1/c' was not queued") as stopped:
        writer.submit("r1", "r1/c", {})
    assert stopped.value.kind == "stage_writer"
    writer.close(5.0)  # joins the stopped thread, so its traceback is reported under this test


def test_remembered_failures_are_bounded_per_rollout() -> None:
    store = GatedStore()
    store.fail_next.extend(DataPlaneTimeoutError("put", "p", 5.0) for _ in range(3))
    writer = _writer(store, max_rollouts=2)
    for rollout in ("r1", "r2", "r3"):
        writer.submit(rollout, f"{rollout}/a", {})
        while writer.pending_rows():
            time.sleep(0.01)
    assert writer.flush(["r1"], 1.0) == {}  # evicted: the oldest failed rollout
    assert set(writer.flush(["r2", "r3"], 1.0)) == {"r2/a", "r3/a"}
    assert writer.stats["failures_evicted_rollouts"] == 1
    # Evicted is not written: the writer no longer vouches for r1/a, so a child must prove it by a read.
    assert writer.wait_keys(["r1/a", "r2/a"], 0.0) == ParentRows({"r2/a": writer.flush(["r2"], 0.0)["r2/a"]}, ("r1/a",))
    writer.close(5.0)


def test_close_writes_what_is_queued_then_refuses() -> None:
    store = GatedStore()
    store.gate.clear()
    writer = _writer(store)
    writer.submit("r", "r/a", {})
    assert store.entered.wait(5)
    writer.submit("r", "r/b", {})
    threading.Timer(0.1, store.gate.set).start()
    writer.close(5.0)
    assert store.batches == [["r/a"], ["r/b"]]
    with pytest.raises(DataPlaneBugError, match="is closed; 'r/c' not queued") as closed:
        writer.submit("r", "r/c", {})
    assert closed.value.kind == "stage_writer"


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"timeout_s=0: must be > 0 \(token_capture.stage_timeout_s\)"):
        StageWriter(GatedStore(), "p", timeout_s=0)
    with pytest.raises(ValueError, match="max_batch=0, max_rollouts=1, max_written_keys=65536: all must be >= 1"):
        StageWriter(GatedStore(), "p", timeout_s=1.0, max_batch=0, max_rollouts=1)


def test_wait_keys_waits_for_this_writers_keys_only_and_names_the_lost_and_the_unvouched() -> None:
    store = GatedStore()
    store.gate.clear()
    writer = _writer(store, max_written_keys=2)
    writer.submit("r1", "r1/a", {})
    assert store.entered.wait(5)
    started = time.monotonic()
    assert writer.wait_keys(["other/x"], 5.0) == ParentRows({}, ("other/x",))  # never queued here: not waited for
    assert time.monotonic() - started < 5.0  # a wait would have lasted its whole 5 s deadline (r1/a is gated)
    assert writer.wait_keys(["r1/a"], 0.1) == ParentRows(
        {"r1/a": "staging write not finished within token_capture.stage_timeout_s=0.1s"}, ())
    threading.Timer(0.2, store.gate.set).start()
    assert writer.wait_keys(["r1/a", "other/x"], 5.0) == ParentRows({}, ("other/x",))  # r1/a written: vouched
    error = DataPlaneTimeoutError("put", "p", 5.0)
    store.fail_next.append(error)
    writer.submit("r1", "r1/b", {})
    lost = {"r1/b": f"staging write failed: DataPlaneTimeoutError: {error}"}
    assert writer.wait_keys(["r1/a", "r1/b"], 5.0) == ParentRows(lost, ())
    assert writer.flush(["r1"], 5.0) == lost  # still reported by the served-report barrier
    assert writer.wait_keys(["r1/b"], 0.0) == ParentRows(lost, ())  # and still lost after the report took it
    for key in ("r1/c", "r1/d"):  # two more written keys push r1/a out of the written memory (bound 2)
        writer.submit("r1", key, {})
    writer.flush(["r1"], 5.0)
    assert writer.wait_keys(["r1/a", "r1/d"], 0.0) == ParentRows({}, ("r1/a",))
    assert writer.stats["parent_waits"] == 6
    writer.close(5.0)
