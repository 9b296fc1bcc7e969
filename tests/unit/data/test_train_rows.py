"""The train-row records and codec: RowRef, the payload digest, TrainPlan."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.data.errors import RecordInvariantError
from nemo_rl.data.rows import KeptRollout, RouteCoverage, RowOrigin, RowRef, TrainRow
from nemo_rl.data.train import FIELDS, TrainPlan, payload_digest, row_payload


def _row(rid="r-0", sample=0, *, chain=0, reward=1.0, call="c0", routes=None, ids=(5, 6, 7, 8),
         lps=(-0.5, -0.25)) -> TrainRow:
    return TrainRow(
        rollout_id=rid, group_index=0, sample_index=sample, token_ids=ids, token_mask=(0.0, 0.0, 1.0, 1.0),
        generation_logprobs=(0.0, 0.0) + lps, reward=reward, prompt_len=2, model_call_ids=(call,),
        weight_versions=(3,), token_in_calls=0, text_root_calls=1, terminal_selection="response_id",
        origin=RowOrigin.CAPTURE, call_spans=((0, 4),), chain_index=chain, routed_experts=routes,
    )


# --- RowRef and the digest -----------------------------------------------------------------------


def test_rowref_keeps_what_the_driver_reads_and_no_tokens():
    routes = np.array([[[1, 2]], [[-1, 3]], [[4, 5]], [[6, -1]]], dtype=np.int16)
    row = _row(routes=routes)
    ref = RowRef.of(row, "r-0#0", "a" * 64, carry_prompt_ids=False)
    assert (ref.num_tokens, ref.prompt_len, ref.num_generated_tokens, ref.reward) == (4, 2, 2, 1.0)
    assert (ref.model_call_ids, ref.weight_versions, ref.call_spans, ref.loss_calls) == (
        ("c0",), (3,), ((0, 4),), frozenset({"c0"}))
    assert ref.route_coverage == RouteCoverage(tokens=4, loss_tokens=2, covered_loss_tokens=1, sentinel_tokens=2)
    assert ref.route_coverage == row.route_coverage and ref.route_coverage.has_routes
    assert ref.prompt_ids is None and ref.origin is RowOrigin.CAPTURE
    assert RowRef.of(row, "r-0#0", "a" * 64, carry_prompt_ids=True).prompt_ids == (5, 6)
    assert not hasattr(ref, "token_ids") and not hasattr(ref, "routed_experts")


def test_rowref_invariants():
    ref = RowRef.of(_row(), "r-0#0", "a" * 64, carry_prompt_ids=False)
    with pytest.raises(RecordInvariantError, match="digest must be a sha256 hex digest") as excinfo:
        dataclasses.replace(ref, digest="xyz")
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match=r"num_generated_tokens must be in \[1, 2\]") as excinfo:
        dataclasses.replace(ref, num_generated_tokens=3)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="route_coverage must count") as excinfo:
        dataclasses.replace(ref, num_generated_tokens=1)
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="prompt_ids must be None or 2") as excinfo:
        dataclasses.replace(ref, prompt_ids=(5,))
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="loss_calls must be a non-empty subset") as excinfo:
        dataclasses.replace(ref, loss_calls=frozenset({"other"}))
    assert excinfo.value.kind == "row"
    with pytest.raises(RecordInvariantError, match="rows are all TrainRow or all RowRef") as excinfo:
        KeptRollout("r-0", 0, 0, (ref, dataclasses.replace(_row(chain=1, call="c1"))), 1.0, "response_id")
    assert excinfo.value.kind == "row"


_ids = st.lists(st.integers(0, 2**40), min_size=2, max_size=6)
_lp = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False).filter(lambda x: x != 0.0)
_ARRAY_DTYPES = {"token_ids": "<i8", "token_mask": "<f8", "generation_logprobs": "<f8"}
_ELEMENTS = {"token_ids": st.integers(-(2**63), 2**63 - 1), "token_mask": st.floats(allow_nan=False),
             "generation_logprobs": st.floats(allow_nan=False)}


def _content(payload) -> tuple[bytes, ...]:
    """What each field holds, as bytes, field by field: two payloads are the same row iff these are equal."""
    return (payload["meta"].encode(), *(np.asarray(payload[f].numpy(), dtype=d).tobytes()
                                        for f, d in _ARRAY_DTYPES.items()), bytes(payload["routed_experts"]))


def _mutate(data: st.DataObject, payload: dict) -> dict:
    """One arbitrary edit of one field: replace, insert or delete an element/byte/character at a
    drawn position, or move the last element of one float array to the front of the next (the
    arrays' concatenated bytes stay the same; only the field boundaries move)."""
    changed = dict(payload)
    field = data.draw(st.sampled_from(sorted(FIELDS) + ["shift"]), label="field")
    if field == "shift":
        mask, lps = payload["token_mask"].tolist(), payload["generation_logprobs"].tolist()
        changed["token_mask"] = torch.tensor(mask[:-1], dtype=torch.float64)
        changed["generation_logprobs"] = torch.tensor(mask[-1:] + lps, dtype=torch.float64)
        return changed
    if field in _ARRAY_DTYPES:
        items: list = payload[field].tolist()
        element = _ELEMENTS[field]
    elif field == "routed_experts":
        items, element = list(payload[field]), st.integers(0, 255)
    else:
        items, element = list(payload[field]), st.characters(codec="utf-8")
    kind = data.draw(st.sampled_from(["replace", "insert", "delete"] if items else ["insert"]), label="kind")
    at = data.draw(st.integers(0, len(items) - (kind != "insert")), label="at")
    if kind == "delete":
        del items[at]
    elif kind == "insert":
        items.insert(at, data.draw(element, label="value"))
    else:
        old = np.asarray([items[at]], dtype=_ARRAY_DTYPES.get(field, object)).tobytes() if field in _ARRAY_DTYPES else None
        items[at] = data.draw(element.filter(
            lambda v: (np.asarray([v], dtype=_ARRAY_DTYPES[field]).tobytes() != old) if old is not None else v != items[at]),
            label="value")
    if field in _ARRAY_DTYPES:
        changed[field] = torch.tensor(items, dtype=payload[field].dtype)
    elif field == "routed_experts":
        changed[field] = bytes(items)
    else:
        changed[field] = "".join(items)
    return changed


@settings(max_examples=150, deadline=None)
@given(tail=_ids, lps=st.tuples(_lp, _lp), with_routes=st.booleans(), data=st.data())
def test_digest_is_stable_through_a_copy_and_moves_with_any_change(tail, lps, with_routes, data):
    ids = (5, 6, *tail[:2])
    routes = np.arange(8, dtype=np.int16).reshape(4, 1, 2) if with_routes else None
    row = _row(ids=ids, lps=lps, routes=routes)
    payload = row_payload("r-0#0", row)
    copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in payload.items()}
    assert payload_digest(copy) == payload_digest(payload)
    changed = _mutate(data, copy)
    assert _content(changed) != _content(payload)  # the edit changed the row (so the digest must move)
    assert payload_digest(changed) != payload_digest(payload)


def test_train_plan_invariants():
    with pytest.raises(RecordInvariantError, match="one digest and advantage per key") as excinfo:
        TrainPlan("p", ("a",), ("0" * 64,), ())
    assert excinfo.value.kind == "train_plan"
    with pytest.raises(RecordInvariantError, match="distinct") as excinfo:
        TrainPlan("p", ("a", "a"), ("0" * 64,) * 2, (0.0, 0.0))
    assert excinfo.value.kind == "train_plan"
    with pytest.raises(RecordInvariantError, match="finite") as excinfo:
        TrainPlan("p", ("a",), ("0" * 64,), (float("nan"),))
    assert excinfo.value.kind == "train_plan"
    with pytest.raises(RecordInvariantError, match="sha256") as excinfo:
        TrainPlan("p", ("a",), ("g" * 64,), (0.0,))
    assert excinfo.value.kind == "train_plan"


@pytest.mark.parametrize(
    ("field", "forge"),
    [
        # Each forged array casts to the very bytes the digest read from the original (cast to <i8 / <f8).
        ("token_ids", lambda t: t.to(torch.float64) + 0.25),  # 5.25 -> 5: not token ids at all
        ("token_mask", lambda t: t.to(torch.int64)),
        ("generation_logprobs", lambda t: t.to(torch.float32)),  # -0.5, -0.25 are exact in float32
    ],
)
def test_the_digest_binds_each_arrays_dtype_not_only_its_values_cast(field, forge):
    # FOUND: payload_digest cast every array to the codec's dtype before hashing, so a payload whose
    # token ids were floats (5.25) digested like the int64 original: two payloads, one digest.
    payload = row_payload("r-0#0", _row())
    forged = dict(payload, **{field: forge(payload[field])})
    assert not torch.equal(forged[field], payload[field]) or forged[field].dtype != payload[field].dtype
    assert payload_digest(forged) != payload_digest(payload)


def test_a_plan_giving_one_rollouts_rows_different_advantages_is_refused():
    # Advantages swapped between rows of different rollouts: every row of a rollout carries its rollout's
    # advantage, so a plan in which two rows of r-0 disagree was assembled wrong (the digests cannot see it).
    keys, digests = ("r-0#0", "r-1#0", "r-0#1"), ("a" * 64, "b" * 64, "c" * 64)
    assert TrainPlan("p", keys, digests, (0.5, -0.5, 0.5)).num_samples == 3
    with pytest.raises(RecordInvariantError, match=r"rows of rollout 'r-0' carry different advantages \[-0\.5, 0\.5\]"
                       ) as excinfo:
        TrainPlan("p", keys, digests, (-0.5, 0.5, 0.5))
    assert excinfo.value.kind == "train_plan"
