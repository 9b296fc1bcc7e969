"""Which committed call earned the reward: terminal precedence from the live `/run` path (pure).

`choose_terminal(records, run_result)` never raises for bad data and returns a `TerminalChoice`
whose `selection` is declared, response_id, content or heuristic, with every witness's
abstention kept in `trail`. Order: a declaration (a response id, a call id, or the scored
output's text or fingerprint, `terminal_output_*`: the content witness of clients with no
response id), then Gym's witnesses, then Gym's parent-link walk (refused when several roots have
descendants), else mask.
Invariants: a declaration never falls back (an uncaptured or unmatched declared terminal or
output witness masks the rollout); witnesses that disagree mask it. `reward_of(run_result)` is a
finite float or None.
See docs/design-docs/token-capture-receipts.md, "Terminal precedence".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym.token_id_capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint
from nemo_gym.token_id_capture.staging import CallRecord, resolve_terminal, select_terminal_call

from nemo_rl.data.errors import FatalError
from nemo_rl.data.rows import PlaceholderReason

# Gym's names for the live-path terminal declarations (nemo_gym.token_id_capture.delivery; that
# module imports Gym's server stack, so the keys are spelled here and pinned by a unit test).
TERMINAL_RESPONSE_ID_KEY = "terminal_response_id"
TERMINAL_CALL_KEY = "_ng_terminal_model_call_id"
# Ours: the scored output declared by content, for clients that report no response id (the Agents
# SDK over chat completions). The text is fingerprinted as one assistant turn with Gym's function.
TERMINAL_OUTPUT_TEXT_KEY = "terminal_output_text"
TERMINAL_OUTPUT_FINGERPRINT_KEY = "terminal_output_fingerprint"
WITNESS_DISAGREEMENT = "witness_disagreement"
AMBIGUOUS_ROOTS = "ambiguous_roots"

# resolve_terminal's method names -> RolloutReceipt.terminal_selection values.
_METHOD_TO_SELECTION = {
    "explicit": "declared",
    "declared": "declared",
    "response_id": "response_id",
    "content": "content",
    "content_cumulative": "content",
    "content_output": "content",
}


class UnknownAttributionMethodError(FatalError, RuntimeError):
    """Gym's resolve_terminal named a method this module does not know (a version mismatch, not data)."""


@dataclass(frozen=True)
class TerminalChoice:
    """The terminal call and how it was chosen, or the masking verdict and why."""

    call_id: str | None
    selection: str | None  # RolloutReceipt.terminal_selection; None when masked before any method named one
    trail: str
    rejection: PlaceholderReason | None = None
    detail: str = ""
    witness_disagreement: bool = False

    def __post_init__(self) -> None:
        if (self.call_id is None) == (self.rejection is None):
            raise ValueError("a TerminalChoice names either a terminal call or a rejection, never both")


def reward_of(run_result: dict[str, Any]) -> float | None:
    """The run result's reward as a float, or None when absent or not a finite number."""
    reward = run_result.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return None
    reward = float(reward)
    return reward if math.isfinite(reward) else None


def _declared(run_result: dict[str, Any], key: str) -> str | None:
    value = run_result.get(key)
    return str(value) if isinstance(value, str) and value else None


def _roots_with_descendants(records: Sequence[CallRecord]) -> int:
    parents = {r.parent_call_id for r in records if r.parent_call_id is not None}
    return sum(1 for r in records if r.parent_call_id is None and r.model_call_id in parents)


def output_witness(run_result: dict[str, Any]) -> str | None:
    """The declared output fingerprint (`terminal_output_fingerprint`, else of `terminal_output_text`), or None."""
    fingerprint = _declared(run_result, TERMINAL_OUTPUT_FINGERPRINT_KEY)
    if fingerprint is not None:
        return fingerprint
    text = _declared(run_result, TERMINAL_OUTPUT_TEXT_KEY)
    return assistant_fingerprint([{"role": "assistant", "content": text}]) if text is not None else None


def _identity(record: CallRecord) -> tuple[str, str, int]:
    return (record.cumulative_hash, record.chain_hash, record.cum_len)


def choose_by_output(records: Sequence[CallRecord], fingerprint: str) -> TerminalChoice:
    """The one call whose own output has `fingerprint` (identical retries count once: the smallest id), else mask."""
    matches = [r for r in records if r.fingerprint_version == FINGERPRINT_VERSION and r.output_fingerprint == fingerprint]
    if not matches:
        detail = f"{TERMINAL_OUTPUT_TEXT_KEY}/{TERMINAL_OUTPUT_FINGERPRINT_KEY} {fingerprint[:16]}... matches no committed call's output"
        return TerminalChoice(None, "content", "output_witness_unmatched", PlaceholderReason.TERMINAL_WITNESS_UNMATCHED,
                              detail)
    if len({_identity(r) for r in matches}) > 1:
        ids = sorted(r.model_call_id for r in matches)
        return TerminalChoice(None, "content", "output_witness_ambiguous", PlaceholderReason.TERMINAL_SELECTION_FAILED,
                              f"terminal_selection_failed:output_witness_ambiguous {ids}")
    return TerminalChoice(min(r.model_call_id for r in matches), "content", "output_witness")


def choose_terminal(records: Sequence[CallRecord], run_result: dict[str, Any]) -> TerminalChoice:
    """Declared > witnesses > heuristic > mask; see the module docstring."""
    fingerprint = output_witness(run_result)
    if fingerprint is None:
        return _choose_without_output_witness(records, run_result)
    by_output = choose_by_output(records, fingerprint)
    if by_output.rejection is not None or not (
        _declared(run_result, TERMINAL_RESPONSE_ID_KEY) or _declared(run_result, TERMINAL_CALL_KEY)
    ):
        return by_output
    other = _choose_without_output_witness(records, run_result)  # a declared id as well: they must agree
    if other.rejection is not None or other.call_id == by_output.call_id:
        return other
    trail = f"{WITNESS_DISAGREEMENT}[output={by_output.call_id};{other.selection}={other.call_id}]"
    return TerminalChoice(None, None, trail, PlaceholderReason.TERMINAL_WITNESS_DISAGREEMENT, trail,
                          witness_disagreement=True)


def _choose_without_output_witness(records: Sequence[CallRecord], run_result: dict[str, Any]) -> TerminalChoice:
    declared_id = _declared(run_result, TERMINAL_RESPONSE_ID_KEY)
    explicit_call = _declared(run_result, TERMINAL_CALL_KEY)
    if explicit_call is not None and all(record.model_call_id != explicit_call for record in records):
        return TerminalChoice(
            None, "declared", "explicit_terminal_not_captured", PlaceholderReason.DECLARED_TERMINAL_UNCAPTURED,
            f"{TERMINAL_CALL_KEY}={explicit_call!r} names no committed call",
        )
    response = run_result.get("response")
    attribution = resolve_terminal(
        list(records), response if isinstance(response, dict) else None, explicit_call,
        declared_response_id=declared_id,
    )
    if attribution.attributed:
        selection = _METHOD_TO_SELECTION.get(attribution.method)
        if selection is None:
            raise UnknownAttributionMethodError(
                f"resolve_terminal attributed by unknown method {attribution.method!r}; this nemo-gym version "
                "is newer than the receipt code: map the method in _METHOD_TO_SELECTION"
            )
        return TerminalChoice(attribution.model_call_id, selection, attribution.reason)
    if declared_id is not None:
        return TerminalChoice(
            None, "declared", attribution.reason, PlaceholderReason.TERMINAL_DECLARED_UNMATCHED,
            f"terminal_response_id={declared_id!r}: {attribution.reason}",
        )
    if WITNESS_DISAGREEMENT in attribution.reason:
        return TerminalChoice(
            None, None, attribution.reason, PlaceholderReason.TERMINAL_WITNESS_DISAGREEMENT,
            attribution.reason, witness_disagreement=True,
        )
    trail_parts = [attribution.reason] if attribution.reason else []
    if _roots_with_descendants(records) > 1:
        trail = ",".join(trail_parts + [f"heuristic={AMBIGUOUS_ROOTS}"])
        return TerminalChoice(
            None, "heuristic", trail, PlaceholderReason.TERMINAL_SELECTION_FAILED,
            f"terminal_selection_failed:{AMBIGUOUS_ROOTS}",
        )
    walk = select_terminal_call(list(records))
    trail = ",".join(trail_parts + [f"heuristic={walk.reason}"])
    if walk.terminal_model_call_id is None:
        return TerminalChoice(
            None, "heuristic", trail, PlaceholderReason.TERMINAL_SELECTION_FAILED,
            f"terminal_selection_failed:{walk.reason}",
        )
    return TerminalChoice(walk.terminal_model_call_id, "heuristic", trail)
