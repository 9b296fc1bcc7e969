"""Audit a verified row against the engine's own record of what it sampled (pure).

`audit_row` and `audit_train_row` require, call by call, the engine's prompt ids and sampled
ids to equal the row's, every loss token to lie in its call's generated tail with the engine's
logprob; a call without an engine record is a mismatch, never skipped.
`retokenization_drift(tokenizer, ids)` says whether decoding and re-encoding the row changes
any id: what a text pipeline would have trained on.
See docs/design-docs/token-capture-receipts.md, "Auditing a row against the engine".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_gym.token_id_capture.staging import CallRecord, LinearizedRow

from nemo_rl.data.rows import TrainRow


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class CallAudit:
    model_call_id: str
    prompt_match: bool
    ids_match: bool
    max_abs_logprob_diff: float


@dataclass(frozen=True)
class AuditResult:
    calls: tuple[CallAudit, ...]

    @property
    def ids_match(self) -> bool:
        return bool(self.calls) and all(c.ids_match and c.prompt_match for c in self.calls)

    @property
    def max_abs_logprob_diff(self) -> float:
        return max((c.max_abs_logprob_diff for c in self.calls), default=float("inf"))


def audit_row(row: LinearizedRow, records: Sequence[CallRecord], engine: Mapping[str, Mapping[str, Any]]) -> AuditResult:
    by_call = {r.model_call_id: r for r in records}
    audits: list[CallAudit] = []
    start = 0
    for call_id, carry_len, gen_len in row.link_spans:
        gen_start = start + carry_len
        gen_end = gen_start + gen_len
        record = by_call.get(call_id)
        sample = engine.get(record.response_id) if record is not None and record.response_id else None
        if sample is None:
            audits.append(CallAudit(call_id, False, False, float("inf")))
        else:
            row_gen = row.token_ids[gen_start:gen_end]
            diffs = [abs(a - b) for a, b in zip(row.logprobs[gen_start:gen_end], sample["logprobs"])]
            audits.append(
                CallAudit(
                    model_call_id=call_id,
                    prompt_match=list(sample["prompt_token_ids"]) == row.token_ids[:gen_start],
                    ids_match=list(sample["token_ids"]) == row_gen,
                    max_abs_logprob_diff=max(diffs, default=0.0) if len(sample["logprobs"]) == gen_len else float("inf"),
                )
            )
        start = gen_end
    return AuditResult(tuple(audits))


def audit_train_row(
    row: TrainRow, records: Sequence[CallRecord], engine: Mapping[str, Mapping[str, Any]]
) -> AuditResult:
    by_call = {r.model_call_id: r for r in records}
    audits: list[CallAudit] = []
    for call_id, (start, end) in zip(row.model_call_ids, row.call_spans):
        record = by_call.get(call_id)
        sample = engine.get(record.response_id) if record is not None and record.response_id else None
        if sample is None or not start <= end - len(sample["token_ids"]):
            audits.append(CallAudit(call_id, False, False, float("inf")))
            continue
        gen_start = end - len(sample["token_ids"])
        loss_on_prompt = any(row.token_mask[i] == 1.0 for i in range(start, gen_start))
        diffs = [
            abs(row.generation_logprobs[i] - sample["logprobs"][i - gen_start])
            for i in range(gen_start, end) if row.token_mask[i] == 1.0
        ]
        audits.append(
            CallAudit(
                model_call_id=call_id,
                prompt_match=not loss_on_prompt and list(sample["prompt_token_ids"]) == list(row.token_ids[:gen_start]),
                ids_match=list(sample["token_ids"]) == list(row.token_ids[gen_start:end]),
                max_abs_logprob_diff=max(diffs, default=0.0) if len(sample["logprobs"]) == end - gen_start else float("inf"),
            )
        )
    return AuditResult(tuple(audits))


def retokenization_drift(tokenizer: TextTokenizer, ids: Sequence[int]) -> bool:
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False) != list(ids)
