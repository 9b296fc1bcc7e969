"""Is every loss token of a judged rollout exactly what the engine sampled? (pure)

Contract of `check_rows_exact(rows, records, engine) -> ExactnessReport`:
- `rows` are the `TrainRow`s of one `KeptRollout`; `records` the rollout's manifest
  `CallRecord`s (fetched before retention retires the ledger); `engine` the workers'
  `engine_records` keyed by engine request id (= the completion id the client received = the
  record's `response_id`).
- For each call of each row (its `call_spans` entry): the call's engine record is looked up via
  the manifest's `response_id`. With `g` = the number of tokens the engine generated for it,
  the last `g` tokens of the call's span must equal the engine's generated ids and the tokens
  before them (the whole row prefix) the engine's prompt ids.
- Every loss token (mask 1.0) must lie in the generated tail of its call and carry the engine's
  logprob for that position, compared with `==` (no tolerance). A call with loss tokens but no
  engine record, or any prefix/id mismatch on such a call, fails the check.
- `exact` is true only when there is at least one loss token and all of them were checked and
  matched. Calls without loss tokens (owned by an earlier row) are still compared and reported
  in `calls`, but only loss-bearing calls decide `exact`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_gym.token_id_capture.staging import CallRecord

from nemo_rl.token_capture.rows import TrainRow


@dataclass(frozen=True)
class CallCheck:
    chain_index: int
    model_call_id: str
    response_id: str | None
    loss_tokens: int
    engine_record: bool
    prompt_match: bool
    ids_match: bool
    logprobs_match: bool
    loss_in_generated: bool

    @property
    def ok(self) -> bool:
        if self.loss_tokens == 0:
            return True
        return self.engine_record and self.prompt_match and self.ids_match and self.logprobs_match and self.loss_in_generated


@dataclass(frozen=True)
class ExactnessReport:
    calls: tuple[CallCheck, ...]
    loss_tokens: int
    checked_loss_tokens: int
    problems: tuple[str, ...] = field(default=())

    @property
    def exact(self) -> bool:
        return self.loss_tokens > 0 and self.checked_loss_tokens == self.loss_tokens and not self.problems


def _check_call(row: TrainRow, call_id: str, start: int, end: int, record: CallRecord | None,
                engine: Mapping[str, Mapping[str, Any]]) -> tuple[CallCheck, int]:
    loss = [i for i in range(start, end) if row.token_mask[i] == 1.0]
    response_id = record.response_id if record is not None else None
    sample = engine.get(response_id) if response_id else None
    if sample is None:
        return CallCheck(row.chain_index, call_id, response_id, len(loss), False, False, False, False, False), 0
    generated = [int(t) for t in sample["token_ids"]]
    logprobs = [float(lp) for lp in sample["logprobs"]]
    gen_start = end - len(generated)
    fits = start <= gen_start < end and len(logprobs) == len(generated)
    prompt_match = fits and list(row.token_ids[:gen_start]) == [int(t) for t in sample["prompt_token_ids"]]
    ids_match = fits and list(row.token_ids[gen_start:end]) == generated
    in_generated = fits and all(i >= gen_start for i in loss)
    logprobs_match = in_generated and all(row.generation_logprobs[i] == logprobs[i - gen_start] for i in loss)
    check = CallCheck(row.chain_index, call_id, response_id, len(loss), True, prompt_match, ids_match,
                      logprobs_match, in_generated)
    return check, (len(loss) if check.ok else 0)


def check_rows_exact(rows: Sequence[TrainRow], records: Sequence[CallRecord],
                     engine: Mapping[str, Mapping[str, Any]]) -> ExactnessReport:
    by_call = {r.model_call_id: r for r in records}
    calls: list[CallCheck] = []
    problems: list[str] = []
    total = checked = 0
    for row in rows:
        total += row.num_generated_tokens
        if len(row.call_spans) != len(row.model_call_ids):
            problems.append(f"row {row.chain_index}: {len(row.call_spans)} spans for {len(row.model_call_ids)} calls")
            continue
        for call_id, (start, end) in zip(row.model_call_ids, row.call_spans):
            check, ok_tokens = _check_call(row, call_id, start, end, by_call.get(call_id), engine)
            calls.append(check)
            checked += ok_tokens
            if not check.ok:
                problems.append(
                    f"row {row.chain_index} call {call_id} (response {check.response_id}): engine_record="
                    f"{check.engine_record} prompt={check.prompt_match} ids={check.ids_match} "
                    f"logprobs={check.logprobs_match} loss_in_generated={check.loss_in_generated}"
                )
    return ExactnessReport(tuple(calls), total, checked, tuple(problems))
