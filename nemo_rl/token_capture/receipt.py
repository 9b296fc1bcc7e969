"""Assemble a token-free `RolloutReceipt` from a Gym manifest and the `/run` result (pure).

Contract of `assemble_receipt(rollout_id, manifest, run_result)`:
- Never raises for bad data: every defect becomes a poisoned receipt with a `failure_reason`
  (fail closed), which the finalizer turns into a typed placeholder. The one raise is a
  version mismatch: an attribution method from Gym that this module cannot map.
- Poisoning rules, first match wins for `failure_reason`:
  1. the manifest names another rollout -> `manifest_rollout_mismatch` (its records are dropped);
  2. duplicate model_call_ids -> `duplicate_model_call_id` (records dropped: Gym's receipt
     cannot hold them);
  3. any manifest failure row -> that failure's Gym reason (the first one);
  4. no records and no failures -> `empty_manifest` (Gym answers an unknown rollout with an
     empty 200, so "never ran" and "made no call" look the same);
  5. no terminal could be chosen -> `terminal_selection_failed:<gym reason>`.
- Terminal choice: Gym's `resolve_terminal` with the run result's `response` as witness
  (response id, content fingerprint); if it attributes nothing, Gym's `select_terminal_call`
  parent-link walk (`terminal_selection="heuristic"`). Attribution also runs on poisoned
  manifests so metrics see which method would have been used.
- `reward` is the run result's `reward` when it is a finite number, else None.

`poison_reason(receipt)` maps a poisoned receipt's failure_reason back to a `PlaceholderReason`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nemo_gym.token_id_capture.staging import (
    CallRecord,
    RolloutReceipt,
    resolve_terminal,
    select_terminal_call,
)
from nemo_gym.token_id_capture.staging.records import RolloutManifest

from nemo_rl.token_capture.rows import PlaceholderReason

MANIFEST_ROLLOUT_MISMATCH = "manifest_rollout_mismatch"
DUPLICATE_MODEL_CALL_ID = "duplicate_model_call_id"
EMPTY_MANIFEST = "empty_manifest"
TERMINAL_SELECTION_FAILED = "terminal_selection_failed"

# resolve_terminal's method names -> RolloutReceipt.terminal_selection values.
_METHOD_TO_SELECTION = {
    "explicit": "declared",
    "declared": "declared",
    "response_id": "response_id",
    "content": "content",
    "content_cumulative": "content",
    "content_output": "content",
}


class UnknownAttributionMethodError(RuntimeError):
    """Gym's resolve_terminal named a method this module does not know (a version mismatch, not data)."""


def reward_of(run_result: dict[str, Any]) -> float | None:
    """The run result's reward as a float, or None when absent or not a finite number."""
    reward = run_result.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return None
    reward = float(reward)
    return reward if math.isfinite(reward) else None


def _poisoned(rollout_id: str, reward: float | None, reason: str, records: list[CallRecord] | None = None,
              terminal: str | None = None, selection: str | None = None, trail: str | None = None) -> RolloutReceipt:
    return RolloutReceipt(
        rollout_id=rollout_id,
        reward=reward,
        manifest=records or [],
        capture_poisoned=True,
        failure_reason=reason,
        terminal_model_call_id=terminal,
        terminal_selection=selection,
        terminal_attribution_reason=trail,
    )


@dataclass(frozen=True)
class _TerminalChoice:
    terminal: str | None  # None when neither the witnesses nor the walk named one
    selection: str  # RolloutReceipt.terminal_selection: the last method attempted
    trail: str  # witness abstentions / corroboration, then the walk's reason
    walk_reason: str | None  # select_terminal_call's reason when the walk ran


def _choose_terminal(records: list[CallRecord], response: Any) -> _TerminalChoice:
    """Witnesses first (resolve_terminal), then Gym's parent-link walk."""
    attribution = resolve_terminal(records, response if isinstance(response, dict) else None)
    if attribution.attributed:
        selection = _METHOD_TO_SELECTION.get(attribution.method)
        if selection is None:
            raise UnknownAttributionMethodError(
                f"resolve_terminal attributed by unknown method {attribution.method!r}; this nemo-gym version "
                "is newer than the receipt code: map the method in _METHOD_TO_SELECTION"
            )
        return _TerminalChoice(attribution.model_call_id, selection, attribution.reason, None)
    walk = select_terminal_call(records)
    trail = ",".join(part for part in (attribution.reason, f"heuristic={walk.reason}") if part)
    return _TerminalChoice(walk.terminal_model_call_id, "heuristic", trail, walk.reason)


def assemble_receipt(rollout_id: str, manifest: RolloutManifest, run_result: dict[str, Any]) -> RolloutReceipt:
    """Build the receipt for one finished rollout; see the module docstring for the rules."""
    reward = reward_of(run_result)
    if manifest.rollout_id != rollout_id:
        return _poisoned(rollout_id, reward, f"{MANIFEST_ROLLOUT_MISMATCH}:{manifest.rollout_id}")
    records = list(manifest.records)
    if len({r.model_call_id for r in records}) != len(records):
        return _poisoned(rollout_id, reward, DUPLICATE_MODEL_CALL_ID)
    failure = manifest.failures[0].reason if manifest.failures else None
    if not records:
        return _poisoned(rollout_id, reward, failure or EMPTY_MANIFEST)

    choice = _choose_terminal(records, run_result.get("response"))
    if failure is not None:
        return _poisoned(rollout_id, reward, failure, records, choice.terminal, choice.selection, choice.trail)
    if choice.terminal is None:
        reason = f"{TERMINAL_SELECTION_FAILED}:{choice.walk_reason}"
        return _poisoned(rollout_id, reward, reason, records, None, choice.selection, choice.trail)
    return RolloutReceipt(
        rollout_id=rollout_id,
        reward=reward,
        manifest=records,
        terminal_model_call_id=choice.terminal,
        terminal_selection=choice.selection,
        terminal_attribution_reason=choice.trail or None,
    )


def poison_reason(receipt: RolloutReceipt) -> PlaceholderReason:
    """The placeholder reason for a poisoned receipt (callers check `capture_poisoned` first)."""
    reason = receipt.failure_reason or ""
    if reason == EMPTY_MANIFEST:
        return PlaceholderReason.EMPTY_MANIFEST
    if reason.startswith(TERMINAL_SELECTION_FAILED):
        return PlaceholderReason.TERMINAL_SELECTION_FAILED
    return PlaceholderReason.CAPTURE_POISONED
