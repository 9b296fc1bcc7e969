"""Router replay (R3) beside training rows: fetch a kept rollout's staged routes and shape them.

`attach_router_replay` runs in the finalizer actor right after the judge keeps a rollout: each
row whose calls committed to non-empty extras gets `routed_experts` (int16 `[len(row), L, K]`,
-1 where a token has no route), from ONE digest-bound `fetch_extras` call per rollout; a rollout
without extras makes no round trip. Invariant: an MoE never trains without its routes silently:
extras that cannot be fetched, fail their digest or are not route fragments make the rollout a
placeholder (detail `router_replay_extras: ...`; `fetch_error_reason` is the reason mapping, which
the finalizer's `fetch_snapshots` shares).
See docs/design-docs/token-capture-receipts.md, "Routes beside the rows".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nemo_gym.token_id_capture.staging import EMPTY_EXTRAS_DIGEST, CallRecord, StagedCallBaseSnapshot

from nemo_rl.data.rows import GroupEntry, KeptRollout, Placeholder, PlaceholderReason, TrainRow
from nemo_rl.data.staged_rows import StagedRecordInvalidError, StagingFetchError
from nemo_rl.data_plane.staging import StagedKeysMissingError
from nemo_rl.token_capture.judge import RolloutEvidence, all_served_lost
from nemo_rl.token_capture.router_replay import (
    CallRoutes,
    RoutedExpertsDecodeError,
    RouteShapeMismatchError,
    RouteShapeUnknownError,
    RouteValueError,
    RowRoutes,
    build_router_replay,
    decode_call_routes,
    routes_from_extras,
)


# Route-payload faults that make a rollout's verdict (a RouteSpanError would be our own bug).
_ROUTE_DATA_ERRORS = (RoutedExpertsDecodeError, RouteShapeMismatchError, RouteValueError)
ROUTER_REPLAY_DETAIL_PREFIX = "router_replay_extras"


def fetch_error_reason(error: StagingFetchError) -> PlaceholderReason:
    """The verdict for a staging read that failed: missing, invalid (tampered/corrupt), or unavailable."""
    if isinstance(error, StagedKeysMissingError):
        return PlaceholderReason.STAGED_RECORD_MISSING
    if isinstance(error, StagedRecordInvalidError):
        return PlaceholderReason.VERIFICATION_FAILED
    return PlaceholderReason.DATA_PLANE_ERROR


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
        return _extras_placeholder(evidence, kept, fetch_error_reason(error), f"{type(error).__name__}: {error}")
    except _ROUTE_DATA_ERRORS as error:
        return _extras_placeholder(evidence, kept, PlaceholderReason.VERIFICATION_FAILED, f"{type(error).__name__}: {error}")
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
            raise RouteShapeMismatchError(f"row {row.rollout_id}#{row.chain_index}: fragments disagree on "
                                          f"(layers, topk): {sorted(shapes)}") from None
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
