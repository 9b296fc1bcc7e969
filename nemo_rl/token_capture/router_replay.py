"""Router replay (R3): a kept rollout's staged routed experts, shaped beside its training rows.

`attach_router_replay` (finalizer actor, after the judge keeps a rollout that staged extras) gives each row
whose calls committed to non-empty extras `routed_experts` (int16 `[len(row), L, K]`), from ONE
digest-bound `fetch_extras` per rollout through the source it is handed (no I/O of its own; no
extras, no round trip). Shaping is pure (`build_router_replay`: `[n_rows, max_len, L, K]` and
coverage; Gym's codec and span rule as is), with `MISSING_ROUTE_SENTINEL` (-1) wherever a token
has no usable route (counted, not raised). Invariant: an MoE never trains without its routes
silently: extras that cannot be fetched, fail their digest or are not route fragments (a
`RouterReplayError`) make the rollout a placeholder (`router_replay_extras: ...`;
the judge's `fetch_error_reason`); coverage counts real rows only.
See docs/design-docs/token-capture-receipts.md, "Router replay (R3)", "Routes beside the rows".
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
from nemo_gym.token_id_capture.adapters.vllm import ROUTED_EXPERTS_FIELD
from nemo_gym.token_id_capture.staging import (
    EMPTY_EXTRAS_DIGEST,
    MISSING_ROUTE_SENTINEL,
    CallRecord,
    StagedCallBaseSnapshot,
    classify_route_span,
    decode_routed_experts,
    routed_experts_token_count,
)

from nemo_rl.data.errors import FatalError, Kinded, RecoverableError, error_name
from nemo_rl.data.rows import GroupEntry, KeptRollout, Placeholder, PlaceholderReason, TrainRow
from nemo_rl.data.calls import StagingFetchError
from nemo_rl.token_capture.judge import RolloutEvidence, all_served_lost, fetch_error_reason

ROUTED_EXPERTS_KEY = ROUTED_EXPERTS_FIELD
SENTINEL = MISSING_ROUTE_SENTINEL
MAX_EXPERT_ID = int(np.iinfo(np.int16).max)


RouterReplayKind = Literal["decode", "shape_mismatch", "value", "shape_unknown"]
"""What is wrong with the route data: a call's `routed_experts` is not a Gym routed-experts
fragment; fragments disagree on the number of MoE layers (L) or the top-k width (K), or with the
L and K the caller named; an expert id is negative or does not fit int16; and, with its own class
(`attach_router_replay` catches it to fall back to the fragments' shape): no row carries a
usable route and the caller did not name L and K (`RouteShapeUnknownError`)."""


class RouterReplayError(Kinded, RecoverableError, ValueError):
    """Routed-expert extras cannot be shaped into a router-replay array: the engine's route data
    is at fault, so the rollout becomes a placeholder (`attach_router_replay`)."""

    KINDS = typing.get_args(RouterReplayKind)
    OWN_CLASS = MappingProxyType({"shape_unknown": "RouteShapeUnknownError"})
    kind: RouterReplayKind

    def __init__(self, message: str, *, kind: RouterReplayKind) -> None:
        super().__init__(message, kind=kind)


class RouteShapeUnknownError(RouterReplayError):
    """No row carries a usable route and the caller did not name L and K."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="shape_unknown")


class RouteSpanError(FatalError, ValueError):
    """A row's call spans do not describe the row (lengths disagree, or it exceeds max_len): our
    own bug, never the route data's, so not a `RouterReplayError`."""


def _decode_error(model_call_id: str, reason: str) -> RouterReplayError:
    return RouterReplayError(f"call {model_call_id!r}: routed_experts is not a valid fragment: {reason}", kind="decode")


@dataclass(frozen=True)
class CallRoutes:
    """One call of a row: its delta split (carry then generated tokens) and its raw route payload."""

    model_call_id: str
    carry_len: int
    gen_len: int
    routed_experts: Any | None = None

    def __post_init__(self) -> None:
        for name in ("carry_len", "gen_len"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise RouteSpanError(f"call {self.model_call_id!r}: {name} must be a non-negative int, got {value!r}")
        if self.carry_len + self.gen_len == 0:
            raise RouteSpanError(f"call {self.model_call_id!r}: a call contributes at least one token")

    @property
    def delta_len(self) -> int:
        return self.carry_len + self.gen_len


@dataclass(frozen=True)
class RowRoutes:
    """One verified training row: its calls root to terminal, and its loss mask (length = row length)."""

    calls: tuple[CallRoutes, ...]
    token_mask: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.calls:
            raise RouteSpanError("a row has at least one call")
        total = sum(call.delta_len for call in self.calls)
        if total != len(self.token_mask):
            raise RouteSpanError(
                f"calls {[c.model_call_id for c in self.calls]} span {total} tokens but the row has "
                f"{len(self.token_mask)}"
            )

    @property
    def length(self) -> int:
        return len(self.token_mask)


def routes_from_extras(extras: Mapping[str, Any] | None) -> Any | None:
    """The raw `routed_experts` value of one call's extras, or None when it carries none."""
    if extras is None:
        return None
    return extras.get(ROUTED_EXPERTS_KEY)


def row_routes(
    link_spans: Sequence[tuple[str, int, int]],
    extras: Sequence[Mapping[str, Any] | None],
    token_mask: Sequence[float],
) -> RowRoutes:
    """A `RowRoutes` from `LinearizedRow.link_spans`, the calls' extras (same order) and the row mask."""
    if len(link_spans) != len(extras):
        raise RouteSpanError(f"{len(extras)} extras for {len(link_spans)} calls")
    calls = tuple(
        CallRoutes(call_id, carry_len, gen_len, routes_from_extras(call_extras))
        for (call_id, carry_len, gen_len), call_extras in zip(link_spans, extras)
    )
    return RowRoutes(calls, tuple(float(m) for m in token_mask))


def decode_call_routes(model_call_id: str, payload: Any) -> np.ndarray:
    """One fragment as an int16 `[T, L, K]` array, validated by Gym's codec and the int16 id range."""
    try:
        fragment = decode_routed_experts(payload)
    except ValueError as e:
        raise _decode_error(model_call_id, str(e)) from e
    try:
        values = np.asarray(fragment.values, dtype=np.int64)
    except OverflowError as e:
        raise RouterReplayError(f"call {model_call_id!r}: an expert id does not fit int64", kind="value") from e
    if values.size and (values.min() < 0 or values.max() > MAX_EXPERT_ID):
        raise RouterReplayError(
            f"call {model_call_id!r}: expert ids must be in [0, {MAX_EXPERT_ID}], got "
            f"[{int(values.min())}, {int(values.max())}]",
            kind="value",
        )
    return values.astype(np.int16)


@dataclass(frozen=True)
class _Placement:
    """Where a decoded fragment lands: delta positions [start, stop) take fragment rows [src, src + stop - start)."""

    start: int
    stop: int
    src: int
    values: np.ndarray


def _placement(call: CallRoutes) -> tuple[str, _Placement | None]:
    """Gym's span mode for one call, plus the placement of its routes when they are used."""
    if call.routed_experts is None:
        return "none", None
    try:
        token_count = routed_experts_token_count(call.routed_experts)
    except ValueError as e:
        raise _decode_error(call.model_call_id, str(e)) from e
    mode = classify_route_span(carry_len=call.carry_len, generation_len=call.gen_len, staged_route_len=token_count)
    if mode == "sentinel":
        return mode, None
    values = decode_call_routes(call.model_call_id, call.routed_experts)
    if mode == "full":
        return mode, _Placement(0, call.delta_len, 0, values)
    return mode, _Placement(call.carry_len, call.delta_len, values.shape[0] - call.gen_len, values)


@dataclass(frozen=True)
class RouterReplayCoverage:
    """How much of a batch the routes cover (see the module contract for each count)."""

    rows: int
    placeholder_rows: int
    rows_with_routes: int
    loss_tokens: int
    covered_loss_tokens: int
    sentinel_tokens: int
    padding_tokens: int
    calls: int
    full_fragments: int
    tail_fragments: int
    unusable_fragments: int

    @property
    def coverage(self) -> float:
        return self.covered_loss_tokens / self.loss_tokens if self.loss_tokens else 0.0


@dataclass(frozen=True)
class RouterReplayBatch:
    """The int16 `[n_rows, max_len, L, K]` route array (sentinel -1 where uncovered) and its coverage."""

    routes: np.ndarray
    coverage: RouterReplayCoverage


def _shape(placed: Sequence[_Placement], num_layers: int | None, topk: int | None) -> tuple[int, int]:
    shapes = sorted({p.values.shape[1:] for p in placed})
    if num_layers is not None and topk is not None:
        shapes = sorted(set(shapes) | {(num_layers, topk)})
    if len(shapes) > 1:
        raise RouterReplayError(f"fragments disagree on (layers, topk): {shapes}", kind="shape_mismatch")
    if not shapes:
        raise RouteShapeUnknownError("no row carries a usable route; pass num_layers and topk to shape the batch")
    layers, width = shapes[0]
    if (num_layers is not None and layers != num_layers) or (topk is not None and width != topk):
        raise RouterReplayError(
            f"fragments have (layers, topk) {shapes[0]}, expected ({num_layers}, {topk})", kind="shape_mismatch"
        )
    return int(layers), int(width)


def build_router_replay(
    rows: Sequence[RowRoutes | None],
    *,
    max_len: int | None = None,
    num_layers: int | None = None,
    topk: int | None = None,
) -> RouterReplayBatch:
    """The router-replay array and coverage for a batch (None = placeholder row); see the contract."""
    longest = max((row.length for row in rows if row is not None), default=0)
    if max_len is None:
        max_len = longest
    elif type(max_len) is not int or max_len < longest:
        raise RouteSpanError(f"max_len {max_len!r} is shorter than the longest row ({longest} tokens)")
    modes: list[list[str]] = []
    placements: list[list[_Placement | None]] = []
    for row in rows:
        decided = [_placement(call) for call in row.calls] if row is not None else []
        modes.append([mode for mode, _ in decided])
        placements.append([placement for _, placement in decided])
    used = [p for row_placements in placements for p in row_placements if p is not None]
    layers, width = _shape(used, num_layers, topk)

    routes = np.full((len(rows), max_len, layers, width), SENTINEL, dtype=np.int16)
    loss_tokens = covered_loss = sentinel_tokens = rows_with_routes = 0
    for index, (row, row_placements) in enumerate(zip(rows, placements)):
        if row is None:
            continue
        covered = np.zeros(row.length, dtype=bool)
        offset = 0
        for call, placement in zip(row.calls, row_placements):
            if placement is not None:
                count = placement.stop - placement.start
                routes[index, offset + placement.start : offset + placement.stop] = placement.values[
                    placement.src : placement.src + count
                ]
                covered[offset + placement.start : offset + placement.stop] = True
            offset += call.delta_len
        loss = np.asarray(row.token_mask) == 1.0
        loss_tokens += int(loss.sum())
        covered_loss += int((loss & covered).sum())
        sentinel_tokens += int((~covered).sum())
        rows_with_routes += int(covered.any())
    real_rows = sum(row is not None for row in rows)
    flat_modes = [mode for row_modes in modes for mode in row_modes]
    coverage = RouterReplayCoverage(
        rows=len(rows),
        placeholder_rows=len(rows) - real_rows,
        rows_with_routes=rows_with_routes,
        loss_tokens=loss_tokens,
        covered_loss_tokens=covered_loss,
        sentinel_tokens=sentinel_tokens,
        padding_tokens=len(rows) * max_len - sum(row.length for row in rows if row is not None),
        calls=len(flat_modes),
        full_fragments=flat_modes.count("full"),
        tail_fragments=flat_modes.count("tail"),
        unusable_fragments=flat_modes.count("sentinel"),
    )
    return RouterReplayBatch(routes, coverage)


def router_replay_metrics(coverage: RouterReplayCoverage) -> dict[str, float]:
    """The step metrics for one batch's route coverage."""
    return {
        "router_replay/coverage": float(coverage.coverage),
        "router_replay/sentinel_tokens": float(coverage.sentinel_tokens),
        "router_replay/rows_with_routes": float(coverage.rows_with_routes),
    }


# --- routes beside the rows: fetch a kept rollout's extras, shape them, or mask the rollout ---

ROUTER_REPLAY_DETAIL_PREFIX = "router_replay_extras"


def attach_router_replay(
    source: Any, evidence: RolloutEvidence, snapshots: Mapping[str, StagedCallBaseSnapshot], kept: KeptRollout
) -> GroupEntry:
    """`kept` with `routed_experts` on every row that staged routes, or the extras-fault placeholder.

    See the module docstring. `snapshots` are the verified base snapshots the judge used (by
    staging key); `evidence.manifest` supplies each call's committed `extras_digest`.
    """
    records = {record.model_call_id: record for record in evidence.manifest.records}
    wanted: dict[str, CallRecord] = {}  # staging key -> record, rows' calls with non-empty extras
    for row in kept.rows:
        for call_id in row.model_call_ids:
            record = records[call_id]
            if record.extras_digest != EMPTY_EXTRAS_DIGEST:
                wanted.setdefault(record.staging_key, record)
    if not wanted:
        return kept
    fetch_extras = getattr(source, "fetch_extras", None)
    if not callable(fetch_extras):
        raise TypeError(
            f"rollout {kept.rollout_id} staged extras (router replay) but the staging source "
            f"{type(source).__name__} has no fetch_extras(keys, expected_extras_digests); use TQTokenSource"
        )
    keys = list(wanted)
    try:
        fetched = fetch_extras(keys, expected_extras_digests=[wanted[key].extras_digest for key in keys])
        extras = dict(zip(keys, fetched, strict=True))
        rows = tuple(_row_with_routes(row, records, snapshots, extras) for row in kept.rows)
    except StagingFetchError as error:
        return _extras_placeholder(evidence, kept, fetch_error_reason(error), f"{error_name(error)}: {error}")
    except RouterReplayError as error:  # the route data's fault, the rollout's verdict (a RouteSpanError is our bug)
        return _extras_placeholder(evidence, kept, PlaceholderReason.VERIFICATION_FAILED, f"{error_name(error)}: {error}")
    return dataclasses.replace(kept, rows=rows)


def _row_with_routes(
    row: TrainRow,
    records: Mapping[str, CallRecord],
    snapshots: Mapping[str, StagedCallBaseSnapshot],
    extras: Mapping[str, dict[str, Any] | None],
) -> TrainRow:
    """The row with its `[len, L, K]` routes, or unchanged when none of its calls staged a route."""
    calls = []
    for call_id, (start, end) in zip(row.model_call_ids, row.call_spans, strict=True):
        record = records[call_id]
        gen_len = sum(1 for m in snapshots[record.staging_key].token_mask_delta if m == 1.0)
        payload = routes_from_extras(extras.get(record.staging_key))
        calls.append(CallRoutes(call_id, (end - start) - gen_len, gen_len, payload))
    payloads = [(call.model_call_id, call.routed_experts) for call in calls if call.routed_experts is not None]
    if not payloads:
        return row
    shaped = RowRoutes(tuple(calls), row.token_mask)
    try:
        batch = build_router_replay([shaped])
    except RouteShapeUnknownError:
        # Every fragment is too short to use: the row is all sentinel, shaped like its fragments.
        shapes = {decode_call_routes(call_id, payload).shape[1:] for call_id, payload in payloads}
        if len(shapes) != 1:
            raise RouterReplayError(
                f"row {row.rollout_id}#{row.chain_index}: fragments disagree on (layers, topk): {sorted(shapes)}",
                kind="shape_mismatch",
            ) from None
        ((layers, topk),) = shapes
        batch = build_router_replay([shaped], num_layers=int(layers), topk=int(topk))
    return dataclasses.replace(row, routed_experts=batch.routes[0])


def _extras_placeholder(
    evidence: RolloutEvidence, kept: KeptRollout, reason: PlaceholderReason, error: str
) -> Placeholder:
    """The kept rollout's slot, reward and terminal selection, masked for an extras fault."""
    chains = kept.yield_.chains if kept.yield_ is not None else 0
    return Placeholder(
        kept.rollout_id, kept.group_index, kept.sample_index, reason, f"{ROUTER_REPLAY_DETAIL_PREFIX}: {error}",
        kept.reward, kept.terminal_selection, all_served_lost(evidence, reason.value, chains),
    )
