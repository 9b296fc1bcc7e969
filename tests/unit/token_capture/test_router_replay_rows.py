"""R3 routes beside each row: `judge_from_source` over a real TransferQueue data plane.

Chains are staged by Gym's own worker capture core (`RolloutTokenCapture`) into the real
`TQTokenSink`, with synthetic `routed_experts` extras; the finalizer path (`judge_from_source`
with a `TQTokenSource`) must attach exactly the expected int16 `[len, L, K]` array to each row.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from nemo_gym.token_id_capture.staging import (
    EMPTY_EXTRAS_DIGEST,
    CallRecord,
    CaptureAdmission,
    RolloutTokenCapture,
    compute_extras_digest,
    encode_routed_experts,
)
from nemo_gym.token_id_capture.staging.records import RolloutManifest

from nemo_rl.data.errors import RecordInvariantError
from nemo_rl.data.rows import (
    GroupResult,
    KeptRollout,
    Placeholder,
    PlaceholderReason,
    RowOrigin,
    TrainRow,
)
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig
from nemo_rl.data_plane.partitions import TQTokenSink, TQTokenSource
from nemo_rl.experience.finalizer_pool import judge_from_source
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RolloutEvidence
from nemo_rl.token_capture.metrics import finalize_metrics

S = -1  # the sentinel
PARTITION = "router_replay_rows_test"
CFG = DataPlaneConfig(call_timeout_s=10.0)
CAPTURE = TokenCaptureConfig(enabled=True)


def routes(first: int, tokens: int, layers: int = 2, topk: int = 2) -> list[list[list[int]]]:
    """Distinct, readable expert ids: token t, layer l, slot k -> first + 100*t + 10*l + k."""
    return [[[first + 100 * t + 10 * l + k for k in range(topk)] for l in range(layers)] for t in range(tokens)]


def blank(tokens: int) -> list[list[list[int]]]:
    return [[[S, S], [S, S]] for _ in range(tokens)]



@dataclass(frozen=True)
class Call:
    """One model call: a text root (`parent=None`) or a token_in child; extras as the worker stages them."""

    call_id: str
    parent: str | None
    prompt_tail: tuple[int, ...]
    generated: tuple[int, ...]
    extras: dict[str, Any] | None = None


class CountingSource:
    """The real source, recording every extras fetch (and optionally acting just before it)."""

    def __init__(self, inner: TQTokenSource, before_extras: Callable[[list[str]], None] | None = None) -> None:
        self.inner = inner
        self.before_extras = before_extras
        self.extras_calls: list[tuple[list[str], list[str] | None]] = []

    def fetch(self, staging_keys: list[str]) -> Any:
        return self.inner.fetch(staging_keys)

    def fetch_extras(self, staging_keys: list[str], expected_extras_digests: Sequence[str] | None = None) -> Any:
        self.extras_calls.append(
            (list(staging_keys), None if expected_extras_digests is None else list(expected_extras_digests))
        )
        if self.before_extras is not None:
            self.before_extras(list(staging_keys))
        return self.inner.fetch_extras(staging_keys, expected_extras_digests=expected_extras_digests)


class BaseOnlySource:
    """A `SnapshotSource` without `fetch_extras` (e.g. a test double)."""

    def __init__(self, inner: TQTokenSource) -> None:
        self.inner = inner

    def fetch(self, staging_keys: list[str]) -> Any:
        return self.inner.fetch(staging_keys)


def stage(sink: TQTokenSink, rollout: str, calls: Sequence[Call]) -> list[CallRecord]:
    """Stage `calls` (parents first) like a worker does and return the gate's manifest records."""
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 1)
    records: dict[str, CallRecord] = {}
    sequences: dict[str, list[int]] = {}
    staging_chains: dict[str, list[str]] = {}
    for index, call in enumerate(calls):
        parent = records.get(call.parent) if call.parent is not None else None
        if parent is None:
            admission = CaptureAdmission(rollout_id=rollout, model_call_id=call.call_id, mode="text")
            prefix: list[int] = []
        else:
            admission = CaptureAdmission(
                rollout_id=rollout, model_call_id=call.call_id, parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len, mode="token_in", staging_chain=list(staging_chains[parent.model_call_id]),
                parent_chain_hash=parent.chain_hash,
            )
            prefix = list(sequences[parent.model_call_id])
        active = capture.begin_call(admission, prefix_token_ids=prefix if parent is not None else None)
        prompt = prefix + list(call.prompt_tail)
        coords = capture.complete_call(
            active, prompt_token_ids=prompt, generated_token_ids=list(call.generated),
            generated_logprobs=[-0.5 - t for t in range(len(call.generated))], extras=call.extras,
        )
        assert coords.disposition == "staged", coords
        record = CallRecord(
            **coords.model_dump(exclude={"disposition", "rollout_id"}), mode=admission.mode,
            response_id=f"resp-{rollout}-{call.call_id}", admitted_at=100.0 + index,
        )
        assert record.extras_digest == compute_extras_digest(call.extras)
        records[call.call_id] = record
        sequences[call.call_id] = prompt + list(call.generated)
        staging_chains[call.call_id] = ([] if parent is None else staging_chains[parent.model_call_id]) + [
            record.staging_key
        ]
    return [records[call.call_id] for call in calls]


def evidence(rollout: str, records: Sequence[CallRecord], terminal: str, sample_index: int = 0) -> RolloutEvidence:
    terminal_record = next(r for r in records if r.model_call_id == terminal)
    return RolloutEvidence(
        rollout_id=rollout, group_index=0, sample_index=sample_index,
        run_result={"reward": 1.0, "response": {"id": terminal_record.response_id}},
        run_failure=None, manifest=RolloutManifest(rollout_id=rollout, records=list(records), failures=[]),
        manifest_problem=None, served=None,
    )


def new_rollout(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


# --- scenarios (each stages a fresh rollout and judges it through the real path) ----------------

CHAIN_ROOT_ROUTES = routes(10, 5)  # the root's whole delta: 3 prompt + 2 generated tokens
CHAIN_CHILD_ROUTES = routes(20, 1)  # the child's generated token only (its 2 carry tokens: sentinel)
CHAIN_EXPECTED = np.array(CHAIN_ROOT_ROUTES + blank(2) + CHAIN_CHILD_ROUTES, dtype=np.int16)


def routed_chain(sink: TQTokenSink, rollout: str) -> tuple[RolloutEvidence, list[CallRecord]]:
    records = stage(sink, rollout, [
        Call("c1", None, (1, 2, 3), (4, 5), {"routed_experts": encode_routed_experts(CHAIN_ROOT_ROUTES)}),
        Call("c2", "c1", (6, 7), (8,), {"routed_experts": CHAIN_CHILD_ROUTES}),
    ])
    return evidence(rollout, records, "c2"), records


BRANCH_ROOT_ROUTES = routes(30, 2)  # generated tokens only
BRANCH_C2_ROUTES = routes(40, 3)  # c2's whole delta (1 carry + 2 generated)


def routed_branches(sink: TQTokenSink, rollout: str, sample_index: int = 0) -> tuple[RolloutEvidence, list[CallRecord]]:
    """r -> c2 (terminal, scored) and r -> c3 -> c4 (a fork the harness continued, without extras):
    two rows sharing r. (A sibling no later call continued would be an abandoned retry: no row.)"""
    records = stage(sink, rollout, [
        Call("r", None, (1, 2, 3), (4, 5), {"routed_experts": BRANCH_ROOT_ROUTES}),
        Call("c2", "r", (6,), (7, 8), {"routed_experts": encode_routed_experts(BRANCH_C2_ROUTES, dtype="int32")}),
        Call("c3", "r", (9,), (10,)),
        Call("c4", "c3", (11,), (12,)),
    ])
    return evidence(rollout, records, "c2", sample_index), records


def plain_chain(sink: TQTokenSink, rollout: str, sample_index: int = 0) -> tuple[RolloutEvidence, list[CallRecord]]:
    records = stage(sink, rollout, [Call("c1", None, (1, 2), (3,)), Call("c2", "c1", (4,), (5, 6))])
    return evidence(rollout, records, "c2", sample_index), records


def tamper(reader: DataPlaneClient, writer: DataPlaneClient, key: str, forged: dict[str, Any], *,
           rewrite_header_digest: bool = False) -> None:
    """Overwrite a staged row's extras (and optionally its header's extras_digest) in TQ."""
    (stored,) = reader.get(PARTITION, [key], ["header", "extras"])
    (tokens,) = reader.get(PARTITION, [key], ["token_ids_delta", "token_mask_delta", "generation_log_probs_delta"])
    header = stored["header"]
    if rewrite_header_digest:
        parsed = json.loads(header)
        parsed["extras_digest"] = compute_extras_digest(forged)
        header = json.dumps(parsed)
    writer.put(PARTITION, key, {**tokens, "header": header, "extras": json.dumps(forged)})


def io(clients: tuple[DataPlaneClient, DataPlaneClient]) -> tuple[TQTokenSink, TQTokenSource]:
    writer, reader = clients
    return TQTokenSink(writer, PARTITION), TQTokenSource(reader, PARTITION)


# --- tests --------------------------------------------------------------------------------------


def test_two_call_chain_gets_its_exact_routes_in_one_digest_bound_fetch(clients) -> None:
    sink, tq = io(clients)
    ev, records = routed_chain(sink, new_rollout("r3-chain"))
    source = CountingSource(tq)

    verdict = judge_from_source(source, ev, CAPTURE)

    assert isinstance(verdict, KeptRollout), verdict
    (row,) = verdict.rows
    assert row.token_ids == (1, 2, 3, 4, 5, 6, 7, 8)
    assert row.token_mask == (0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0)
    assert row.routed_experts.dtype == np.int16 and row.routed_experts.shape == (8, 2, 2)
    np.testing.assert_array_equal(row.routed_experts, CHAIN_EXPECTED)
    assert not row.routed_experts.flags.writeable
    # One round trip for the rollout, bound to the manifest's committed digests.
    assert source.extras_calls == [
        ([r.staging_key for r in records], [r.extras_digest for r in records])
    ]
    tq.clear([r.staging_key for r in records])


def test_branch_rows_use_the_staged_generation_length_not_the_masked_row(clients) -> None:
    sink, tq = io(clients)
    ev, records = routed_branches(sink, new_rollout("r3-branch"))
    source = CountingSource(tq)

    verdict = judge_from_source(source, ev, CAPTURE)

    assert isinstance(verdict, KeptRollout), verdict
    terminal_row, sibling_row = verdict.rows
    assert terminal_row.model_call_ids == ("r", "c2") and sibling_row.model_call_ids == ("r", "c3", "c4")
    # r is owned by the terminal row, so it is masked in the sibling row; its gen-only routes
    # still line up with its generated tokens there (the staged delta's mask decides, not the row's).
    assert sibling_row.token_mask == (0.0,) * 6 + (1.0, 0.0, 1.0)
    np.testing.assert_array_equal(
        terminal_row.routed_experts, np.array(blank(3) + BRANCH_ROOT_ROUTES + BRANCH_C2_ROUTES, dtype=np.int16)
    )
    np.testing.assert_array_equal(
        sibling_row.routed_experts, np.array(blank(3) + BRANCH_ROOT_ROUTES + blank(4), dtype=np.int16)
    )
    # r is shared by both rows but fetched once; c3 and c4 staged no extras and are not fetched.
    by_id = {r.model_call_id: r for r in records}
    assert source.extras_calls == [
        ([by_id["r"].staging_key, by_id["c2"].staging_key], [by_id["r"].extras_digest, by_id["c2"].extras_digest])
    ]
    tq.clear([r.staging_key for r in records])


def _no_router_replay(*args: Any) -> Any:
    raise AssertionError("a dense rollout must not reach router replay")


def test_chain_without_extras_keeps_none_and_makes_no_extras_fetch(clients, monkeypatch) -> None:
    sink, tq = io(clients)
    ev, records = plain_chain(sink, new_rollout("r3-plain"))
    assert {r.extras_digest for r in records} == {EMPTY_EXTRAS_DIGEST}
    assert ev.staged_extras() is False
    # A dense rollout never runs R3's code: router replay is off the default path.
    monkeypatch.setattr("nemo_rl.experience.finalizer_pool.attach_router_replay", _no_router_replay)
    source = CountingSource(tq)

    verdict = judge_from_source(source, ev, CAPTURE)

    assert isinstance(verdict, KeptRollout), verdict
    assert [row.routed_experts for row in verdict.rows] == [None]
    assert source.extras_calls == []
    # A source without fetch_extras is fine when no route is needed...
    assert judge_from_source(BaseOnlySource(tq), ev, CAPTURE) == verdict
    tq.clear([r.staging_key for r in records])


def test_source_without_fetch_extras_is_a_clear_error_when_routes_are_needed(clients) -> None:
    sink, tq = io(clients)
    ev, records = routed_chain(sink, new_rollout("r3-nosource"))
    assert ev.staged_extras() is True
    with pytest.raises(TypeError, match="has no fetch_extras"):
        judge_from_source(BaseOnlySource(tq), ev, CAPTURE)
    tq.clear([r.staging_key for r in records])


def test_extras_without_routed_experts_leave_the_row_without_routes(clients) -> None:
    sink, tq = io(clients)
    rollout = new_rollout("r3-media")
    records = stage(sink, rollout, [Call("c1", None, (1, 2), (3, 4), {"media_spans": []})])
    source = CountingSource(tq)

    verdict = judge_from_source(source, evidence(rollout, records, "c1"), CAPTURE)

    assert isinstance(verdict, KeptRollout), verdict
    assert verdict.rows[0].routed_experts is None
    assert len(source.extras_calls) == 1  # non-empty extras had to be read to know
    tq.clear([r.staging_key for r in records])


def test_tampered_extras_make_the_rollout_a_verification_failed_placeholder(clients) -> None:
    writer, reader = clients
    sink, tq = io(clients)
    forged = {"routed_experts": encode_routed_experts(routes(11, 5))}

    # Extras rewritten under the stored header: the staged extras_digest no longer matches.
    ev, records = routed_chain(sink, new_rollout("r3-tamper"))
    tamper(reader, writer, records[0].staging_key, forged)
    verdict = judge_from_source(tq, ev, CAPTURE)
    assert isinstance(verdict, Placeholder), verdict
    assert verdict.reason is PlaceholderReason.VERIFICATION_FAILED
    assert verdict.detail.startswith("router_replay_extras: ExtrasDigestMismatchError")
    assert "does not match the staged extras_digest" in verdict.detail
    assert records[0].staging_key in verdict.detail
    # The slot, reward and terminal selection of the kept rollout it replaces.
    assert (verdict.rollout_id, verdict.group_index, verdict.sample_index) == (ev.rollout_id, 0, 0)
    assert (verdict.reward, verdict.terminal_selection) == (1.0, "response_id")
    assert verdict.yield_ is not None and verdict.yield_.kept_generated_tokens == 0

    tq.clear([r.staging_key for r in records])

    # A forger who also rewrites the header's extras_digest breaks the base record's digest, so
    # the judge's own snapshot verification rejects the chain before any route is read.
    ev, records = routed_chain(sink, new_rollout("r3-forge"))
    tamper(reader, writer, records[1].staging_key, forged, rewrite_header_digest=True)
    source = CountingSource(tq)
    verdict = judge_from_source(source, ev, CAPTURE)
    assert isinstance(verdict, Placeholder), verdict
    assert verdict.reason is PlaceholderReason.VERIFICATION_FAILED
    assert "invalid_staged_record" in verdict.detail and source.extras_calls == []
    tq.clear([r.staging_key for r in records])

    # The same forgery landing after the base fetch (a race) still fails the manifest's commitment.
    ev, records = routed_chain(sink, new_rollout("r3-race"))

    def forge(keys: list[str]) -> None:
        tamper(reader, writer, records[1].staging_key, forged, rewrite_header_digest=True)

    verdict = judge_from_source(CountingSource(tq, before_extras=forge), ev, CAPTURE)
    assert isinstance(verdict, Placeholder), verdict
    assert verdict.reason is PlaceholderReason.VERIFICATION_FAILED
    assert verdict.detail.startswith("router_replay_extras: ExtrasDigestMismatchError")
    assert "committed extras_digest" in verdict.detail
    tq.clear([r.staging_key for r in records])


def test_malformed_routes_and_vanished_extras_are_typed_verdicts(clients) -> None:
    sink, tq = io(clients)
    # Digest-consistent but not a routed-experts fragment.
    rollout = new_rollout("r3-junk")
    records = stage(sink, rollout, [Call("c1", None, (1, 2), (3,), {"routed_experts": "not-an-envelope"})])
    verdict = judge_from_source(tq, evidence(rollout, records, "c1"), CAPTURE)
    assert isinstance(verdict, Placeholder), verdict
    assert verdict.reason is PlaceholderReason.VERIFICATION_FAILED
    assert verdict.detail.startswith("router_replay_extras: RouterReplayError[decode]: call 'c1': routed_experts is not a valid fragment: ")
    tq.clear([r.staging_key for r in records])

    # The staged rows vanish between the base fetch and the extras fetch (e.g. cleared early).
    ev, records = routed_chain(sink, new_rollout("r3-vanish"))
    source = CountingSource(tq, before_extras=tq.clear)
    verdict = judge_from_source(source, ev, CAPTURE)
    assert isinstance(verdict, Placeholder), verdict
    assert verdict.reason is PlaceholderReason.STAGED_RECORD_MISSING
    assert verdict.detail.startswith("router_replay_extras: StagedKeysMissingError")


def test_all_unusable_fragments_give_an_all_sentinel_row(clients) -> None:
    sink, tq = io(clients)
    rollout = new_rollout("r3-short")
    # 3 generated tokens but a 2-token fragment: Gym's `sentinel` span mode.
    records = stage(sink, rollout, [Call("c1", None, (1,), (2, 3, 4), {"routed_experts": routes(0, 2, layers=3)})])
    verdict = judge_from_source(tq, evidence(rollout, records, "c1"), CAPTURE)
    assert isinstance(verdict, KeptRollout), verdict
    np.testing.assert_array_equal(verdict.rows[0].routed_experts, np.full((4, 3, 2), S, dtype=np.int16))
    tq.clear([r.staging_key for r in records])


def test_step_metrics_count_route_coverage_exactly(clients) -> None:
    writer, reader = clients
    sink, tq = io(clients)
    chain_ev, chain_records = routed_chain(sink, new_rollout("r3-m-chain"))
    branch_ev, branch_records = routed_branches(sink, new_rollout("r3-m-branch"), sample_index=1)
    plain_ev, plain_records = plain_chain(sink, new_rollout("r3-m-plain"), sample_index=2)
    bad_ev, bad_records = routed_chain(sink, new_rollout("r3-m-bad"))
    bad_ev = dataclasses.replace(bad_ev, sample_index=3)
    tamper(reader, writer, bad_records[0].staging_key, {"routed_experts": routes(1, 5)})

    entries = tuple(judge_from_source(tq, ev, CAPTURE) for ev in (chain_ev, branch_ev, plain_ev, bad_ev))
    assert [type(e).__name__ for e in entries] == ["KeptRollout"] * 3 + ["Placeholder"]
    metrics = finalize_metrics([GroupResult(0, entries)], [])

    # chain: 3 loss tokens, all routed; carry 6, 7 are sentinel.
    # branch terminal row: 4 loss tokens routed; prompt 1, 2, 3 sentinel.
    # branch sibling row: its 2 loss tokens (c3, c4) have no route; 1, 2, 3, 9, 10, 11, 12 sentinel.
    # plain chain: 3 loss tokens, 6 tokens, no routes. The placeholder contributes no row.
    assert {k: v for k, v in metrics.items() if k.startswith("router_replay/")} == {
        "router_replay/coverage": 7 / 12,
        "router_replay/sentinel_tokens": float(2 + 3 + 7 + 6),
        "router_replay/rows_with_routes": 3.0,
    }
    for records in (chain_records, branch_records, plain_records, bad_records):
        tq.clear([r.staging_key for r in records])


def test_metrics_are_emitted_as_zeros_without_routes() -> None:
    metrics = finalize_metrics([], [])
    assert {k: v for k, v in metrics.items() if k.startswith("router_replay/")} == {
        "router_replay/coverage": 0.0,
        "router_replay/sentinel_tokens": 0.0,
        "router_replay/rows_with_routes": 0.0,
    }


# --- TrainRow.routed_experts invariants (pure) --------------------------------------------------


def _row(**overrides: Any) -> TrainRow:
    fields: dict[str, Any] = dict(
        rollout_id="r", group_index=0, sample_index=0, token_ids=(1, 2, 3), token_mask=(0.0, 1.0, 1.0),
        generation_logprobs=(0.0, -0.5, -0.25), reward=1.0, prompt_len=1, model_call_ids=("c1",),
        weight_versions=(1,), token_in_calls=0, text_root_calls=1, terminal_selection="declared",
        origin=RowOrigin.CAPTURE, call_spans=((0, 3),),
    )
    return TrainRow(**{**fields, **overrides})


def test_train_row_routes_validation_and_equality() -> None:
    routes_array = np.array(blank(1) + routes(0, 2), dtype=np.int16)
    row = _row(routed_experts=routes_array)
    assert not row.routed_experts.flags.writeable and routes_array.flags.writeable
    # Equality and hashing ignore the routes (ndarray == is elementwise and arrays are unhashable).
    assert row == _row(routed_experts=routes_array.copy()) == _row()
    assert hash(row) == hash(_row())
    assert dataclasses.replace(row, routed_experts=None).routed_experts is None
    for bad, match in [
        (routes_array.astype(np.int32), "int16 ndarray"),
        (routes_array[0], "int16 ndarray"),
        (routes_array.tolist(), "got list"),
        (routes_array[:2], r"shape \(2, 2, 2\) must be \(3, L >= 1, K >= 1\)"),
        (np.zeros((3, 0, 2), dtype=np.int16), "must be"),
        (np.full((3, 2, 2), -2, dtype=np.int16), "-1 is the sentinel"),
    ]:
        with pytest.raises(RecordInvariantError, match=match) as excinfo:
            _row(routed_experts=bad)
        assert excinfo.value.kind == "row"


def test_staged_routes_reach_the_policy_and_its_routers_replay_them(clients, tmp_path) -> None:
    """The trainer side end to end: routes staged like a worker (synthetic: the CPU engine cannot
    report them) -> finalizer judge -> train partition -> `read_train_batch` -> an MoE policy
    step that replays them. The routes are the policy's own free top-k except one (token, layer)."""
    import torch

    from nemo_rl.algorithms.grpo import ClippedPGLossFn
    from nemo_rl.algorithms.grpo_single_controller import build_train_batch
    from nemo_rl.data.train import TrainPlan
    from nemo_rl.data_plane.partitions import TrainRowCleaner, read_train_batch, store_many_rows
    from nemo_rl.experience.finalizer_pool import store_kept
    from nemo_rl.models.policy import LossConfig, PolicyConfig
    from nemo_rl.models.policy.worker import PolicyCore
    from tests.unit.models.policy.tiny_moe import EXPERTS, build_tiny_qwen3_moe, free_topk

    writer, reader = clients
    sink, tq = io(clients)
    core = PolicyCore(PolicyConfig(model_path=str(build_tiny_qwen3_moe(tmp_path / "moe")), router_replay="replay"))
    free = free_topk(core.model, torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), torch.ones(1, 8, dtype=torch.long))
    own = free[0].tolist()  # [8 tokens][2 layers][top-2]
    pair = own[3][0]
    changed = [row[:] for row in own[:5]]
    changed[3][0] = [pair[0], next(e for e in range(EXPERTS) if e not in pair)]  # token 3, layer 0 disagrees
    rollout = new_rollout("r3-policy")
    records = stage(sink, rollout, [
        Call("c1", None, (1, 2, 3), (4, 5), {"routed_experts": encode_routed_experts(changed)}),  # whole delta
        Call("c2", "c1", (6, 7), (8,), {"routed_experts": own[7:8]}),  # generated token only: 6, 7 sentinel
    ])
    partition = "router_replay_rows_test_train"
    ev = evidence(rollout, records, "c2")
    (kept,) = store_kept([ev], [judge_from_source(tq, ev, CAPTURE)],
                         lambda k: store_many_rows(writer, partition, k, 10.0, False))
    assert isinstance(kept, KeptRollout), kept
    plan = build_train_batch([GroupResult(0, (kept,))], normalize=False, train_partition=partition).rows
    assert isinstance(plan, TrainPlan)
    batch = read_train_batch(reader, plan, timeout_s=10.0)
    assert batch.routed_experts.shape == (1, 8, 2, 2)
    np.testing.assert_array_equal(batch.routed_experts[0], np.array(changed + blank(2) + own[7:8], dtype=np.int16))

    metrics = core.train_step(batch, ClippedPGLossFn.from_config(LossConfig()))
    assert metrics["router_replay/replayed_token_fraction"] == 12 / 16  # 6 of 8 tokens routed, 2 layers each
    assert metrics["router_replay/disagreement_fraction"] == 1 / 12
    TrainRowCleaner(writer, partition, 10.0).clear(list(plan.keys))
    tq.clear([r.staging_key for r in records])
