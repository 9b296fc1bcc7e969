"""Ledger rows on disk without cumulative staging chains: flat bytes per call however long the rollout.

Gym's custody row stores the call's whole `staging_chain` (every staging key from the chain's
root to this call), so a rollout of T calls writes O(T^2) keys and the bytes per call grow with
the rollout. The chain is redundant on disk: the gate builds a committed row's chain as the
parent row's chain plus the row's own key, and the parent row is always committed (and written)
before any child can be admitted.

Contract (pure functions; `BranchingCaptureLedger` applies them at its file boundary):
- `compact_row(row, chains)` is what goes to the file. When the row's chain is exactly
  `chains[parent] + [staging_key]` (a `token_in` row whose parent's chain is known) or exactly
  `[staging_key]` (a `text` row: a chain root), the chain is dropped and `CHAIN_MARKER: True`
  written instead. Any other row (a failure row, a legacy row, a chain that does not follow that
  rule) is written unchanged, so writing compact is lossless for every row.
- `expand_rows(rows)` restores, in place and in file order, the `staging_chain` of every row
  that carries the marker, from the chain of the row its `parent_call_id` names (already
  expanded: parents precede children in the append-only file). A marked row whose parent row is
  absent or has no chain raises `LedgerChainError` naming the rollout and both calls (a corrupt
  ledger fails closed, as Gym's own reader does).
- Round trip: `expand_rows([compact_row(r, chains so far) for r in rows])` equals `rows` for
  every row sequence in commit order (property-tested).
- Only our ledger reads these files back; Gym's plain `FileLineageStore` would read a marked
  row's chain as empty.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableSequence
from typing import Any

CHAIN_MARKER = "staging_chain_from_parent"


class LedgerChainError(ValueError):
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
