"""Compact ledger rows (ledger.py: `compact_row`, `expand_rows`): the round trip over random commit forests, and the edges."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.environments.gate.ledger import CHAIN_MARKER, LedgerChainError, chains_of, compact_row, expand_rows


@st.composite
def commit_orders(draw: st.DrawFn) -> list[dict]:
    """Rows in commit order: roots, continuations of any earlier committed call, failure rows."""
    rows: list[dict] = []
    chains: dict[str, list[str]] = {}
    for index in range(draw(st.integers(1, 25))):
        call_id = f"c{index}"
        kind = draw(st.sampled_from(["root", "child", "child", "failure", "odd"])) if chains else "root"
        if kind == "failure":
            rows.append({"model_call_id": call_id, "failure_reason": "worker_capture_failed"})
            continue
        key = f"r/{call_id}"
        if kind == "root":
            chain, row = [key], {"mode": "text", "parent_call_id": None}
        else:
            parent = draw(st.sampled_from(sorted(chains)))
            chain, row = [*chains[parent], key], {"mode": "token_in", "parent_call_id": parent}
            if kind == "odd":  # a chain that does not follow the rule is written whole
                chain = [key, *chains[parent]]
        chains[call_id] = chain
        rows.append({"model_call_id": call_id, "staging_key": key, "staging_chain": chain, "cum_len": index, **row})
    return rows


@settings(max_examples=200, deadline=None)
@given(commit_orders())
def test_compact_then_expand_is_the_identity(rows: list[dict]) -> None:
    written: list[dict] = []
    for row in rows:
        written.append(compact_row(row, chains_of(rows[: len(written)])))
    on_disk = copy.deepcopy(written)
    expand_rows(written, "r")
    assert written == rows
    # Only rows whose chain is the parent's chain plus their key are compacted; failure rows never.
    for stored, row in zip(on_disk, rows):
        derivable = row.get("failure_reason") is None and row["staging_chain"][-1] == row["staging_key"] and (
            row["mode"] == "text" or row["staging_chain"][:-1] == next(
                r["staging_chain"] for r in rows if r["model_call_id"] == row["parent_call_id"]))
        assert (CHAIN_MARKER in stored) == derivable
        assert ("staging_chain" in stored) == (not derivable and "staging_chain" in row)


def test_rows_without_a_chain_or_a_known_parent_are_written_unchanged() -> None:
    orphan = {"model_call_id": "c1", "staging_key": "r/c1", "staging_chain": ["r/c0", "r/c1"], "mode": "token_in",
              "parent_call_id": "c0"}
    assert compact_row(orphan, {}) == orphan  # the parent's chain is unknown: kept whole
    legacy = {"model_call_id": "c2", "digest": "x"}
    assert compact_row(legacy, {}) == legacy


def test_a_marked_row_without_its_parent_raises_naming_both_calls() -> None:
    rows = [{"model_call_id": "c1", "staging_key": "r/c1", "mode": "token_in", "parent_call_id": "c0", CHAIN_MARKER: True}]
    with pytest.raises(LedgerChainError, match="ledger of rollout 'r': row 'c1' elides its staging_chain but its parent "
                                               "row 'c0' is not before it with a chain"):
        expand_rows(rows, "r")
