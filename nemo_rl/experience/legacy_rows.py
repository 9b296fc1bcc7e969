"""Capture off: rebuild a rollout's row from Gym's token echo (the legacy path, pure).

`legacy_row_from_result` never raises for bad data: each echoed call's prompt must extend the
sequence seen so far; new prompt tokens are carry (mask 0), generated tokens mask 1; a missing,
malformed or non-extending echo, an empty generation or a missing reward is a typed placeholder.
Rows it builds are `RowOrigin.LEGACY`: no staged digests stand behind them.
See docs/design-docs/token-capture-receipts.md, "Snapshots and legacy rows".
"""

from __future__ import annotations

import math
from typing import Any

from nemo_rl.data.rows import GroupEntry, KeptRollout, Placeholder, PlaceholderReason, RowOrigin, TrainRow
from nemo_rl.token_capture.judge import reward_of

_ECHO_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


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
    entry = _legacy_entry(run_result, rollout_id=rollout_id, group_index=group_index, sample_index=sample_index)
    if isinstance(entry, TrainRow):
        return KeptRollout(rollout_id, group_index, sample_index, (entry,), entry.reward, None)
    return entry


def _legacy_entry(
    run_result: dict[str, Any], *, rollout_id: str, group_index: int, sample_index: int
) -> TrainRow | Placeholder:
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
