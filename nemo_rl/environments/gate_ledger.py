"""The capture ledger our gate installs: Gym's `FileLineageStore` with a branching resolution policy.

Contract:
- `BranchingCaptureLedger(dir)` is a `FileLineageStore` over the same directory and file
  layout (`<rollout>.lineage.jsonl`, the token store's flock). Rows are built by Gym's own
  `record` / `record_failure`, and the manifest is built by Gym's own code. Parent resolution
  (`_resolve`, `_resolve_row`) changes, and rows go to the file without their cumulative
  `staging_chain` (`ledger_chain.py`: flat bytes per call; `_read` restores the chains, so every
  reader above the file sees Gym's rows).
- How Gym 0.7.0 resolves, which we keep: `FileLineageStore._resolve` first asks
  `IncrementalLineageStore._resolve`, the index over `TokenEntry` JSONL written by Gym's local
  capture. That index is empty under external staging. It answers ROOT when the request has no
  assistant output and otherwise UNRESOLVED. Only on UNRESOLVED are the ledger rows searched
  (`_resolve_row`). We keep both stages and the order.
- Which ledger row a request continues (`select_parent_row`, pure): candidates are committed
  rows whose `fingerprint` (same `fingerprint_version`) equals the request's assistant
  fingerprint and whose recorded context (`context_len` items, `context_digest`) is a prefix of
  the request. Failure rows have no fingerprint and are never candidates. Among several
  candidates, the longest recorded context wins (it explains more of the request). On a tie
  (identical siblings, e.g. an identical retry), the row committed first in ledger order wins.
  Gym returns None for more than one fingerprint match, even when only one continues the
  context.
- Why the first committed sibling: the ledger is append-only, so the first matching row never
  changes as rows are added. Every instance that reads the same file, in any process, picks
  the same row. The smallest `model_call_id` would also be deterministic, but a later
  sibling with a smaller uuid would change the answer for later requests.
- Why choosing a sibling is exact: the worker serves the child from the chosen row's staged
  ids (`staging_chain`), and that row's text is what the request echoes. So the child row is
  the true prompt and sampled tokens whichever sibling was chosen. The other sibling stays in
  the manifest as a dead branch.
- A continuation with no candidate (history rewritten: compaction, stripped reasoning,
  re-serialised tool calls, a sub-agent's own conversation) resolves ROOT with reason
  `branch:<why>` when `branch_unresolved` is true (the default). Gym's `resolve_parent` then
  admits it as a new `text` chain in the same rollout. The worker renders the whole
  conversation, so earlier generated text is prompt (masked) in that branch, and the
  recorded tokens are still what the engine saw. With `branch_unresolved=False` the answer is
  Gym's UNRESOLVED, and `resolve_parent` poisons the call (`unresolved_parent`).
- Branches are counted per reason (`branch_counts()`) and logged at INFO.
- Errors are not converted: a corrupt ledger row raises, as in Gym, and `resolve_parent` fails
  the call closed.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
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

from nemo_rl.environments.ledger_chain import chains_of, compact_row, expand_rows

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
        # On disk without the cumulative staging chain (ledger_chain.py); in memory (Gym's cached
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
