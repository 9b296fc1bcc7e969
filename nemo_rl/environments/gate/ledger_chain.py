"""Ledger rows on disk without cumulative staging chains: flat bytes per call however long the rollout.

Gym's row stores the call's whole `staging_chain`, so a rollout of T calls writes O(T^2) keys;
the chain is redundant on disk because a committed row's chain is its parent's plus its own key.
Pure functions applied by `BranchingCaptureLedger` at its file boundary: `compact_row` drops a
chain that follows that rule (writing `CHAIN_MARKER` instead) and writes any other row
unchanged; `expand_rows` restores chains in file order. A marked row whose parent is absent
raises `LedgerChainError` (fail closed).
Invariant: `expand_rows` of the compacted rows equals the rows (lossless, property-tested).
Only our ledger reads these files back. See docs/design-docs/token-capture-receipts.md.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableSequence
from typing import Any

from nemo_rl.data.errors import RecoverableError

CHAIN_MARKER = "staging_chain_from_parent"


class LedgerChainError(RecoverableError, ValueError):
    """A compact ledger row names a parent row whose chain is not in the file before it."""


def _derived_chain(row: Mapping[str, Any], chains: Mapping[str, list[str]]) -> list[str] | None:
    """The chain the gate would have built for `row`, or None when it cannot be derived."""
    key = row.get("staging_key")
    if not isinstance(key, str) or row.get("failure_reason") is not None:
        return None
    if row.get("mode") == "text" and row.get("parent_call_id") is None:
        return [key]
    if row.get("mode") == "token_in":
        parent = chains.get(row.get("parent_call_id"))
        return None if parent is None else [*parent, key]
    return None


def compact_row(row: Mapping[str, Any], chains: Mapping[str, list[str]]) -> dict[str, Any]:
    """The row as written to the file (see the module contract). `chains`: model_call_id -> chain so far."""
    derived = _derived_chain(row, chains)
    if derived is None or list(row.get("staging_chain") or []) != derived or CHAIN_MARKER in row:
        return dict(row)
    compact = {name: value for name, value in row.items() if name != "staging_chain"}
    compact[CHAIN_MARKER] = True
    return compact


def chains_of(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """model_call_id -> staging_chain of every (expanded) row that has one."""
    return {str(r["model_call_id"]): list(r["staging_chain"]) for r in rows if r.get("staging_chain")}


def expand_rows(rows: MutableSequence[dict[str, Any]], rollout_id: str) -> None:
    """Restore the chain of every marked row, in place (see the module contract)."""
    if not any(CHAIN_MARKER in row for row in rows):
        return
    chains: dict[str, list[str]] = {}
    for row in rows:
        if row.pop(CHAIN_MARKER, False):
            derived = _derived_chain(row, chains)
            if derived is None:
                raise LedgerChainError(
                    f"ledger of rollout {rollout_id!r}: row {row.get('model_call_id')!r} elides its staging_chain but "
                    f"its parent row {row.get('parent_call_id')!r} is not before it with a chain (corrupt ledger file)"
                )
            row["staging_chain"] = derived
        if row.get("staging_chain"):
            chains[str(row["model_call_id"])] = list(row["staging_chain"])
