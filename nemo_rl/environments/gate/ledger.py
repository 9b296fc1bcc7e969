"""The capture ledger our gate installs: Gym's `FileLineageStore` with a branching resolution policy.

`BranchingCaptureLedger(dir)` reads and writes Gym's files and rows (Gym's own `record`,
`record_failure` and manifest); only parent resolution changes. Gym's two-stage order is kept;
among ledger rows `select_parent_row` (pure) picks the candidate with the longest recorded
context, the first committed on a tie. A continuation with no candidate is a new `text` branch
(`branch:<why>`) unless `branch_unresolved=False`. On disk a row omits a `staging_chain` that is
its parent's plus its own key (`compact_row`; `expand_rows` restores it, losslessly): O(T) keys
per rollout of T calls, not O(T^2). Errors are not converted: a corrupt row (a marked row without
its parent: `LedgerChainError`) raises and the call fails closed.
Invariant: the ledger is append-only, so every reader in any process picks the same parent.
Why each choice is exact: docs/design-docs/token-capture-receipts.md, "The gate's ledger".
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym.token_id_capture.fingerprint import (
    FINGERPRINT_VERSION,
    assistant_fingerprint,
    conversation_digest,
)
from nemo_gym.token_id_capture.lineage import FileLineageStore, IncrementalLineageStore
from nemo_gym.token_id_capture.protocols import LineageMatch, LineageResolution
from nemo_gym.token_id_capture.records import ParentResolutionStatus

from nemo_rl.data.errors import RecoverableError

logger = logging.getLogger(__name__)

BRANCH_REASON_PREFIX = "branch:"
# Why a continuation found no parent row (the suffix of a branch's reason).
NO_FINGERPRINT_MATCH = "no_fingerprint_match"
CONTEXT_MISMATCH = "context_mismatch"


@dataclass(frozen=True)
class RowSelection:
    """The outcome of matching one request against a rollout's ledger rows."""

    row: dict[str, Any] | None
    candidates: int
    reason: str = ""


def _continues_context(row: dict[str, Any], request_items: Sequence[dict]) -> bool:
    # The same check Gym applies to its single match: the recorded request is a prefix of this one.
    context_len = int(row["context_len"])
    if len(request_items) < context_len:
        return False
    return conversation_digest(list(request_items[:context_len])) == row["context_digest"]


def select_parent_row(rows: Sequence[dict[str, Any]], request_items: Sequence[dict]) -> RowSelection:
    """Pick the committed ledger row that `request_items` continues (pure; rows in ledger order).

    The caller handles a request with no assistant output (ROOT) before calling this.
    """
    fingerprint = assistant_fingerprint(list(request_items))
    same_output = [
        (index, row)
        for index, row in enumerate(rows)
        if row.get("failure_reason") is None
        and fingerprint
        and row.get("fingerprint") == fingerprint
        and row.get("fingerprint_version") == FINGERPRINT_VERSION
    ]
    if not same_output:
        return RowSelection(row=None, candidates=0, reason=NO_FINGERPRINT_MATCH)
    continuing = [(index, row) for index, row in same_output if _continues_context(row, request_items)]
    if not continuing:
        return RowSelection(row=None, candidates=0, reason=CONTEXT_MISMATCH)
    # Most specific context first, then the earliest commit (stable as the append-only ledger grows).
    _, chosen = min(continuing, key=lambda item: (-int(item[1]["context_len"]), item[0]))
    return RowSelection(row=chosen, candidates=len(continuing))


def match_from_row(row: dict[str, Any]) -> LineageMatch:
    """The `LineageMatch` Gym builds from a ledger row (same columns, same defaults)."""
    return LineageMatch(
        model_call_id=str(row["model_call_id"]),
        # Token-free custody rows omit the column; legacy rows keep it.
        cumulative_token_ids=tuple(int(token) for token in row.get("cumulative_token_ids") or ()),
        digest=str(row["digest"]),
        staging_chain=tuple(row.get("staging_chain") or []),
        prev_len=int(row.get("cum_len") or 0),
        chain_hash=str(row.get("chain_hash") or ""),
    )


def decide(selection: RowSelection, gym_answer: LineageResolution, *, branch_unresolved: bool) -> LineageResolution:
    """The final answer for a request that Gym's token-entry index left UNRESOLVED (pure)."""
    if selection.row is not None:
        return LineageResolution(ParentResolutionStatus.RESOLVED, match=match_from_row(selection.row))
    if not branch_unresolved:
        return gym_answer
    return LineageResolution(ParentResolutionStatus.ROOT, reason=BRANCH_REASON_PREFIX + selection.reason)


class BranchingCaptureLedger(FileLineageStore):
    """`FileLineageStore` that chooses among identical siblings and branches on rewritten history."""

    def __init__(self, root: str | Path, *, branch_unresolved: bool = True, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.branch_unresolved = branch_unresolved
        self._branches: Counter[str] = Counter()
        # `_resolve` runs in worker threads (`asyncio.to_thread`), so the counter needs a lock.
        self._branches_lock = threading.Lock()

    def _append(self, rollout_id: str, record: dict, records: list[dict]) -> None:
        # On disk without the cumulative staging chain (`compact_row`); in memory (Gym's cached
        # rows, what resolution and the manifest read) the row stays whole.
        super()._append(rollout_id, compact_row(record, chains_of(records)), records)
        records[-1] = record

    def _read(self, rollout_id: str) -> list[dict]:
        rows = super()._read(rollout_id)
        expand_rows(rows, rollout_id)
        return rows

    def branch_counts(self) -> dict[str, int]:
        """Branches opened by this instance, per reason (`branch:<why>`)."""
        with self._branches_lock:
            return dict(self._branches)

    def _select(self, rollout_id: str, request_items: list[dict]) -> RowSelection:
        with self._locked(rollout_id):
            rows = list(self._read(rollout_id))
        return select_parent_row(rows, request_items)

    def _resolve_row(self, rollout_id: str, request_items: list[dict]) -> LineageMatch | None:
        if not assistant_fingerprint(request_items):
            return None
        selection = self._select(rollout_id, request_items)
        return match_from_row(selection.row) if selection.row is not None else None

    def _resolve(self, rollout_id: str, request_items: list[dict]) -> LineageResolution:
        # The same two stages as `FileLineageStore._resolve`: Gym's token-entry index, then ledger rows.
        # It is called directly so that the row stage can report why nothing matched.
        gym_answer = IncrementalLineageStore._resolve(self, rollout_id, request_items)
        if gym_answer.status != ParentResolutionStatus.UNRESOLVED:
            return gym_answer
        selection = self._select(rollout_id, request_items)
        answer = decide(selection, gym_answer, branch_unresolved=self.branch_unresolved)
        if selection.candidates > 1:
            logger.info(
                "rollout %s: %d identical sibling rows continue this request; chose %s (first committed)",
                rollout_id,
                selection.candidates,
                selection.row["model_call_id"],
            )
        if answer.status == ParentResolutionStatus.ROOT:
            with self._branches_lock:
                self._branches[answer.reason] += 1
            logger.info(
                "rollout %s: the history continues no ledger row (%s); opening a text branch", rollout_id, answer.reason
            )
        return answer


# --- ledger rows on disk without cumulative staging chains (pure; lossless, property-tested) ---

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
