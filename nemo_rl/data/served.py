"""What the generation workers served, per rollout: the worker-side witness of every admitted call.

Contract:
- A `ServedCall` is written by the vLLM worker for every call that arrived with an `ng_capture`
  admission and produced a completion, whether or not its delta was staged. It is the only
  source of (a) the generated-token count the yield metric divides by (the workers' own
  counters, never the ledger) and (b) the parent of a call that was served but not staged
  (Gym's failure rows carry no parent), so the judge can poison exactly the chain it was on.
- `staged` is True exactly when the call's delta is durable in the staging store and the
  response carried `disposition="staged"` coordinates; otherwise `failure` names why.
- `unresolved_continuation` is True exactly for a `text` admission (the gate's lineage decision:
  a new root) whose request history holds an assistant turn (`has_assistant_turn`, the worker's
  observation of the messages it rendered): the conversation continued, but the gate found no
  captured parent, because the harness re-rendered or edited what the model said. A `token_in`
  call is a resolved continuation and never carries the flag; a root whose history has no
  assistant turn (first call, compaction summary, sub-agent) is not a continuation at all.
- `has_assistant_turn(messages)` applies Gym's own rule for "the request has assistant
  output" (`assistant_fingerprint` is empty exactly when no item is assistant-authored: role
  `assistant`, or a Responses `function_call` item), without hashing the conversation.
- Records cross the Ray boundary as plain dicts (`to_wire` / `from_wire`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


class ServedCallError(ValueError):
    """A served-call record violates its invariants (a worker bug or a version mismatch)."""


def has_assistant_turn(messages: Sequence[Any]) -> bool:
    """Whether a request's history holds model-authored output (Gym's rule; see the module contract)."""
    return any(
        isinstance(message, dict) and (message.get("role") == "assistant" or message.get("type") == "function_call")
        for message in messages
    )


@dataclass(frozen=True, slots=True)
class ServedCall:
    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    mode: str  # "text" (a chain root) or "token_in" (a continuation)
    generated_tokens: int
    staged: bool
    failure: str | None = None  # why the delta was not staged; None when staged
    worker_index: int = 0
    unresolved_continuation: bool = False  # text admission, history with assistant turns (see the contract)

    def __post_init__(self) -> None:
        where = f"ServedCall {self.rollout_id}/{self.model_call_id}"
        if not self.rollout_id or not self.model_call_id:
            raise ServedCallError(f"{where}: rollout_id and model_call_id must be non-empty")
        if self.mode not in ("text", "token_in"):
            raise ServedCallError(f"{where}: mode must be 'text' or 'token_in', got {self.mode!r}")
        if (self.mode == "text") != (self.parent_call_id is None):
            raise ServedCallError(f"{where}: a text root has no parent and a token_in call has one")
        if type(self.generated_tokens) is not int or self.generated_tokens < 0:
            raise ServedCallError(f"{where}: generated_tokens must be a non-negative int")
        if self.staged != (self.failure is None):
            raise ServedCallError(f"{where}: a staged call has no failure and an unstaged call names one")
        if type(self.unresolved_continuation) is not bool or (self.unresolved_continuation and self.mode != "text"):
            raise ServedCallError(f"{where}: unresolved_continuation is a bool, True only for a text admission "
                                  f"(got {self.unresolved_continuation!r} on a {self.mode} call)")

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "ServedCall":
        try:
            return cls(**data)
        except TypeError as e:
            raise ServedCallError(f"served-call record has unexpected fields: {sorted(data)}") from e
