"""The one judge: run outcome + manifest + staged snapshots + served report -> rows or a placeholder.

`judge_rollout(evidence, snapshots, fetch_problems, cfg)` is pure and never raises for bad data; the
finalizer actors and `capture_one_rollout.py` call it, and nothing else decides a rollout's fate. A
rejection is a placeholder with a typed reason and a detail; a corrupt chain drops only itself unless
it is the terminal chain. `choose_terminal` names the call that earned the reward: a declaration
(response id, call id, or the scored output `terminal_output_*`) > Gym's witnesses > Gym's
parent-link walk (refused when several roots have descendants) > mask. `reward_of`: finite or None.
Invariants: only chains Gym's `verify_and_linearize` verifies, the trainer accepts (a prompt token
first, sampled logprobs <= 0) and whose per-call generation sizes match the served report become
rows; a generated token is in the loss at most once; an abandoned retry is never in the loss; a
served-but-unlocatable call poisons the rollout; a declaration never falls back and witnesses that
disagree mask the rollout.
Rules in order, terminal precedence, yield: docs/design-docs/token-capture-receipts.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_gym.token_id_capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint
from nemo_gym.token_id_capture.staging import (
    EMPTY_EXTRAS_DIGEST,
    CallRecord,
    ReceiptVerificationError,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    resolve_terminal,
    select_terminal_call,
    verify_and_linearize,
)
from nemo_gym.token_id_capture.staging.records import RolloutManifest

from nemo_rl.data.calls import ServedCall, StagedRecordInvalidError, StagingFetchError
from nemo_rl.data.errors import FatalError
from nemo_rl.data.rows import (
    CallLineage,
    GroupEntry,
    KeptRollout,
    Placeholder,
    PlaceholderReason,
    RolloutYield,
    RowOrigin,
    TrainRow,
)
from nemo_rl.data_plane.partitions import StagedKeysMissingError
from nemo_rl.token_capture.config import TokenCaptureConfig

OFF_CHAIN_REASONS = frozenset({"request_finished_without_staged_coordinates"})
_POISON_CODES = frozenset({"rollout_failed", "capture_poisoned"})
CUT_BY_UNSTAGED_CHILD = "cut_by_unstaged_child"  # detail of a chain dropped as served_not_staged
# Details (verification_failed) of a verified chain that still does not train: `_untrainable`, `_served_disagreement`.
EMPTY_PROMPT = "empty_prompt"
POSITIVE_LOGPROB = "positive_logprob"
GENERATED_COUNT_MISMATCH = "generated_count_mismatch"  # staged mask-1 tokens != the served report's count
# Reasons for served tokens that are not in the loss (metric keys; keep them stable).
SERVED_NOT_STAGED = "served_not_staged"
STAGED_NOT_COMMITTED = "staged_not_committed"
EXCLUDED_BY_BRANCH_POLICY = "excluded_by_branch_policy"

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
_METHOD_TO_SELECTION = {"explicit": "declared", "declared": "declared", "response_id": "response_id",
                        "content": "content", "content_cumulative": "content", "content_output": "content"}


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
        return TerminalChoice(None, "declared", "explicit_terminal_not_captured",
                              PlaceholderReason.DECLARED_TERMINAL_UNCAPTURED,
                              f"{TERMINAL_CALL_KEY}={explicit_call!r} names no committed call")
    response = run_result.get("response")
    attribution = resolve_terminal(list(records), response if isinstance(response, dict) else None, explicit_call,
                                   declared_response_id=declared_id)
    if attribution.attributed:
        selection = _METHOD_TO_SELECTION.get(attribution.method)
        if selection is None:
            raise UnknownAttributionMethodError(
                f"resolve_terminal attributed by unknown method {attribution.method!r}; this nemo-gym version "
                "is newer than the judge: map the method in _METHOD_TO_SELECTION"
            )
        return TerminalChoice(attribution.model_call_id, selection, attribution.reason)
    if declared_id is not None:
        return TerminalChoice(None, "declared", attribution.reason, PlaceholderReason.TERMINAL_DECLARED_UNMATCHED,
                              f"terminal_response_id={declared_id!r}: {attribution.reason}")
    if WITNESS_DISAGREEMENT in attribution.reason:
        return TerminalChoice(None, None, attribution.reason, PlaceholderReason.TERMINAL_WITNESS_DISAGREEMENT,
                              attribution.reason, witness_disagreement=True)
    trail_parts = [attribution.reason] if attribution.reason else []
    if _roots_with_descendants(records) > 1:
        trail = ",".join(trail_parts + [f"heuristic={AMBIGUOUS_ROOTS}"])
        return TerminalChoice(None, "heuristic", trail, PlaceholderReason.TERMINAL_SELECTION_FAILED,
                              f"terminal_selection_failed:{AMBIGUOUS_ROOTS}")
    walk = select_terminal_call(list(records))
    trail = ",".join(trail_parts + [f"heuristic={walk.reason}"])
    if walk.terminal_model_call_id is None:
        return TerminalChoice(None, "heuristic", trail, PlaceholderReason.TERMINAL_SELECTION_FAILED,
                              f"terminal_selection_failed:{walk.reason}")
    return TerminalChoice(walk.terminal_model_call_id, "heuristic", trail)


@dataclass(frozen=True)
class RunFailure:
    reason: PlaceholderReason  # run_failed or run_timeout
    detail: str


@dataclass(frozen=True)
class RolloutEvidence:
    """Everything the dispatcher learned about one rollout; snapshots are fetched by the finalizer."""

    rollout_id: str
    group_index: int
    sample_index: int
    run_result: dict[str, Any] | None
    run_failure: RunFailure | None
    manifest: RolloutManifest | None
    manifest_problem: str | None
    served: tuple[ServedCall, ...] | None  # None when the workers' report was unavailable

    def __post_init__(self) -> None:
        if (self.run_result is None) == (self.run_failure is None):
            raise ValueError(f"{self.rollout_id}: evidence holds a run result or a run failure, exactly one")
        if self.manifest is None and self.manifest_problem is None and self.run_failure is None:
            raise ValueError(f"{self.rollout_id}: a missing manifest needs a manifest_problem")

    def _committed(self) -> Sequence[CallRecord]:
        """This rollout's committed records (none when the manifest is missing or another rollout's)."""
        if self.manifest is None or self.manifest.rollout_id != self.rollout_id:
            return ()
        return self.manifest.records

    def staging_keys(self) -> list[str]:
        """The staged keys the judge may need (every committed record of this rollout's manifest)."""
        return [record.staging_key for record in self._committed()]

    def staged_extras(self) -> bool:
        """Whether a committed call staged extras (router replay's routes): only then is R3 attached."""
        return any(record.extras_digest != EMPTY_EXTRAS_DIGEST for record in self._committed())


@dataclass(frozen=True)
class FetchProblem:
    """Why one staged key could not be read as a valid snapshot."""

    reason: PlaceholderReason  # staged_record_missing, verification_failed or data_plane_error
    detail: str


def fetch_error_reason(error: StagingFetchError) -> PlaceholderReason:
    """The verdict for a staging read that failed: missing, invalid (tampered/corrupt), or unavailable."""
    if isinstance(error, StagedKeysMissingError):
        return PlaceholderReason.STAGED_RECORD_MISSING
    if isinstance(error, StagedRecordInvalidError):
        return PlaceholderReason.VERIFICATION_FAILED
    return PlaceholderReason.DATA_PLANE_ERROR


@dataclass(frozen=True)
class _Chain:
    calls: tuple[CallRecord, ...]  # root -> leaf
    leaf: str


def _placeholder(ev: RolloutEvidence, reason: PlaceholderReason, detail: str, reward: float | None,
                 selection: str | None = None, served_yield: RolloutYield | None = None) -> Placeholder:
    return Placeholder(ev.rollout_id, ev.group_index, ev.sample_index, reason, detail, reward, selection, served_yield)


def call_lineage(ev: RolloutEvidence) -> CallLineage | None:
    """The rollout's capture-health figures (rule 8); None without a served report or its manifest."""
    if ev.served is None or ev.manifest is None or ev.manifest.rollout_id != ev.rollout_id:
        return None
    records = ev.manifest.records
    first = records[0].model_call_id if records and records[0].parent_call_id is None else None
    calls = {call.model_call_id: call for call in ev.served}  # a call is counted once
    token_in = sum(1 for call in calls.values() if call.mode == "token_in")
    unresolved = sum(1 for call in calls.values() if call.unresolved_continuation and call.model_call_id != first)
    roots = sum(1 for record in records if record.parent_call_id is None)
    return CallLineage(token_in, unresolved, max(roots - 1, 0))


def all_served_lost(ev: RolloutEvidence, reason: str, chains: int = 0, disagreement: bool = False) -> RolloutYield:
    """The yield of a rollout that trains nothing: every served generated token lost to `reason`."""
    lineage = call_lineage(ev)
    if ev.served is None:
        return RolloutYield(None, 0, (), chains, disagreement, lineage=lineage)
    total = sum(call.generated_tokens for call in ev.served)
    return RolloutYield(total, 0, ((reason, total),) if total else (), chains, disagreement, lineage=lineage)


def _chain_to(call_id: str, by_id: Mapping[str, CallRecord]) -> tuple[CallRecord, ...] | None:
    """Root -> call_id through parent links; None for an orphaned or cyclic lineage."""
    path: list[CallRecord] = []
    seen: set[str] = set()
    cursor: str | None = call_id
    while cursor is not None:
        record = by_id.get(cursor)
        if record is None or cursor in seen:
            return None
        seen.add(cursor)
        path.append(record)
        cursor = record.parent_call_id
    return tuple(reversed(path))


def _root_prompt(snapshot: StagedCallBaseSnapshot | None) -> tuple[int, ...] | None:
    """A root's prompt ids: its staged delta before the first generated (mask 1.0) token."""
    if snapshot is None:
        return None
    mask = snapshot.token_mask_delta
    end = mask.index(1.0) if 1.0 in mask else len(mask)
    return tuple(snapshot.token_ids_delta[:end])


def abandoned_retries(records: Sequence[CallRecord], terminal_chain: Sequence[CallRecord],
                      served: Sequence[ServedCall] | None,
                      snapshots: Mapping[str, StagedCallBaseSnapshot]) -> frozenset[str]:
    """Committed calls the harness discarded (rule 4): off the terminal chain, never continued, with a sibling."""
    on_terminal = {record.model_call_id for record in terminal_chain}
    continued = {r.parent_call_id for r in records if r.parent_call_id is not None}
    continued |= {c.parent_call_id for c in served or () if c.parent_call_id is not None}
    children: dict[str, set[str]] = {}
    for call_id, parent in [(r.model_call_id, r.parent_call_id) for r in records] + [
        (c.model_call_id, c.parent_call_id) for c in served or ()
    ]:
        if parent is not None:
            children.setdefault(parent, set()).add(call_id)
    root_prompts: dict[tuple[int, ...], set[str]] = {}
    for record in records:
        prompt = _root_prompt(snapshots.get(record.staging_key)) if record.parent_call_id is None else None
        if prompt is not None:
            root_prompts.setdefault(prompt, set()).add(record.model_call_id)
    abandoned: set[str] = set()
    for record in records:
        call_id = record.model_call_id
        if call_id in on_terminal or call_id in continued:
            continue
        if record.parent_call_id is not None:
            siblings = children[record.parent_call_id] - {call_id}
        else:
            prompt = _root_prompt(snapshots.get(record.staging_key))
            siblings = (root_prompts[prompt] - {call_id}) if prompt is not None else set()
        if siblings:
            abandoned.add(call_id)
    return frozenset(abandoned)


def _candidate_chains(records: Sequence[CallRecord], terminal: str, policy: str, abandoned: frozenset[str]) -> list[str]:
    """Last call ids of the chains to train: the terminal first, then (all_chains) every other leaf in
    manifest order, an abandoned leaf replaced by its parent (an abandoned root by nothing)."""
    if policy == "terminal_chain":
        return [terminal]
    parents = {r.parent_call_id for r in records if r.parent_call_id is not None}
    ends = [terminal]
    for record in records:
        if record.model_call_id in parents or record.model_call_id == terminal:
            continue
        end = record.parent_call_id if record.model_call_id in abandoned else record.model_call_id
        if end is not None and end not in ends:
            ends.append(end)
    return ends


def _linearize(ev: RolloutEvidence, chain: Sequence[CallRecord], snapshots: Mapping[str, StagedCallBaseSnapshot],
               reward: float, selection: str):
    receipt = RolloutReceipt(
        rollout_id=ev.rollout_id, reward=reward, manifest=list(chain),
        terminal_model_call_id=chain[-1].model_call_id, terminal_selection=selection,
    )
    return verify_and_linearize(receipt, [snapshots[record.staging_key] for record in chain])


def _owned_row(ev: RolloutEvidence, linear, chain: Sequence[CallRecord], owned: set[str], reward: float,
               selection: str, chain_index: int) -> TrainRow | None:
    """The chain's TrainRow with calls already in another row's loss masked out; None if nothing is left."""
    mask = list(linear.token_mask)
    logprobs = list(linear.logprobs)
    spans = []
    for span in linear.weight_version_spans:
        spans.append((span.start, span.end))
        if span.model_call_id in owned:
            for i in range(span.start, span.end):
                mask[i], logprobs[i] = 0.0, 0.0
    if 1.0 not in mask:
        return None
    token_in = sum(1 for record in chain if record.mode == "token_in")
    return TrainRow(
        rollout_id=ev.rollout_id, group_index=ev.group_index, sample_index=ev.sample_index,
        token_ids=tuple(linear.token_ids), token_mask=tuple(mask), generation_logprobs=tuple(logprobs),
        reward=reward, prompt_len=linear.prompt_len, model_call_ids=tuple(linear.model_call_ids),
        weight_versions=tuple(linear.weight_versions), token_in_calls=token_in,
        text_root_calls=len(chain) - token_in, terminal_selection=selection, origin=RowOrigin.CAPTURE,
        call_spans=tuple(spans), chain_index=chain_index,
    )


def _chain_problem(chain: Sequence[CallRecord], fetch_problems: Mapping[str, FetchProblem], cut_leaves: set[str],
                   cfg: TokenCaptureConfig) -> tuple[PlaceholderReason, str] | None:
    for record in chain:
        problem = fetch_problems.get(record.staging_key)
        if problem is not None:
            return problem.reason, f"{record.staging_key}: {problem.detail}"
    if chain[-1].model_call_id in cut_leaves:
        return PlaceholderReason.SERVED_NOT_STAGED, f"{CUT_BY_UNSTAGED_CHILD}: a child of {chain[-1].model_call_id} was served without custody"
    versions = sorted({record.weight_version for record in chain})
    if cfg.mixed_weight_version_policy == "reject" and len(versions) > 1:
        return PlaceholderReason.MIXED_WEIGHT_VERSION, f"chain served by weight versions {versions}"
    return None


def _untrainable(linear) -> str | None:
    """Why the trainer would refuse a verified row (`TrainBatch`'s rules), or None: position 0 has no
    prefix, so it is never in the loss, and a sampled token's logprob is <= 0."""
    if linear.token_mask[0] != 0.0:
        return f"{EMPTY_PROMPT}: call {linear.model_call_ids[0]} stages no prompt token before its first generated token"
    for index, (mask, logprob) in enumerate(zip(linear.token_mask, linear.logprobs)):
        if mask == 1.0 and not logprob <= 0.0:
            return f"{POSITIVE_LOGPROB}: token {index} of the row was sampled with logprob {logprob!r} > 0"
    return None


def _served_counts(served: Sequence[ServedCall] | None) -> dict[str, set[int]]:
    """The generated-token counts the workers reported for each staged call (empty without a report)."""
    counts: dict[str, set[int]] = {}
    for call in served or ():
        if call.staged:
            counts.setdefault(call.model_call_id, set()).add(call.generated_tokens)
    return counts


def _served_disagreement(linear, counts: Mapping[str, set[int]]) -> str | None:
    """A call whose staged generation (its mask-1 tokens) is not the size the worker reported serving, or None.

    The worker stages exactly the ids it sampled and reports their count (`_served_counts`): a mismatch
    means the mask covers prompt tokens (or misses sampled ones), which the digests cannot show. No
    report: no check."""
    for span in linear.weight_version_spans:
        staged = sum(1 for mask in linear.token_mask[span.start:span.end] if mask == 1.0)
        reported = counts.get(span.model_call_id)
        if reported and staged not in reported:
            return (f"{GENERATED_COUNT_MISMATCH}: call {span.model_call_id} stages {staged} generated tokens, the "
                    f"worker reported serving {sorted(reported)}")
    return None


def _verification_reason(error: ReceiptVerificationError) -> PlaceholderReason:
    return PlaceholderReason.CAPTURE_POISONED if error.code in _POISON_CODES else PlaceholderReason.VERIFICATION_FAILED


def _precheck(ev: RolloutEvidence) -> Placeholder | None:
    """Verdicts that need neither chains nor snapshots."""
    if ev.run_failure is not None:
        return _placeholder(ev, ev.run_failure.reason, ev.run_failure.detail, None,
                            served_yield=all_served_lost(ev, ev.run_failure.reason.value))
    reward = reward_of(ev.run_result)
    manifest = ev.manifest
    if manifest is None:
        reason = PlaceholderReason.MANIFEST_UNAVAILABLE
        return _placeholder(ev, reason, ev.manifest_problem or "", reward, served_yield=all_served_lost(ev, reason.value))
    poisoned = PlaceholderReason.CAPTURE_POISONED
    if manifest.rollout_id != ev.rollout_id:
        return _placeholder(ev, poisoned, f"manifest_rollout_mismatch:{manifest.rollout_id}", reward,
                            served_yield=all_served_lost(ev, poisoned.value))
    if len({r.model_call_id for r in manifest.records}) != len(manifest.records):
        return _placeholder(ev, poisoned, "duplicate_model_call_id", reward, served_yield=all_served_lost(ev, poisoned.value))
    if reward is None:
        reason = PlaceholderReason.REWARD_MISSING
        return _placeholder(ev, reason, "run result has no finite reward", None, served_yield=all_served_lost(ev, reason.value))
    if not manifest.records:
        reason = PlaceholderReason.EMPTY_MANIFEST
        failures = sorted({f.reason for f in manifest.failures})
        detail = f"no committed call; failures: {failures}" if failures else "no committed call and no failure row"
        return _placeholder(ev, reason, detail, reward, served_yield=all_served_lost(ev, reason.value))
    return None


def _unstaged_calls(ev: RolloutEvidence) -> tuple[dict[str, str], list[str]]:
    """Served-not-staged failure rows: {call_id: reason}, and those the served report cannot locate."""
    committed = {r.model_call_id for r in ev.manifest.records}
    reasons: dict[str, set[str]] = {}
    for failure in ev.manifest.failures:
        reasons.setdefault(failure.model_call_id, set()).add(failure.reason)
    unstaged = {
        call_id: ",".join(sorted(found - OFF_CHAIN_REASONS))
        for call_id, found in reasons.items()
        if found - OFF_CHAIN_REASONS or call_id in committed
    }
    served_ids = {call.model_call_id for call in ev.served or ()}
    unlocated = sorted(call_id for call_id in unstaged if call_id not in served_ids or call_id in committed)
    return unstaged, unlocated


def judge_rollout(
    ev: RolloutEvidence,
    snapshots: Mapping[str, StagedCallBaseSnapshot],
    fetch_problems: Mapping[str, FetchProblem],
    cfg: TokenCaptureConfig,
) -> GroupEntry:
    """One verdict for one rollout; see the module docstring for the rules."""
    early = _precheck(ev)
    if early is not None:
        return early
    reward = reward_of(ev.run_result)
    records = list(ev.manifest.records)
    by_id = {r.model_call_id: r for r in records}
    parents = {r.parent_call_id for r in records if r.parent_call_id is not None}
    leaves = sum(1 for r in records if r.model_call_id not in parents)

    unstaged, unlocated = _unstaged_calls(ev)
    if unlocated:
        reason = PlaceholderReason.CAPTURE_POISONED
        detail = f"{SERVED_NOT_STAGED}_unlocated: calls {unlocated} ({[unstaged[c] for c in unlocated]})"
        return _placeholder(ev, reason, detail, reward, served_yield=all_served_lost(ev, reason.value, leaves))

    terminal: TerminalChoice = choose_terminal(records, ev.run_result)
    uncommitted = sorted({c.model_call_id for c in ev.served or ()} - set(by_id))
    if terminal.rejection is None and terminal.selection == "heuristic" and (unstaged or uncommitted):
        # The parent-link walk cannot see calls without a record (a failure row, or a served reply the
        # ledger never committed): the scored response may be one.
        terminal = TerminalChoice(
            None, "heuristic", terminal.trail, PlaceholderReason.TERMINAL_SELECTION_FAILED,
            f"terminal_selection_failed:heuristic_with_unstaged_calls {sorted(unstaged)}" if unstaged
            else f"terminal_selection_failed:heuristic_with_uncommitted_calls {uncommitted}",
        )
    if terminal.rejection is not None:
        return _placeholder(ev, terminal.rejection, terminal.detail, reward, terminal.selection,
                            all_served_lost(ev, terminal.rejection.value, leaves, terminal.witness_disagreement))

    served_by_id = {call.model_call_id: call for call in ev.served or ()}
    cut_leaves = {served_by_id[c].parent_call_id for c in unstaged if served_by_id[c].parent_call_id is not None}
    owned: set[str] = set()
    rows: list[TrainRow] = []
    lost: dict[str, str] = {}  # call id -> why its generated tokens are not in the loss
    abandoned = abandoned_retries(records, _chain_to(terminal.call_id, by_id) or (), ev.served, snapshots)
    ends = _candidate_chains(records, terminal.call_id, cfg.branch_policy, abandoned)
    served_counts = _served_counts(ev.served)
    for position, leaf in enumerate(ends):
        chain = _chain_to(leaf, by_id)
        if position > 0 and chain is not None and all(record.model_call_id in owned for record in chain):
            continue  # every call is already in an earlier row's loss: nothing left to train
        problem = (PlaceholderReason.VERIFICATION_FAILED, f"lineage of {leaf} is orphaned or cyclic") if chain is None \
            else _chain_problem(chain, fetch_problems, cut_leaves, cfg)
        linear = None
        if problem is None:
            try:
                linear = _linearize(ev, chain, snapshots, reward, terminal.selection)
            except ReceiptVerificationError as error:
                problem = (_verification_reason(error), error.code)
            else:
                refused = _untrainable(linear) or _served_disagreement(linear, served_counts)
                problem = (PlaceholderReason.VERIFICATION_FAILED, refused) if refused is not None else None
        if problem is not None:
            if position == 0:
                return _placeholder(ev, problem[0], problem[1], reward, terminal.selection,
                                    all_served_lost(ev, problem[0].value, leaves))
            for record in chain or ():
                lost.setdefault(record.model_call_id, problem[0].value)
            continue
        row = _owned_row(ev, linear, chain, owned, reward, terminal.selection, len(rows))
        if row is not None:
            rows.append(row)
            owned |= row.loss_call_ids()
    if cfg.branch_policy == "terminal_chain":
        for record in records:
            lost.setdefault(record.model_call_id, EXCLUDED_BY_BRANCH_POLICY)
    kept_tokens = sum(row.num_generated_tokens for row in rows)
    return KeptRollout(
        ev.rollout_id, ev.group_index, ev.sample_index, tuple(rows), reward, terminal.selection,
        _yield(ev, owned, abandoned, lost, unstaged, kept_tokens, leaves),
    )


def _yield(ev: RolloutEvidence, owned: set[str], abandoned: frozenset[str], lost: Mapping[str, str],
           unstaged: Mapping[str, str], kept_tokens: int, chains: int) -> RolloutYield:
    lineage = call_lineage(ev)
    if ev.served is None:
        return RolloutYield(None, kept_tokens, (), chains, abandoned_retry_calls=len(abandoned), lineage=lineage)
    committed = {r.model_call_id for r in ev.manifest.records}
    by_reason: dict[str, int] = {}
    abandoned_tokens = 0
    for call in ev.served:
        if call.model_call_id in owned:
            continue
        if call.model_call_id in abandoned:
            abandoned_tokens += call.generated_tokens
            continue
        if call.model_call_id in lost:
            reason = lost[call.model_call_id]
        elif call.model_call_id in unstaged or not call.staged:
            reason = SERVED_NOT_STAGED
        elif call.model_call_id not in committed:
            reason = STAGED_NOT_COMMITTED
        else:
            reason = EXCLUDED_BY_BRANCH_POLICY
        by_reason[reason] = by_reason.get(reason, 0) + call.generated_tokens
    served_total = sum(call.generated_tokens for call in ev.served)
    return RolloutYield(served_total, kept_tokens, tuple(sorted((r, n) for r, n in by_reason.items() if n)), chains,
                        abandoned_retry_calls=len(abandoned), abandoned_retry_tokens=abandoned_tokens, lineage=lineage)
