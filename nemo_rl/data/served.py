"""What the generation workers served, per rollout: the worker-side witness of every admitted call.

A `ServedCall` is written by the vLLM worker for every admitted call that produced a completion,
staged or not. It is the only source of the generated-token count the yield divides by (the
workers' own counters) and of the parent of a served-but-unstaged call, so the judge can drop
exactly the chain it was on. Invariants: `staged` is True exactly when the delta is durable and
the reply carried staged coordinates (else `failure` says why); `unresolved_continuation` is
True exactly for a `text` admission whose history holds an assistant turn (Gym's own rule,
`has_assistant_turn`). Records cross Ray as plain dicts (`to_wire` / `from_wire`).
See docs/design-docs/token-capture-receipts.md, "The served witness".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from nemo_rl.data.errors import FatalError


class ServedCallError(FatalError, ValueError):
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
