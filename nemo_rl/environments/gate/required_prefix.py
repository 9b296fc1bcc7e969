"""`required_prefix_token_ids` at the gate: what Gym's compaction agent sends and what it means here.

Gym 0.7.0's `simple_agent_with_compaction` puts the field on every Responses request: null when
its context history is off (its default), else its previous call's prompt + sampled ids, read
from the model server's token echo, asking that the next prompt begin with exactly those ids.
On the capture path the worker builds every continuation from the staged parent's exact ids
and serves no token echo, so the faithful reading is: null or [] (no requirement) is accepted
and dropped before Gym's request model (which forbids the field) sees it; nothing the lineage
fingerprint reads changes. A non-empty list is refused 400 naming the field, its length and the
fix (this path cannot serve the echo it is built from); any other value is refused 400 naming
it. Pure functions; the guard and the normaliser (`app`) call them.
"""

from __future__ import annotations

from typing import Any

from nemo_rl.data.calls import RequestFieldError, rewrite_json_body, show

FIELD = "required_prefix_token_ids"


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_required_prefix(body: dict) -> None:
    """Raise `RequestFieldError` unless `body`'s `required_prefix_token_ids` is absent, null or []."""
    if FIELD not in body or body[FIELD] is None:
        return
    value = body[FIELD]
    if not isinstance(value, list) or not all(_is_token_id(t) for t in value):
        raise RequestFieldError(
            FIELD,
            f"{FIELD} must be null or a list of token ids (integers >= 0), got {show(value)}; "
            "fix: send null (no prefix requirement)",
        )
    if value:
        raise RequestFieldError(
            FIELD,
            f"{FIELD} holds {len(value)} ids: an exact physical prefix read from a token echo, which the "
            "capture path does not serve (the worker continues every call from the staged parent's exact "
            "ids itself); fix: send null, e.g. simple_agent_with_compaction with "
            "context_history.enabled=false (its default)",
        )


def drop_empty_required_prefix(body: Any) -> Any:
    """`body` without a null or [] `required_prefix_token_ids`; `body` itself when nothing changes."""
    if isinstance(body, dict) and FIELD in body and body[FIELD] in (None, []):
        return {k: v for k, v in body.items() if k != FIELD}
    return body


def drop_empty_required_prefix_bytes(raw: bytes) -> bytes:
    """The raw request after `drop_empty_required_prefix`; `raw` itself when nothing changes or it is not JSON."""
    if FIELD.encode("ascii") not in raw:
        return raw
    return rewrite_json_body(raw, drop_empty_required_prefix)
