"""The Responses API's top-level fields on the capture route: which are accepted, which refused (pure).

Gym's `vllm_model` serves `/v1/responses` by downconverting the request to chat completions and
refuses some fields outright (`include` even when empty, which the OpenAI Agents SDK always sends).
`normalize_responses_request(body)` applies `RESPONSES_FIELD_RULES`: a field with a faithful meaning
on this path (it changes neither the prompt the engine renders nor the tokens it samples, or the
path already behaves that way) is accepted and, when Gym has no use for it, dropped; any other value
raises `RequestFieldError` naming the field, the value and the fix (the gate answers 400). It
returns `body` itself when nothing changes. Invariant: `input`, `instructions`, `tools`,
`tool_choice` and sampling fields are never touched, so Gym's lineage fingerprints read what the
client sent. The table: docs/guides/token-capture.md, "Responses API fields".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nemo_rl.data.calls import RequestFieldError, rewrite_json_body, show
from nemo_rl.environments.gate.required_prefix import drop_empty_required_prefix_bytes

# `include` values the path honours without changing the tokens: there is nothing to encrypt (the
# model's reasoning is its own text, returned as reasoning items), so it is answered with nothing.
HONOURED_INCLUDES = frozenset({"reasoning.encrypted_content"})
ACCEPTED_SERVICE_TIERS = frozenset({"auto", "default"})
# `reasoning` sub-fields Gym's converter maps (`effort` -> `reasoning_effort`, rendered by the chat template).
MAPPED_REASONING_FIELDS = frozenset({"effort"})


@dataclass(frozen=True)
class FieldRule:
    """One top-level field: the values accepted, whether an accepted value is dropped, and the fix."""

    field: str
    accepts: Callable[[Any], bool]
    drop: bool  # an accepted value is removed before Gym's converter (it has no chat representation)
    accepted: str  # what is accepted and why it is faithful (the docs' table)
    fix: str  # what the client should send instead

    def __post_init__(self) -> None:
        if not (self.field and self.accepted and self.fix):
            raise ValueError(f"FieldRule {self.field!r} needs a field, an accepted text and a fix")


def _include_ok(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v in HONOURED_INCLUDES for v in value)


def _reasoning_ok(value: Any) -> bool:
    return isinstance(value, dict) and all(v is None for k, v in value.items() if k not in MAPPED_REASONING_FIELDS)


def _text_ok(value: Any) -> bool:
    if not isinstance(value, dict) or value.get("verbosity") is not None:
        return False
    fmt = value.get("format")
    return fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")


def _never(_value: Any) -> bool:
    return False


RESPONSES_FIELD_RULES: tuple[FieldRule, ...] = (
    FieldRule("include", _include_ok, True,
              f"a list of {sorted(HONOURED_INCLUDES)} or empty: nothing is encrypted, so it is answered with nothing",
              "omit the other include values (ModelSettings.response_include / top_logprobs): the capture route "
              "records logprobs itself and serves no hosted tools"),
    FieldRule("store", lambda v: v is False, True, "false: the gate stores no response (that is what false asks)",
              "send store=false or omit it: the gate keeps no retrievable responses"),
    # `false` is accepted but not enforced: the engine cannot stop the model at one call, and cutting
    # the reply would train tokens the client never saw, so every call written is returned (Gym's
    # own example_multi_step sends false, and its agent runs every call it gets).
    FieldRule("parallel_tool_calls", lambda v: isinstance(v, bool), True,
              "true or false: the engine's tool parser returns every tool call the model wrote in a turn "
              "(false is not enforced: cutting the reply would train tokens the client never saw)",
              "send a boolean or omit it"),
    FieldRule("truncation", lambda v: v == "disabled", True,
              "'disabled': a history longer than the context is refused 400, never cut",
              "send truncation='disabled' or omit it, and shorten the history in the harness: the gate never "
              "drops input items"),
    FieldRule("reasoning", _reasoning_ok, False,
              "only `effort` (Gym maps it to reasoning_effort, rendered into the prompt the engine sees)",
              "omit reasoning.summary / generate_summary: the reasoning this path returns is the model's own text"),
    FieldRule("metadata", lambda v: isinstance(v, dict), True, "any object: it is not model input",
              "send metadata as a JSON object"),
    FieldRule("prompt_cache_key", lambda v: isinstance(v, str), True,
              "any string: the engine's prefix cache is automatic and never changes the tokens",
              "send prompt_cache_key as a string"),
    FieldRule("prompt_cache_retention", lambda v: isinstance(v, str), True,
              "any string: a cache hint that never changes the tokens", "send prompt_cache_retention as a string"),
    FieldRule("service_tier", lambda v: v in ACCEPTED_SERVICE_TIERS, True,
              f"{sorted(ACCEPTED_SERVICE_TIERS)}: the gate serves every call alike",
              "send service_tier='auto' or omit it: the gate has no tiers"),
    FieldRule("user", lambda v: isinstance(v, str), True, "any string: an end-user tag, not model input",
              "send user as a string"),
    FieldRule("safety_identifier", lambda v: isinstance(v, str), True, "any string: not model input",
              "send safety_identifier as a string"),
    FieldRule("text", _text_ok, True, "format.type 'text' without verbosity: plain text is what the engine samples",
              "omit text.format json_schema/json_object and text.verbosity; state the format in the instructions and "
              "parse it in the harness: constrained decoding samples from a masked distribution whose logprobs the "
              "trainer does not reproduce"),
    FieldRule("background", lambda v: v is False, True, "false: every call is answered in its request",
              "omit background: the gate answers each call in its own request"),
    FieldRule("previous_response_id", _never, True, "nothing: the gate stores no responses",
              "send the whole history in `input` (the Agents SDK does unless previous_response_id or "
              "auto_previous_response_id is set): the gate stores no responses to continue from"),
    FieldRule("conversation", _never, True, "nothing: the gate stores no conversations",
              "send the whole history in `input`: the gate stores no conversations"),
    FieldRule("max_tool_calls", _never, True, "nothing: the harness runs the tool loop, not the gate",
              "bound the tool loop in the harness (Runner.run(max_turns=...))"),
    FieldRule("prompt", _never, True, "nothing: the gate has no stored prompt templates",
              "send the prompt's text as instructions and input"),
    FieldRule("context_management", _never, True, "nothing: server-side compaction would rewrite the history",
              "compact the history in the harness (the gate keeps rewritten histories as new branches)"),
)
RULES_BY_FIELD = {rule.field: rule for rule in RESPONSES_FIELD_RULES}


def refusal(rule: FieldRule, value: Any) -> RequestFieldError:
    """The 400 for a refused value: the field, the value, what is accepted and the fix."""
    return RequestFieldError(
        rule.field,
        f"Responses field {rule.field}={show(value)} has no faithful meaning on the capture route "
        f"(accepted: {rule.accepted}); fix: {rule.fix}",
    )


def normalize_responses_request(body: Any) -> Any:
    """`body` with accepted fields dropped where `RESPONSES_FIELD_RULES` says so; raises on a refused one."""
    if not isinstance(body, dict):
        return body
    drop: list[str] = []
    for field, rule in RULES_BY_FIELD.items():
        if field not in body:
            continue
        value = body[field]
        if value is None:  # JSON null is "not set" (Gym's converter drops nulls too)
            drop.append(field)
            continue
        if not rule.accepts(value):
            raise refusal(rule, value)
        if rule.drop:
            drop.append(field)
    if not drop:
        return body
    return {k: v for k, v in body.items() if k not in drop}


def normalize_responses_body(raw: bytes) -> bytes:
    """The raw bytes after `normalize_responses_request`; the same object when nothing changed.

    Bytes that are not a JSON object are returned unchanged (the guard refuses them first).
    Raises `RequestFieldError` for a refused field.
    """
    return rewrite_json_body(raw, normalize_responses_request)


def normalize_responses_post(raw: bytes) -> bytes:
    """A Responses body after `normalize_responses_body`, without a null or [] `required_prefix_token_ids`."""
    return drop_empty_required_prefix_bytes(normalize_responses_body(raw))
