"""Router replay (R3): shaping staged routed-expert extras, and fetching them digest-bound from real TQ."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.staging import (
    CallRecord,
    CaptureAdmission,
    RolloutReceipt,
    RolloutTokenCapture,
    compute_extras_digest,
    encode_routed_experts,
    verify_and_linearize,
)

from nemo_rl.data.calls import ExtrasDigestMismatchError, StagedRecordInvalidError, StagingFetchError
from nemo_rl.data_plane import DataPlaneClient, DataPlaneConfig
from nemo_rl.data_plane.partitions import TQTokenSink, TQTokenSource
from nemo_rl.token_capture.router_replay import (
    CallRoutes,
    RouteShapeUnknownError,
    RouteSpanError,
    RouterReplayError,
    RowRoutes,
    build_router_replay,
    router_replay_metrics,
    row_routes,
)

S = -1  # the sentinel


def routes(first: int, tokens: int, layers: int = 2, topk: int = 2) -> list[list[list[int]]]:
    """Distinct, readable expert ids: token t, layer l, slot k -> first + 100*t + 10*l + k."""
    return [[[first + 100 * t + 10 * l + k for k in range(topk)] for l in range(layers)] for t in range(tokens)]


def blank(tokens: int) -> list[list[list[int]]]:
    return [[[S, S], [S, S]] for _ in range(tokens)]


def mask(carry: int, gen: int) -> tuple[float, ...]:
    return (0.0,) * carry + (1.0,) * gen


# --- pure shaping -------------------------------------------------------------------------------


def test_exact_array_for_full_tail_missing_and_placeholder_rows() -> None:
    full = routes(1000, 4)  # covers c1's whole delta (2 carry + 2 generated)
    gen_only = routes(2000, 1)  # covers c2's generated token only
    row_a = RowRoutes(
        (CallRoutes("c1", 2, 2, full), CallRoutes("c2", 1, 1, gen_only)),
        mask(2, 2) + mask(1, 1),
    )
    row_c = RowRoutes((CallRoutes("d1", 1, 2, None),), mask(1, 2))
    batch = build_router_replay([row_a, None, row_c])

    expected = np.array(
        [
            full + blank(1) + gen_only,
            blank(6),
            blank(6),
        ],
        dtype=np.int16,
    )
    assert batch.routes.dtype == np.int16
    assert batch.routes.shape == (3, 6, 2, 2)
    np.testing.assert_array_equal(batch.routes, expected)
    cov = batch.coverage
    assert (cov.rows, cov.placeholder_rows, cov.rows_with_routes) == (3, 1, 1)
    assert (cov.loss_tokens, cov.covered_loss_tokens) == (5, 3)
    assert (cov.sentinel_tokens, cov.padding_tokens) == (1 + 3, 6 + 3)
    assert (cov.calls, cov.full_fragments, cov.tail_fragments, cov.unusable_fragments) == (3, 1, 1, 0)
    assert cov.coverage == pytest.approx(3 / 5)
    assert router_replay_metrics(cov) == {
        "router_replay/coverage": pytest.approx(0.6),
        "router_replay/sentinel_tokens": 4.0,
        "router_replay/rows_with_routes": 1.0,
    }


def test_whole_sequence_routes_use_the_generated_tail_and_envelopes_match_lists() -> None:
    # An engine that returns routes for the call's whole prompt + generation (prev_len 4 + delta 3):
    # Gym's `tail` rule takes the last gen_len rows; the carry token gets the sentinel.
    whole = routes(0, 7)
    root = CallRoutes("c1", 2, 2, encode_routed_experts(routes(5000, 4)))
    child = CallRoutes("c2", 1, 2, encode_routed_experts(whole, dtype="int32"))
    batch = build_router_replay([RowRoutes((root, child), mask(2, 2) + mask(1, 2))])
    expected = np.array([routes(5000, 4) + blank(1) + whole[5:]], dtype=np.int16)
    np.testing.assert_array_equal(batch.routes, expected)
    assert (batch.coverage.full_fragments, batch.coverage.tail_fragments) == (1, 1)
    assert batch.coverage.coverage == 1.0


def test_fragment_shorter_than_the_generation_is_unusable_and_counted() -> None:
    calls = (CallRoutes("c1", 1, 3, routes(0, 2)), CallRoutes("c2", 1, 1, routes(7, 1)))
    row = RowRoutes(calls, mask(1, 3) + mask(1, 1))
    batch = build_router_replay([row])
    np.testing.assert_array_equal(batch.routes, np.array([blank(5) + routes(7, 1)], dtype=np.int16))
    assert batch.coverage.unusable_fragments == 1
    assert (batch.coverage.covered_loss_tokens, batch.coverage.loss_tokens) == (1, 4)


def test_all_placeholder_batch_is_all_sentinel_when_the_shape_is_given() -> None:
    batch = build_router_replay([None, None], max_len=3, num_layers=2, topk=2)
    np.testing.assert_array_equal(batch.routes, np.full((2, 3, 2, 2), S, dtype=np.int16))
    assert batch.coverage.coverage == 0.0
    assert batch.coverage.padding_tokens == 6
    with pytest.raises(RouteShapeUnknownError, match="pass num_layers and topk") as info:
        build_router_replay([None, RowRoutes((CallRoutes("c", 1, 1, None),), mask(1, 1))])
    assert info.value.kind == "shape_unknown" and isinstance(info.value, RouterReplayError)


def test_mismatched_layers_or_topk_raise_named_errors() -> None:
    two_by_two = CallRoutes("a", 0, 2, routes(0, 2))
    three_layers = CallRoutes("b", 0, 2, routes(0, 2, layers=3))
    one_wide = CallRoutes("c", 0, 2, routes(0, 2, topk=1))
    with pytest.raises(RouterReplayError, match=r"\(2, 2\), \(3, 2\)") as info:
        build_router_replay([RowRoutes((two_by_two,), mask(0, 2)), RowRoutes((three_layers,), mask(0, 2))])
    assert info.value.kind == "shape_mismatch"
    with pytest.raises(RouterReplayError) as info:
        build_router_replay([RowRoutes((two_by_two, one_wide), mask(0, 2) + mask(0, 2))])
    assert info.value.kind == "shape_mismatch"
    with pytest.raises(RouterReplayError) as info:
        build_router_replay([RowRoutes((two_by_two,), mask(0, 2))], num_layers=4, topk=2)
    assert info.value.kind == "shape_mismatch"


def test_expert_ids_must_fit_int16_and_be_non_negative_and_payloads_must_decode() -> None:
    for bad in (-3, 2**15, 2**70):
        payload = [[[0, bad], [1, 2]]]
        with pytest.raises(RouterReplayError, match="'c'") as info:
            build_router_replay([RowRoutes((CallRoutes("c", 0, 1, payload),), mask(0, 1))])
        assert info.value.kind == "value"
    with pytest.raises(RouterReplayError) as info:
        encoded = encode_routed_experts([[[0, -1], [1, 2]]])
        build_router_replay([RowRoutes((CallRoutes("c", 0, 1, encoded),), mask(0, 1))])
    assert info.value.kind == "value"
    for junk in ("nrlre1:int64:1x2x2:AAAA", "not-an-envelope", [[[1, 2], [3]]], {"values": []}, [[[True, 1]]]):
        with pytest.raises(RouterReplayError, match="'c'") as info:
            build_router_replay([RowRoutes((CallRoutes("c", 0, 1, junk),), mask(0, 1))])
        assert info.value.kind == "decode"


def test_spans_must_describe_the_row() -> None:
    with pytest.raises(RouteSpanError, match="span 3 tokens but the row has 4"):
        RowRoutes((CallRoutes("c", 1, 2),), mask(2, 2))
    with pytest.raises(RouteSpanError):
        CallRoutes("c", -1, 2)
    with pytest.raises(RouteSpanError, match="2 extras for 1 calls"):
        row_routes([("c", 1, 1)], [None, None], mask(1, 1))
    with pytest.raises(RouteSpanError, match="shorter than the longest row"):
        build_router_replay([RowRoutes((CallRoutes("c", 1, 1, routes(0, 2)),), mask(1, 1))], max_len=1)


def test_row_routes_reads_the_routed_experts_key_and_ignores_other_extras() -> None:
    row = row_routes(
        [("c1", 1, 1), ("c2", 1, 1), ("c3", 1, 1)],
        [{"routed_experts": routes(0, 2), "media_spans": []}, None, {"media_spans": []}],
        mask(1, 1) * 3,
    )
    assert [c.routed_experts is not None for c in row.calls] == [True, False, False]
    assert row.length == 6


# --- property test ------------------------------------------------------------------------------

# How a call's routes were produced: none, delta-aligned, generated tokens only, the whole
# sequence up to the call's end (prefix + delta), or too short to use.
_MODES = ("none", "full", "gen_only", "whole_seq", "short")


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[list[tuple[int, int, str]] | None], int, int, int]:
    layers = draw(st.integers(1, 3))
    topk = draw(st.integers(1, 3))
    call = st.tuples(st.integers(0, 3), st.integers(1, 3), st.sampled_from(_MODES))
    row = st.none() | st.lists(call, min_size=1, max_size=4)
    return draw(st.lists(row, min_size=1, max_size=5)), layers, topk, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=150, deadline=None)
@given(batch=batches())
def test_property_sentinel_exactly_where_no_route(
    batch: tuple[list[list[tuple[int, int, str]] | None], int, int, int],
) -> None:
    specs, layers, topk, seed = batch
    rng = np.random.default_rng(seed)
    rows: list[RowRoutes | None] = []
    lengths = [sum(c + g for c, g, _ in spec) if spec is not None else 0 for spec in specs]
    max_len = max(lengths) + 1
    expected = np.full((len(specs), max_len, layers, topk), S, dtype=np.int16)
    expected_loss = expected_covered = 0
    for i, spec in enumerate(specs):
        if spec is None:
            rows.append(None)
            continue
        calls, row_mask, offset = [], [], 0
        for j, (carry, gen, mode) in enumerate(spec):
            delta = carry + gen
            token_rows = {"full": delta, "gen_only": gen, "whole_seq": offset + delta, "short": gen - 1}.get(mode, 0)
            values = rng.integers(0, 2**15, size=(token_rows, layers, topk)) if token_rows else None
            calls.append(CallRoutes(f"c{j}", carry, gen, values.tolist() if values is not None else None))
            row_mask += [0.0] * carry + [1.0] * gen
            # Independent statement of Gym's span rule: which route row (if any) each delta token takes.
            for t in range(delta):
                generated = t >= carry
                source = None
                if values is not None and token_rows == delta:
                    source = t
                elif values is not None and token_rows >= gen and generated:
                    source = token_rows - gen + (t - carry)
                if source is not None:
                    expected[i, offset + t] = values[source]
                expected_loss += generated
                expected_covered += generated and source is not None
            offset += delta
        rows.append(RowRoutes(tuple(calls), tuple(row_mask)))

    result = build_router_replay(rows, max_len=max_len, num_layers=layers, topk=topk)
    assert result.routes.shape == (len(specs), max_len, layers, topk)
    assert result.routes.dtype == np.int16
    np.testing.assert_array_equal(result.routes, expected)
    cov = result.coverage
    real_positions = sum(lengths)
    uncovered_real = sum(
        int((expected[i, : lengths[i]] == S).all(axis=(1, 2)).sum()) for i, spec in enumerate(specs) if spec is not None
    )
    assert cov.sentinel_tokens == uncovered_real
    assert cov.padding_tokens == len(specs) * max_len - real_positions
    assert (cov.loss_tokens, cov.covered_loss_tokens) == (expected_loss, expected_covered)
    assert cov.rows_with_routes == sum(
        int((expected[i, : lengths[i]] != S).any()) for i, spec in enumerate(specs) if spec is not None
    )
    assert cov.placeholder_rows == sum(spec is None for spec in specs)


# --- real TransferQueue -------------------------------------------------------------------------

PARTITION = "router_replay_test"
CFG = DataPlaneConfig(call_timeout_s=10.0)



def test_routes_staged_through_real_tq_come_back_digest_bound_and_shape(
    clients: tuple[DataPlaneClient, DataPlaneClient],
) -> None:
    writer, reader = clients
    sink, source = TQTokenSink(writer, PARTITION), TQTokenSource(reader, PARTITION)
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 1)
    rollout = f"r3-{uuid.uuid4().hex[:8]}"
    root_routes = encode_routed_experts(routes(10, 5))  # whole delta: 3 prompt + 2 generated
    child_routes = routes(20, 1)  # generated token only, as legacy nested lists

    root_call = capture.begin_call(CaptureAdmission(rollout_id=rollout, model_call_id="c1", mode="text"))
    root = capture.complete_call(
        root_call,
        prompt_token_ids=[1, 2, 3],
        generated_token_ids=[4, 5],
        generated_logprobs=[-0.5, -0.25],
        extras={"routed_experts": root_routes},
    )
    child_call = capture.begin_call(
        CaptureAdmission(
            rollout_id=rollout,
            model_call_id="c2",
            parent_call_id="c1",
            prev_len=root.cum_len,
            mode="token_in",
            staging_chain=[root.staging_key],
            parent_chain_hash=root.chain_hash,
        ),
        prefix_token_ids=[1, 2, 3, 4, 5],
    )
    child = capture.complete_call(
        child_call,
        prompt_token_ids=[1, 2, 3, 4, 5, 6, 7],
        generated_token_ids=[8],
        generated_logprobs=[-1.0],
        extras={"routed_experts": child_routes},
    )
    assert (root.disposition, child.disposition) == ("staged", "staged")
    assert root.extras_digest == compute_extras_digest({"routed_experts": root_routes})

    manifest = [
        CallRecord(**coords.model_dump(exclude={"disposition", "rollout_id"}), mode=mode, response_id=f"id-{mode}")
        for coords, mode in [(root, "text"), (child, "token_in")]
    ]
    receipt = RolloutReceipt(
        rollout_id=rollout, reward=1.0, manifest=manifest, terminal_model_call_id="c2", terminal_selection="declared"
    )
    row = verify_and_linearize(receipt, source.fetch([r.staging_key for r in manifest]))
    extras = source.fetch_row_extras(row)
    assert extras == [{"routed_experts": root_routes}, {"routed_experts": child_routes}]
    assert source.fetch_extras([]) == []

    batch = build_router_replay([row_routes(row.link_spans, extras, row.token_mask), None])
    expected = np.array([routes(10, 5) + blank(2) + child_routes, blank(8)], dtype=np.int16)
    np.testing.assert_array_equal(batch.routes, expected)
    assert router_replay_metrics(batch.coverage) == {
        "router_replay/coverage": 1.0,
        "router_replay/sentinel_tokens": 2.0,
        "router_replay/rows_with_routes": 1.0,
    }

    # Tampered extras under the staged header: the stored extras_digest no longer matches.
    tampered_key = f"{rollout}/c1"
    (stored,) = reader.get(PARTITION, [tampered_key], ["header", "extras"])
    token_fields = ["token_ids_delta", "token_mask_delta", "generation_log_probs_delta"]
    (full_row,) = reader.get(PARTITION, [tampered_key], token_fields)
    forged = {"routed_experts": encode_routed_experts(routes(11, 5))}
    writer.put(PARTITION, tampered_key, {**full_row, "header": stored["header"], "extras": json.dumps(forged)})
    with pytest.raises(ExtrasDigestMismatchError, match="does not match the staged extras_digest") as info:
        source.fetch_row_extras(row)
    assert isinstance(info.value, StagedRecordInvalidError) and isinstance(info.value, StagingFetchError)
    assert info.value.key == tampered_key and info.value.bound_by == "staged"
    with pytest.raises(ExtrasDigestMismatchError):
        source.fetch_records([tampered_key])

    # A forger who also rewrites the header's extras_digest still fails the row's commitment.
    header = json.loads(stored["header"])
    header["extras_digest"] = compute_extras_digest(forged)
    writer.put(PARTITION, tampered_key, {**full_row, "header": json.dumps(header), "extras": json.dumps(forged)})
    assert source.fetch_extras([tampered_key]) == [forged]  # self-consistent, but not what was committed
    with pytest.raises(ExtrasDigestMismatchError, match="committed extras_digest") as info:
        source.fetch_row_extras(row)
    assert info.value.expected == root.extras_digest
    with pytest.raises(ValueError, match="1 expected extras digests for 2 staging keys"):
        source.fetch_extras([tampered_key, f"{rollout}/c2"], [root.extras_digest])
    source.clear([r.staging_key for r in manifest])
