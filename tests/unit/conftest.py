"""Test support: real, verifiable staged-call chains built with Gym's own worker capture core.

Tests reach these helpers through the session fixture `chains` (pytest runs with
--import-mode=importlib, so test modules cannot import a sibling helper module). They live at
tests/unit so the judge's (token_capture), the staging (data_plane) and the finalizer's
(experience) tests share one set.

`build_chain` drives `RolloutTokenCapture` exactly like a worker does (text root, then token_in
children whose prefix is the parent's full sequence) into an in-memory sink, and turns each
commit into the manifest `CallRecord` the gate would write. The snapshots therefore carry real
digests, chain hashes and cumulative hashes that `verify_and_linearize` accepts.

Real Ray and TransferQueue start once per session (`shared_ray`, `shared_plane`; `clients` attaches
to them per module), and the modules that use them run last, together (`pytest_collection_modifyitems`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from nemo_gym.token_id_capture.staging import (
    CallRecord,
    CaptureAdmission,
    RolloutTokenCapture,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StageResult,
)
from nemo_gym.token_id_capture.staging.records import ManifestFailure, RolloutManifest

from nemo_rl.data_plane import DataPlane, DataPlaneClient, DataPlaneConfig, attach_client, start_data_plane
from nemo_rl.distributed.ray_cluster import RayClusterHandle, init_local_ray

TQ_TEST_CONFIG = DataPlaneConfig(call_timeout_s=10.0)
SHARED_RAY = "shared_ray"  # the session fixture whose modules run last (pytest_collection_modifyitems)


class MemorySink:
    """A single-process StagingSink: keeps every staged record by key."""

    def __init__(self) -> None:
        self.records: dict[str, StagedCallRecord] = {}

    def stage(self, record: StagedCallRecord, *, attachments: Mapping[str, Any] | None = None) -> StageResult:
        self.records[record.staging_key] = record
        return StageResult(ok=True, staging_key=record.staging_key)


@dataclass(frozen=True)
class Turn:
    """One model call: the new prompt tokens after the parent's sequence, then the sampled tokens."""

    prompt_tail: tuple[int, ...]
    generated: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Chain:
    rollout_id: str
    records: tuple[CallRecord, ...]
    staged: tuple[StagedCallRecord, ...]  # what the worker staged, same order as records
    snapshots: tuple[StagedCallBaseSnapshot, ...]  # the staged base snapshots, same order
    full_sequence: tuple[int, ...]  # the terminal call's prompt + generation

    @property
    def terminal(self) -> CallRecord:
        return self.records[-1]

    def manifest(self, failures: Sequence[ManifestFailure] = ()) -> RolloutManifest:
        return RolloutManifest(rollout_id=self.rollout_id, records=list(self.records), failures=list(failures))


DEFAULT_TURNS = (
    Turn(prompt_tail=(11, 12, 13, 14), generated=(21, 22, 23), logprobs=(-0.5, -0.25, -0.125)),
    Turn(prompt_tail=(31, 32), generated=(41, 42), logprobs=(-1.0, -0.75)),
)


def build_chain(
    rollout_id: str,
    turns: Sequence[Turn] = DEFAULT_TURNS,
    *,
    call_prefix: str = "call",
    weight_version: int = 3,
    admitted_at_base: float = 100.0,
) -> Chain:
    """Stage `turns` as root -> token_in -> ... and return manifest rows plus snapshots."""
    sink = MemorySink()
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: weight_version)
    records: list[CallRecord] = []
    sequence: list[int] = []
    parent: CallRecord | None = None
    for index, turn in enumerate(turns):
        call_id = f"{call_prefix}{index}"
        if parent is None:
            admission = CaptureAdmission(rollout_id=rollout_id, model_call_id=call_id, mode="text")
        else:
            admission = CaptureAdmission(
                rollout_id=rollout_id,
                model_call_id=call_id,
                parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len,
                mode="token_in",
                staging_chain=[record.staging_key for record in records],
                parent_chain_hash=parent.chain_hash,
            )
        call = capture.begin_call(admission, prefix_token_ids=list(sequence) if parent else None)
        prompt = sequence + list(turn.prompt_tail)
        coords = capture.complete_call(
            call, prompt_token_ids=prompt, generated_token_ids=list(turn.generated),
            generated_logprobs=list(turn.logprobs),
        )
        assert coords.disposition == "staged", coords
        parent = CallRecord(
            model_call_id=call_id,
            parent_call_id=admission.parent_call_id,
            prev_len=coords.prev_len,
            delta_len=coords.delta_len,
            cum_len=coords.cum_len,
            weight_version=coords.weight_version,
            digest=coords.digest,
            extras_digest=coords.extras_digest,
            staging_key=coords.staging_key,
            mode=admission.mode,
            chain_hash=coords.chain_hash,
            cumulative_hash=coords.cumulative_hash,
            response_id=f"chatcmpl-{rollout_id}-{call_id}",
            admitted_at=admitted_at_base + index,
        )
        records.append(parent)
        sequence = prompt + list(turn.generated)
    staged = tuple(sink.records[record.staging_key] for record in records)
    snapshots = tuple(StagedCallBaseSnapshot.model_validate(r.model_dump(exclude={"extras"})) for r in staged)
    return Chain(rollout_id, tuple(records), staged, snapshots, tuple(sequence))


def run_result(reward: float | None = 1.0, response_id: str | None = None) -> dict[str, Any]:
    """A `/run` result as Gym returns it in capture mode: no token fields, the scored response."""
    response: dict[str, Any] = {"output": []}
    if response_id is not None:
        response["id"] = response_id
    result: dict[str, Any] = {"response": response, "mask_sample": False}
    if reward is not None:
        result["reward"] = reward
    return result


@pytest.fixture(scope="session")
def chains() -> SimpleNamespace:
    """`chains.build(...)`, `chains.Turn(...)`, `chains.run_result(...)`, `chains.MemorySink()`."""
    return SimpleNamespace(build=build_chain, Turn=Turn, run_result=run_result, MemorySink=MemorySink)


# --- forests: several roots, siblings under one parent, retries, compaction ---------------------


@dataclass(frozen=True)
class Call:
    """One call of a forest: `parent=None` is a text root, else a token_in child of `parent`."""

    call_id: str
    parent: str | None
    turn: Turn
    weight_version: int = 3


@dataclass(frozen=True)
class Tree:
    """A rollout's staged forest, built exactly like `build_chain` (real digests and hashes)."""

    rollout_id: str
    records: tuple[CallRecord, ...]  # manifest order (the order of the given calls)
    snapshots: tuple[StagedCallBaseSnapshot, ...]  # same order
    sequences: dict[str, tuple[int, ...]]  # call id -> its full sequence (prompt + generation)
    calls: dict[str, Call]

    @property
    def by_id(self) -> dict[str, CallRecord]:
        return {record.model_call_id: record for record in self.records}

    @property
    def snapshots_by_key(self) -> dict[str, StagedCallBaseSnapshot]:
        return {snapshot.staging_key: snapshot for snapshot in self.snapshots}

    def snapshot(self, call_id: str) -> StagedCallBaseSnapshot:
        return next(s for s in self.snapshots if s.model_call_id == call_id)

    def manifest(self, failures: Sequence[ManifestFailure] = (), records: Sequence[CallRecord] | None = None
                 ) -> RolloutManifest:
        chosen = self.records if records is None else records
        return RolloutManifest(rollout_id=self.rollout_id, records=list(chosen), failures=list(failures))

    def served(self, **overrides: Any) -> list[Any]:
        """The workers' served report for every committed call (staged, generated = len(turn.generated))."""
        from nemo_rl.data.calls import ServedCall

        return [
            ServedCall(self.rollout_id, call.call_id, call.parent, "text" if call.parent is None else "token_in",
                       len(call.turn.generated), True, **overrides)
            for call in self.calls.values()
        ]


def build_tree(rollout_id: str, calls: Sequence[Call], *, admitted_at_base: float = 100.0) -> Tree:
    """Stage every call of a forest (parents listed before children) through one RolloutTokenCapture."""
    sink = MemorySink()
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 0)
    records: dict[str, CallRecord] = {}
    sequences: dict[str, tuple[int, ...]] = {}
    chains_: dict[str, list[str]] = {}  # call id -> staging chain including itself
    for index, spec in enumerate(calls):
        parent = records.get(spec.parent) if spec.parent is not None else None
        if spec.parent is not None and parent is None:
            raise ValueError(f"{spec.call_id}: parent {spec.parent} must be listed (and staged) first")
        if parent is None:
            admission = CaptureAdmission(rollout_id=rollout_id, model_call_id=spec.call_id, mode="text")
            prefix: list[int] = []
        else:
            admission = CaptureAdmission(
                rollout_id=rollout_id, model_call_id=spec.call_id, parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len, mode="token_in", staging_chain=list(chains_[parent.model_call_id]),
                parent_chain_hash=parent.chain_hash,
            )
            prefix = list(sequences[parent.model_call_id])
        active = capture.begin_call(admission, prefix_token_ids=prefix if parent else None,
                                    weight_version=spec.weight_version)
        prompt = prefix + list(spec.turn.prompt_tail)
        coords = capture.complete_call(active, prompt_token_ids=prompt, generated_token_ids=list(spec.turn.generated),
                                       generated_logprobs=list(spec.turn.logprobs))
        assert coords.disposition == "staged", coords
        record = CallRecord(
            model_call_id=spec.call_id, parent_call_id=admission.parent_call_id, prev_len=coords.prev_len,
            delta_len=coords.delta_len, cum_len=coords.cum_len, weight_version=coords.weight_version,
            digest=coords.digest, extras_digest=coords.extras_digest, staging_key=coords.staging_key,
            mode=admission.mode, chain_hash=coords.chain_hash, cumulative_hash=coords.cumulative_hash,
            response_id=f"chatcmpl-{rollout_id}-{spec.call_id}", admitted_at=admitted_at_base + index,
        )
        records[spec.call_id] = record
        sequences[spec.call_id] = tuple(prompt + list(spec.turn.generated))
        chains_[spec.call_id] = ([] if parent is None else chains_[parent.model_call_id]) + [coords.staging_key]
    ordered = tuple(records[spec.call_id] for spec in calls)
    snapshots = tuple(
        StagedCallBaseSnapshot.model_validate(sink.records[r.staging_key].model_dump(exclude={"extras"}))
        for r in ordered
    )
    return Tree(rollout_id, ordered, snapshots, sequences, {spec.call_id: spec for spec in calls})


@pytest.fixture(scope="session")
def trees() -> SimpleNamespace:
    """`trees.build(rollout_id, [trees.Call(...), ...])`, `trees.Call`, `trees.Turn`, `trees.run_result`."""
    return SimpleNamespace(build=build_tree, Call=Call, Turn=Turn, run_result=run_result)


@pytest.fixture(scope="session")
def shared_ray() -> Iterator[RayClusterHandle]:
    """One private Ray cluster (2 CPUs) for every unit module that needs Ray; see `SHARED_RAY`."""
    cluster = init_local_ray(num_cpus=2)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="session")
def shared_plane(shared_ray: RayClusterHandle) -> Iterator[DataPlane]:
    """One real TransferQueue (`TQ_TEST_CONFIG`) on `shared_ray`, started once (~11-14 s) for every
    module that stages rows; each module keeps to partitions of its own name, so tests stay independent."""
    plane = start_data_plane(TQ_TEST_CONFIG)
    try:
        yield plane
    finally:
        plane.shutdown()


@pytest.fixture(scope="module")
def clients(shared_plane: DataPlane) -> Iterator[tuple[DataPlaneClient, DataPlaneClient]]:
    """The worker's writer client and the finalizer's reader client on the shared data plane (two
    attachments, as in a run)."""
    with attach_client(TQ_TEST_CONFIG) as writer, attach_client(TQ_TEST_CONFIG) as reader:
        yield writer, reader


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the modules that use `shared_ray` to the end of the session, together, in their order.

    Ray runs once per process: a module that starts its own cluster (`test_ray_cluster.py`) must
    not run while the shared one is up, and the shared one stops only at the session's end.
    """
    shared = {item.path for item in items if SHARED_RAY in item.fixturenames}
    items.sort(key=lambda item: item.path in shared)  # stable: every other order is kept
