"""The one rollout-id rule: how the driver mints ids and which ids every process accepts.

A usable id is 1..`max_chars` ASCII letters, digits, '.', '_' or '-', starting with a letter or
digit (Gym's charset, narrowed: never `.`/`..` or option-like). It becomes a URL path segment, a
ledger file stem and a staging-key prefix. `check_rollout_id` returns the id or raises
`RolloutIdError` (a `ValueError`); `rollout_id_for` mints
`"<run_id>-s<step>-g<group>-i<index>-a<attempt>"` and checks it at the default limit.
Invariant: distinct (step, group, index, attempt) give distinct ids within a run, and every
minted id passes a gate left at its default limit.
See docs/design-docs/token-capture-receipts.md, "Rollout ids".
"""

from __future__ import annotations

from typing import Any

from nemo_rl.data.errors import RecoverableError
from nemo_rl.data.request_rules import show

MAX_ROLLOUT_ID_CHARS = 200
DEFAULT_MAX_ROLLOUT_ID_CHARS = 128
ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class RolloutIdError(RecoverableError, ValueError):
    """A rollout id breaks the rule; `problem` says how, the message adds the rule."""

    def __init__(self, problem: str, max_chars: int) -> None:
        self.problem = problem
        self.rule = rollout_id_rule(max_chars)
        super().__init__(f"{problem}; {self.rule}")


def rollout_id_rule(max_chars: int) -> str:
    return f"a rollout id is 1..{max_chars} ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_rollout_id(rollout_id: Any, max_chars: int = DEFAULT_MAX_ROLLOUT_ID_CHARS) -> str:
    """`rollout_id` itself when usable, else `RolloutIdError` (see the module contract)."""
    if type(max_chars) is not int or not 1 <= max_chars <= MAX_ROLLOUT_ID_CHARS:
        raise ValueError(f"max_chars={max_chars!r}: a rollout-id limit is an int in 1..{MAX_ROLLOUT_ID_CHARS}")
    if not isinstance(rollout_id, str):
        raise RolloutIdError(f"the rollout id is a {type(rollout_id).__name__}, not a str", max_chars)
    if not rollout_id:
        raise RolloutIdError("the rollout id is empty", max_chars)
    if len(rollout_id) > max_chars:
        raise RolloutIdError(f"rollout id of {len(rollout_id)} characters is too long", max_chars)
    bad = sorted({c for c in rollout_id if c not in ID_CHARS})
    if bad or not rollout_id[0].isalnum():
        why = f"it contains {show(''.join(bad))}" if bad else f"it starts with {show(rollout_id[0])}"
        raise RolloutIdError(f"rollout id {show(rollout_id)} is not usable: {why}", max_chars)
    return rollout_id


def rollout_id_for(run_id: str, step: int, group_index: int, sample_index: int, attempt: int) -> str:
    """The id of one attempt of one sample (see the module contract)."""
    return check_rollout_id(f"{run_id}-s{step}-g{group_index}-i{sample_index}-a{attempt}")
