"""Turn one rollout into a `TrainRow` or a typed `Placeholder` (pure functions, never raise on data).

Capture path, `finalize_rollout(receipt, snapshots, *, group_index, sample_index)`:
- `snapshots` are the staged base snapshots for the receipt's manifest rows, in manifest order.
- A poisoned receipt becomes a placeholder (`poison_reason`), a missing reward becomes
  `reward_missing`; otherwise Gym's `verify_and_linearize` decides. Its
  `ReceiptVerificationError` becomes `capture_poisoned` (codes rollout_failed/capture_poisoned)
  or `verification_failed`, with `detail` = the error code.
- A verified row counts its terminal-chain calls by mode (token_in vs text root).

Legacy path (capture off), `legacy_row_from_result(run_result, ...)`, rebuilds NeMo-RL's row from
Gym's token echo: every `/run` output item that carries `generation_token_ids` is one model call
with `prompt_token_ids` and `generation_log_probs`. Each call's prompt must extend the sequence
seen so far; its new prompt tokens `prompt_token_ids[seen:]` are appended as carry (mask 0,
logprob 0.0) and its generated tokens as mask 1 with their logprobs. Missing echo, malformed echo,
a non-extending prompt or no generated token at all yield typed placeholders.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nemo_gym.token_id_capture.staging import (
    ReceiptVerificationError,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    verify_and_linearize,
)

from nemo_rl.token_capture.receipt import poison_reason, reward_of
from nemo_rl.token_capture.rows import GroupEntry, Placeholder, PlaceholderReason, RowOrigin, TrainRow

_POISON_CODES = frozenset({"rollout_failed", "capture_poisoned"})
_ECHO_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def receipt_placeholder(
    receipt: RolloutReceipt, reason: PlaceholderReason, detail: str, *, group_index: int, sample_index: int
) -> Placeholder:
    """A placeholder for this receipt's rollout, keeping its reward and terminal method."""
    return Placeholder(
        rollout_id=receipt.rollout_id,
        group_index=group_index,
        sample_index=sample_index,
        reason=reason,
        detail=detail,
        reward=receipt.reward,
        terminal_selection=receipt.terminal_selection,
    )


def placeholder_for_poisoned(receipt: RolloutReceipt, *, group_index: int, sample_index: int) -> Placeholder:
    """The placeholder for a receipt that `assemble_receipt` poisoned (no snapshots needed)."""
    if not receipt.capture_poisoned:
        raise ValueError(f"receipt {receipt.rollout_id} is not poisoned; finalize it with finalize_rollout")
    detail = receipt.failure_reason or ""
    return receipt_placeholder(
        receipt, poison_reason(receipt), detail, group_index=group_index, sample_index=sample_index
    )


def finalize_rollout(
    receipt: RolloutReceipt,
    snapshots: Sequence[StagedCallBaseSnapshot],
    *,
    group_index: int,
    sample_index: int,
) -> GroupEntry:
    """Verify and linearize one receipt; every rejection is a typed placeholder."""
    slot = {"group_index": group_index, "sample_index": sample_index}
    if receipt.capture_poisoned:
        return placeholder_for_poisoned(receipt, **slot)
    if receipt.reward is None:
        return receipt_placeholder(receipt, PlaceholderReason.REWARD_MISSING, "run result has no finite reward", **slot)
    try:
        row = verify_and_linearize(receipt, snapshots)
    except ReceiptVerificationError as error:
        poisoned = error.code in _POISON_CODES
        reason = PlaceholderReason.CAPTURE_POISONED if poisoned else PlaceholderReason.VERIFICATION_FAILED
        return receipt_placeholder(receipt, reason, error.code, **slot)
    modes = {record.model_call_id: record.mode for record in receipt.manifest}
    token_in = sum(1 for call_id in row.model_call_ids if modes[call_id] == "token_in")
    return TrainRow(
        rollout_id=receipt.rollout_id,
        group_index=group_index,
        sample_index=sample_index,
        token_ids=tuple(row.token_ids),
        token_mask=tuple(row.token_mask),
        generation_logprobs=tuple(row.logprobs),
        reward=receipt.reward,
        prompt_len=row.prompt_len,
        model_call_ids=tuple(row.model_call_ids),
        weight_versions=tuple(row.weight_versions),
        token_in_calls=token_in,
        text_root_calls=len(row.model_call_ids) - token_in,
        terminal_selection=receipt.terminal_selection,
        origin=RowOrigin.CAPTURE,
    )


def _echo_problem(item: dict[str, Any]) -> str | None:
    """Why one echoed call's token fields are unusable, or None when they are well formed."""
    missing = [name for name in _ECHO_FIELDS if name not in item]
    if missing:
        return f"output item {item.get('id')!r} lacks {missing}"
    prompt, generated, logprobs = (item[name] for name in _ECHO_FIELDS)
    for name, ids in (("prompt_token_ids", prompt), ("generation_token_ids", generated)):
        if not isinstance(ids, list) or any(type(t) is not int or t < 0 for t in ids):
            return f"{name} of item {item.get('id')!r} must be a list of non-negative ints"
    if not isinstance(logprobs, list) or len(logprobs) != len(generated):
        return f"item {item.get('id')!r}: generation_log_probs must be a list as long as generation_token_ids"
    if any(isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) for p in logprobs):
        return f"item {item.get('id')!r}: generation_log_probs must be finite numbers"
    return None


def legacy_row_from_result(
    run_result: dict[str, Any], *, rollout_id: str, group_index: int, sample_index: int
) -> GroupEntry:
    """Rebuild the legacy token-echo row (see the module docstring); never raises for bad data."""
    reward = reward_of(run_result)

    def placeholder(reason: PlaceholderReason, detail: str) -> Placeholder:
        return Placeholder(rollout_id, group_index, sample_index, reason, detail, reward)

    response = run_result.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    if not isinstance(output, list):
        return placeholder(PlaceholderReason.LEGACY_TOKEN_ECHO_MISSING, "run result has no response.output list")
    calls = [item for item in output if isinstance(item, dict) and any(name in item for name in _ECHO_FIELDS)]
    if not calls:
        return placeholder(PlaceholderReason.LEGACY_TOKEN_ECHO_MISSING, "no output item carries generation_token_ids")

    token_ids: list[int] = []
    token_mask: list[float] = []
    logprobs: list[float] = []
    call_ids: list[str] = []
    prompt_len = 0
    for index, item in enumerate(calls):
        problem = _echo_problem(item)
        if problem is not None:
            return placeholder(PlaceholderReason.LEGACY_INVALID_ECHO, problem)
        prompt = item["prompt_token_ids"]
        if prompt[: len(token_ids)] != token_ids:
            return placeholder(
                PlaceholderReason.LEGACY_NONCONTIGUOUS,
                f"call {index} prompt ({len(prompt)} ids) does not extend the {len(token_ids)} ids seen so far",
            )
        carry = prompt[len(token_ids):]
        if index == 0:
            prompt_len = len(carry)
        token_ids += carry + item["generation_token_ids"]
        token_mask += [0.0] * len(carry) + [1.0] * len(item["generation_token_ids"])
        logprobs += [0.0] * len(carry) + [float(p) for p in item["generation_log_probs"]]
        call_ids.append(str(item.get("id") or f"call-{index}"))

    if 1.0 not in token_mask:
        return placeholder(PlaceholderReason.EMPTY_GENERATION, f"{len(calls)} echoed calls generated no token")
    if reward is None:
        return placeholder(PlaceholderReason.REWARD_MISSING, "run result has no finite reward")
    return TrainRow(
        rollout_id=rollout_id,
        group_index=group_index,
        sample_index=sample_index,
        token_ids=tuple(token_ids),
        token_mask=tuple(token_mask),
        generation_logprobs=tuple(logprobs),
        reward=reward,
        prompt_len=prompt_len,
        model_call_ids=tuple(call_ids),
        weight_versions=(None,) * len(call_ids),
        token_in_calls=0,
        text_root_calls=0,
        terminal_selection=None,
        origin=RowOrigin.LEGACY,
    )
