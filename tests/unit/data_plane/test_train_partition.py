"""Rows to the policy through the data plane: the finalizer's store, the driver's plan, the policy-side read.

The records and the codec are tested in tests/unit/data/test_train_rows.py. The last tests run
the real finalizer pool over a private Ray + TransferQueue and read back what it wrote with the
policy side's `read_train_batch`.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import ray
import torch

from nemo_rl.algorithms.grpo_single_controller import GRPOError, build_train_batch
from nemo_rl.data.errors import PolicyWorkerError
from nemo_rl.data.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason, RowOrigin, RowRef, TrainRow
from nemo_rl.data.train import FIELDS, TrainBatch, TrainPlan, train_key
from nemo_rl.data_plane import DataPlaneError, MissingKeysError
from nemo_rl.data_plane.partitions import (
    TQTokenSink,
    TQTokenSource,
    TrainRowCleaner,
    TrainRowDigestError,
    read_train_batch,
    store_many_rows,
    store_rows,
)
from nemo_rl.experience.finalizer_pool import (
    FinalizerPool,
    FinalizerWorker,
    TQSourceFactory,
    TQTrainRowsFactory,
    judge_from_source,
)
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RolloutEvidence
from nemo_rl.token_capture.metrics import finalize_metrics, first_call_prompt_records

from ..conftest import TQ_TEST_CONFIG

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = TokenCaptureConfig()
READY_TIMEOUT_S = 300.0


def _row(rid="r-0", sample=0, *, chain=0, reward=1.0, call="c0", routes=None, ids=(5, 6, 7, 8),
         lps=(-0.5, -0.25)) -> TrainRow:
    return TrainRow(
        rollout_id=rid, group_index=0, sample_index=sample, token_ids=ids, token_mask=(0.0, 0.0, 1.0, 1.0),
        generation_logprobs=(0.0, 0.0) + lps, reward=reward, prompt_len=2, model_call_ids=(call,),
        weight_versions=(3,), token_in_calls=0, text_root_calls=1, terminal_selection="response_id",
        origin=RowOrigin.CAPTURE, call_spans=((0, 4),), chain_index=chain, routed_experts=routes,
    )


def _kept(*rows: TrainRow) -> KeptRollout:
    first = rows[0]
    return KeptRollout(first.rollout_id, first.group_index, first.sample_index, rows, first.reward, "response_id")


class MemoryPlane:
    """`put_many` / `get` / `clear` / `list_keys` of a DataPlaneClient, in memory, counting puts."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.rows: dict[str, dict] = {}
        self.puts: list[list[str]] = []
        self.fail = fail

    def put_many(self, partition, keys, rows, *, timeout_s=None):
        if self.fail is not None:
            raise self.fail
        self.puts.append(list(keys))
        self.rows.update({f"{partition}:{k}": dict(r) for k, r in zip(keys, rows)})

    def get(self, partition, keys, fields, *, timeout_s=None):
        return [{f: self.rows[f"{partition}:{k}"][f] for f in fields} for k in keys]

    def clear(self, partition, keys, *, timeout_s=None):
        for k in keys:
            self.rows.pop(f"{partition}:{k}", None)

    def list_keys(self, partition, *, timeout_s=None):
        return [k.split(":", 1)[1] for k in self.rows if k.startswith(f"{partition}:")]


# --- finalizer side -> driver -> policy side (in memory) ------------------------------------------


def _stored_groups(plane: MemoryPlane, carry: bool = False) -> tuple[list[GroupResult], list[GroupResult]]:
    rollouts = [_kept(_row("r-0", 0, reward=1.0), _row("r-0", 0, chain=1, reward=1.0, call="c1")),
                _kept(_row("r-1", 1, reward=0.0, ids=(5, 6, 9, 10)))]
    whole = [GroupResult(0, tuple(rollouts))]
    slim = [GroupResult(0, tuple(store_rows(plane, "train", k, 1.0, carry) for k in rollouts))]
    return whole, slim


def test_store_rows_is_one_put_per_rollout_and_the_policy_reads_the_driver_batch_back():
    plane = MemoryPlane()
    whole, slim = _stored_groups(plane)
    assert plane.puts == [["r-0#0", "r-0#1"], ["r-1#0"]]
    legacy = build_train_batch(whole, normalize=True, train_partition="train")
    planned = build_train_batch(slim, normalize=True, train_partition="train")
    assert isinstance(planned.rows, TrainPlan) and planned.trainable and isinstance(legacy.rows, TrainBatch)
    assert planned.rows.partition == "train"
    assert planned.rows.keys == planned.train_keys == ("r-0#0", "r-0#1", "r-1#0")
    assert planned.rows.advantages == legacy.rows.advantages
    assert planned.rewards_mean == legacy.rewards_mean
    assert read_train_batch(plane, planned.rows) == legacy.rows
    # The driver's metrics are the same from references as from whole rows.
    assert finalize_metrics(slim, []) == finalize_metrics(whole, [])


def _routes(n: int, layers: int = 2, topk: int = 2, start: int = 0) -> "np.ndarray":
    routes = (np.arange(n * layers * topk, dtype=np.int16).reshape(n, layers, topk) + start) % 8
    routes[:2] = -1  # the prompt has no route
    return routes


def _routed_rollouts() -> list[KeptRollout]:
    return [_kept(_row("r-0", 0, routes=_routes(4)), _row("r-0", 0, chain=1, call="c1")),  # chain 1: no routes
            _kept(_row("r-1", 1, reward=0.0, ids=(5, 6, 9, 10), routes=_routes(4, start=3)))]


def _check_routed_batch(batch) -> None:
    assert batch.routed_experts.shape == (3, 4, 2, 2) and batch.routed_experts.dtype == np.int16
    assert np.array_equal(batch.routed_experts[0], _routes(4)) and (batch.routed_experts[0, :2] == -1).all()
    assert (batch.routed_experts[1] == -1).all()  # a row without routes: all sentinel
    assert np.array_equal(batch.routed_experts[2], _routes(4, start=3)) and batch.routed_experts[2, 2, 0, 0] == 3


def test_routes_reach_the_policy_batch_through_the_codec_as_the_driver_builds_them():
    plane = MemoryPlane()
    rollouts = _routed_rollouts()
    slim = [GroupResult(0, tuple(store_rows(plane, "train", k, 1.0, False) for k in rollouts))]
    legacy = build_train_batch([GroupResult(0, tuple(rollouts))], normalize=True, train_partition="train").rows
    _check_routed_batch(legacy)
    assert read_train_batch(plane, build_train_batch(slim, normalize=True, train_partition="train").rows) == legacy


def test_routes_through_the_real_data_plane(clients):
    writer, reader = clients
    rollouts = _routed_rollouts()
    refs = store_many_rows(writer, "train_rows_routes", rollouts, 10.0, False)
    plan = build_train_batch([GroupResult(0, tuple(refs))], normalize=True, train_partition="train_rows_routes").rows
    batch = read_train_batch(reader, plan, timeout_s=10.0)
    _check_routed_batch(batch)
    assert batch == build_train_batch([GroupResult(0, tuple(rollouts))], normalize=True, train_partition="x").rows
    TrainRowCleaner(writer, "train_rows_routes", 10.0).clear(list(plan.keys))


def test_a_tampered_row_is_refused_by_name():
    plane = MemoryPlane()
    _, slim = _stored_groups(plane)
    plan = build_train_batch(slim, normalize=True, train_partition="train").rows
    plane.rows["train:r-1#0"]["generation_logprobs"] = torch.tensor([0.0, 0.0, -0.5, -0.5], dtype=torch.float64)
    with pytest.raises(TrainRowDigestError, match=r"key 'r-1#0': payload digest [0-9a-f]{64} != [0-9a-f]{64}"):
        read_train_batch(plane, plan)
    assert issubclass(TrainRowDigestError, PolicyWorkerError)


def test_a_row_moved_under_another_key_is_refused_by_name():
    # r-0#0's payload (valid, digested) copied over r-1#0: its meta names r-0#0, so r-1#0's digest fails.
    plane = MemoryPlane()
    _, slim = _stored_groups(plane)
    plan = build_train_batch(slim, normalize=True, train_partition="train").rows
    plane.rows["train:r-1#0"] = dict(plane.rows["train:r-0#0"])
    with pytest.raises(TrainRowDigestError, match=r"key 'r-1#0': payload digest [0-9a-f]{64} != [0-9a-f]{64}"):
        read_train_batch(plane, plan)


def test_token_ids_stored_as_floats_are_a_digest_error_not_a_trained_row():
    # The data plane hands back token ids as float64 (5.0, 6.0, ... or 5.25): not the row the finalizer judged.
    plane = MemoryPlane()
    _, slim = _stored_groups(plane)
    plan = build_train_batch(slim, normalize=True, train_partition="train").rows
    plane.rows["train:r-1#0"]["token_ids"] = plane.rows["train:r-1#0"]["token_ids"].to(torch.float64) + 0.25
    with pytest.raises(TrainRowDigestError, match=r"key 'r-1#0': payload digest [0-9a-f]{64} != [0-9a-f]{64}"):
        read_train_batch(plane, plan)


def test_build_train_batch_refuses_a_step_of_rows_and_refs_mixed():
    plane = MemoryPlane()
    whole, slim = _stored_groups(plane)
    mixed = [GroupResult(0, (slim[0].entries[0], whole[0].entries[1]))]
    with pytest.raises(GRPOError, match="1 TrainRows and 2 RowRefs") as excinfo:
        build_train_batch(mixed, normalize=True, train_partition="train")
    assert excinfo.value.kind == "batch"


def test_first_call_prompts_come_from_refs_only_when_carried():
    whole, carried = _stored_groups(MemoryPlane(), carry=True)
    assert first_call_prompt_records(1, carried) == first_call_prompt_records(1, whole)
    _, bare = _stored_groups(MemoryPlane(), carry=False)
    with pytest.raises(ValueError, match="dump_first_call_prompt_ids"):
        first_call_prompt_records(1, bare)


def test_cleaner_clears_and_counts():
    plane = MemoryPlane()
    _stored_groups(plane)
    cleaner = TrainRowCleaner(plane, "train", 1.0)
    cleaner.clear(["r-0#0", "r-0#1"])
    assert cleaner.remaining() == ["r-1#0"]


def test_store_many_rows_is_one_put_for_several_rollouts_with_the_same_refs():
    rollouts = [_kept(_row("r-0", 0, reward=1.0), _row("r-0", 0, chain=1, reward=1.0, call="c1")),
                _kept(_row("r-1", 1, reward=0.0, ids=(5, 6, 9, 10)))]
    one_by_one, together = MemoryPlane(), MemoryPlane()
    singly = [store_rows(one_by_one, "train", k, 1.0, False) for k in rollouts]
    assert store_many_rows(together, "train", rollouts, 1.0, False) == singly
    # The refs carry each payload's digest, so equal refs mean equal stored payloads.
    assert together.puts == [["r-0#0", "r-0#1", "r-1#0"]] and sorted(together.rows) == sorted(one_by_one.rows)
    assert store_many_rows(together, "train", [], 1.0, False) == [] and len(together.puts) == 1  # nothing: no put


def test_a_failed_store_is_a_data_plane_placeholder(chains):
    chain = chains.build("r-s")
    item = RolloutEvidence("r-s", 0, 0, chains.run_result(1.0, chain.terminal.response_id), None, chain.manifest(),
                           None, None)

    class Source:
        def fetch(self, keys):
            return [{s.staging_key: s for s in chain.snapshots}[k] for k in keys]

    plane = MemoryPlane(fail=DataPlaneError("store down", kind="transport"))
    failing = FinalizerWorker(lambda: Source(), CFG, lambda: (lambda k: store_many_rows(plane, "train", k, 1.0, False)))
    result = failing.finalize(item).result
    assert isinstance(result, Placeholder)
    assert (result.reason, result.detail, result.reward) == (
        PlaceholderReason.DATA_PLANE_ERROR, "train_partition: DataPlaneError[transport]: store down", 1.0)
    kept = FinalizerWorker(lambda: Source(), CFG, lambda: (lambda k: store_many_rows(MemoryPlane(), "t", k, 1.0, False)))
    (ref,) = kept.finalize(item).result.rows
    assert isinstance(ref, RowRef) and ref.key == train_key("r-s", 0)


# --- the real data plane: what the finalizer actor wrote is what the policy side reads -------------


async def test_policy_side_reads_exactly_what_the_finalizer_actor_wrote(clients, chains):
    writer, reader = clients
    staging, train = "train_rows_test_staging", "train_rows_test_train"
    chain = chains.build("r-tq")
    item = RolloutEvidence("r-tq", 0, 0, chains.run_result(1.0, chain.terminal.response_id), None, chain.manifest(),
                           None, None)
    assert all(TQTokenSink(writer, staging).stage(record).ok for record in chain.staged)
    pool = FinalizerPool(1, TQSourceFactory(TQ_TEST_CONFIG, staging, timeout_s=10.0), call_timeout_s=120.0, cfg=CFG,
                         rows_factory=TQTrainRowsFactory(TQ_TEST_CONFIG, train, 10.0, carry_prompt_ids=False))
    try:
        await pool.wait_ready(READY_TIMEOUT_S)
        (outcome,) = await pool.finalize_group([item])
    finally:
        pool.shutdown()
    whole = judge_from_source(TQTokenSource(reader, staging, timeout_s=10.0), item, CFG)  # the same judge, rows kept whole
    assert isinstance(outcome.result, KeptRollout) and isinstance(whole, KeptRollout)
    (ref,) = outcome.result.rows
    assert isinstance(ref, RowRef) and ref.key == "r-tq#0" and ref.prompt_ids is None
    assert reader.list_keys(train) == ["r-tq#0"]

    slim = build_train_batch([GroupResult(0, (outcome.result,))], normalize=False, train_partition=train).rows
    expected = build_train_batch([GroupResult(0, (whole,))], normalize=False, train_partition=train).rows
    assert isinstance(slim, TrainPlan) and isinstance(expected, TrainBatch)
    assert read_train_batch(reader, slim) == expected
    assert expected.token_ids == (chain.full_sequence,)

    stored = reader.get(train, ["r-tq#0"], list(FIELDS))[0]
    tampered = dict(stored, token_ids=stored["token_ids"].clone())
    tampered["token_ids"][-1] += 1
    writer.put(train, "r-tq#0", tampered)
    with pytest.raises(TrainRowDigestError, match="'r-tq#0'"):
        read_train_batch(reader, slim)

    cleaner = TrainRowCleaner(writer, train, 10.0)
    cleaner.clear(list(slim.keys))
    assert cleaner.remaining() == []
    with pytest.raises(MissingKeysError):
        read_train_batch(reader, slim)
