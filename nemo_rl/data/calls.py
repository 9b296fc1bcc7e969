"""One model call's records and rules across processes: request rules, staged row, served witness (pure).

Rules (worker endpoint, gate, driver): `parse_json_body` is strict JSON; `check_chat_request` raises
`RequestFieldError` naming the first field at fault (its JSON path) and the fix; `bearer_status`
checks a control route's bearer in constant time; `check_rollout_id` is the one rollout-id rule.
Staged row (worker -> data plane -> finalizer): a Gym `StagedCallRecord` as one data-plane `Row`
(`record_to_row`), read back through Gym's models, which recompute the digests, against its key.
`ServedCall` (worker -> driver -> finalizer): every admitted call that produced a completion.
Invariants: a part or value is refused, never dropped; JSON booleans are never numbers; a minted
id passes a default gate; a row round-trips bit-exact; only the row codec loads torch (the gate
and Gym servers import the rules). Docs: token-capture-reliability.md ("The chat-request rules"),
vllm-worker-capture.md ("The staged-row codec"), token-capture-receipts.md ("The served witness").
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Union

from nemo_gym.token_id_capture.staging import (
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    compute_extras_digest,
    staging_key,
)
from pydantic import ValidationError

from nemo_rl.data.errors import RecordInvariantError, RecoverableError

if TYPE_CHECKING:
    import torch

# The chat-request rules (docs/design-docs/token-capture-reliability.md, "The chat-request rules").
ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MAX_VALUE_CHARS = 80


class RequestFieldError(RecoverableError, ValueError):
    """A request field is missing, of the wrong type or out of range (HTTP 400 naming `field`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def show(value: Any) -> str:
    """A bounded JSON rendering of a caller's value for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # not JSON data (only from Python callers)
        text = repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[:_MAX_VALUE_CHARS] + f"...<{len(text)} chars>"


def rewrite_json_body(raw: bytes, rewrite: Callable[[Any], Any]) -> bytes:
    """`raw` with its JSON passed through `rewrite`; `raw` itself when `rewrite` returns its argument or `raw`
    is not JSON (the guard or Gym answers such bytes as they would without the rewrite)."""
    try:
        body = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return raw
    rewritten = rewrite(body)
    if rewritten is body:
        return raw
    return json.dumps(rewritten, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _reject_constant(name: str) -> Any:
    raise RequestFieldError("body", f"request body contains {name}, which is not JSON (fix: send finite numbers)")


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON of a request body: NaN/Infinity, non-UTF-8 and too-deep nesting are refused on `body`."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as e:
        raise RequestFieldError("body", "request body nests JSON too deeply to parse") from e
    except UnicodeDecodeError as e:
        raise RequestFieldError("body", f"request body is not UTF-8 text: {e}") from e
    except json.JSONDecodeError as e:
        raise RequestFieldError("body", f"request body is not JSON: {e}") from e


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_token_count(body: dict, field: str, max_model_len: int) -> None:
    """`body[field]` is null/absent or an integer in 1..max_model_len-1."""
    value = body.get(field)
    if value is None:
        return
    if not _is_int(value):
        raise RequestFieldError(field, f"{field} must be an integer, got {_type_name(value)} {show(value)}")
    if value < 1:
        raise RequestFieldError(field, f"{field}={value} must be at least 1 (fix: ask for 1 or more tokens)")
    if value >= max_model_len:
        raise RequestFieldError(
            field,
            f"{field}={show(value)} does not fit this model's context: max_model_len={max_model_len} tokens for "
            f"prompt and completion together, so {field} must be at most {max_model_len - 1} (fix: lower {field})",
        )


def _check_optional(body: dict, field: str, ok: bool, expected: str) -> None:
    if not ok:
        value = body[field]
        raise RequestFieldError(field, f"{field} must be {expected}, got {_type_name(value)} {show(value)}")


def check_sampling_fields(body: dict, token_fields: Sequence[str], max_model_len: int) -> None:
    """The numeric sampling rules: token counts, temperature, top_p, seed."""
    for field in token_fields:
        check_token_count(body, field, max_model_len)
    temperature = body.get("temperature")
    if temperature is not None:
        _check_optional(
            body, "temperature", _is_number(temperature) and math.isfinite(temperature) and temperature >= 0,
            "a finite number >= 0",
        )
    top_p = body.get("top_p")
    if top_p is not None:
        _check_optional(body, "top_p", _is_number(top_p) and 0 < top_p <= 1, "a number in (0, 1]")
    seed = body.get("seed")
    if seed is not None:
        _check_optional(body, "seed", _is_int(seed) and INT64_MIN <= seed <= INT64_MAX, "a 64-bit integer")


def _check_text_parts(content: list, where: str) -> None:
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise RequestFieldError(at, f"{at} must be an object, got {_type_name(part)} {show(part)}")
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES:
            raise RequestFieldError(
                f"{at}.type",
                f"{at}.type={show(kind)} is not supported: this model serves text parts only "
                f"({', '.join(TEXT_PART_TYPES)})",
            )
        if not isinstance(part.get("text"), str):
            raise RequestFieldError(f"{at}.text", f"{at}.text must be a string, got {_type_name(part.get('text'))}")


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise RequestFieldError(where, f"{where} must be a list, got {_type_name(calls)} {show(calls)}")
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise RequestFieldError(at, f"{at} must be an object, got {_type_name(call)} {show(call)}")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise RequestFieldError(f"{at}.id", f"{at}.id must be a string, got {_type_name(call['id'])}")
        if call.get("type") not in (None, "function"):
            raise RequestFieldError(f"{at}.type", f"{at}.type must be 'function', got {show(call.get('type'))}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise RequestFieldError(f"{at}.function", f"{at}.function must be an object, got {_type_name(function)}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestFieldError(f"{at}.function.name", f"{at}.function.name must be a non-empty string")
        if not isinstance(function.get("arguments"), (str, dict)):
            raise RequestFieldError(
                f"{at}.function.arguments",
                f"{at}.function.arguments must be a JSON string or an object, got {_type_name(function.get('arguments'))}",
            )


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestFieldError(
            "messages", f"messages must be a non-empty list of messages, got {_type_name(messages)} {show(messages)}"
        )
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestFieldError(at, f"{at} must be an object, got {_type_name(message)} {show(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise RequestFieldError(f"{at}.role", f"{at}.role={show(role)} must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            _check_text_parts(content, f"{at}.content")
        elif content is not None and not isinstance(content, str):
            raise RequestFieldError(
                f"{at}.content", f"{at}.content must be a string, a list of text parts or null, got {_type_name(content)}"
            )
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise RequestFieldError(f"{at}.{key}", f"{at}.{key} must be a string, got {_type_name(message[key])}")
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestFieldError(f"{at}.tool_calls", f"{at}.tool_calls is only allowed on assistant messages")
            _check_tool_calls(message["tool_calls"], f"{at}.tool_calls")


def check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise RequestFieldError("tools", f"tools must be a list, got {_type_name(tools)} {show(tools)}")
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestFieldError(at, f"{at} must be an object, got {_type_name(tool)} {show(tool)}")
        if tool.get("type") not in (None, "function"):
            raise RequestFieldError(f"{at}.type", f"{at}.type must be 'function', got {show(tool.get('type'))}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestFieldError(f"{at}.function", f"{at}.function must be an object, got {_type_name(function)}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestFieldError(f"{at}.function.name", f"{at}.function.name must be a non-empty string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise RequestFieldError(f"{at}.function.parameters", f"{at}.function.parameters must be an object")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise RequestFieldError(f"{at}.function.description", f"{at}.function.description must be a string")


def check_stream_fields(body: dict) -> None:
    """`stream` is a boolean; `stream_options` goes only with `stream: true` and holds only a boolean
    `include_usage` (the one option whose meaning does not touch the tokens)."""
    stream = body.get("stream")
    if stream is not None:
        _check_optional(body, "stream", isinstance(stream, bool), "a boolean")
    options = body.get("stream_options")
    if options is None:
        return
    if stream is not True:
        raise RequestFieldError("stream_options", "stream_options is only valid with stream=true (fix: drop it)")
    if not isinstance(options, dict):
        raise RequestFieldError("stream_options", f"stream_options must be an object, got {_type_name(options)}")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise RequestFieldError(f"stream_options.{unknown[0]}",
                                f"stream_options.{unknown[0]} is not supported (only include_usage is)")
    if options.get("include_usage") is not None and not isinstance(options["include_usage"], bool):
        raise RequestFieldError("stream_options.include_usage", "stream_options.include_usage must be a boolean")


def check_chat_request(body: Any, *, max_model_len: int) -> None:
    """Raise `RequestFieldError` for the first field `body` gets wrong (JSON path, value and fix)."""
    if not isinstance(body, dict):
        raise RequestFieldError("body", f"request body must be a JSON object, got {_type_name(body)}")
    check_stream_fields(body)
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise RequestFieldError("n", f"n={show(body['n'])} is not supported: n must be 1 (custody is per single choice)")
    check_messages(body.get("messages"))
    check_tools(body.get("tools"))
    check_sampling_fields(body, ("max_tokens", "max_completion_tokens"), max_model_len)
    for field in ("logprobs", "return_token_ids"):
        if body.get(field) is not None:
            _check_optional(body, field, isinstance(body[field], bool), "a boolean")
    if body.get("top_logprobs") is not None:
        _check_optional(body, "top_logprobs", _is_int(body["top_logprobs"]) and body["top_logprobs"] >= 0, "an integer >= 0")
    if body.get("model") is not None:
        _check_optional(body, "model", isinstance(body["model"], str), "a string")
    prefix = body.get("required_prefix_token_ids")
    if prefix is not None:
        _check_optional(
            body,
            "required_prefix_token_ids",
            isinstance(prefix, list) and all(_is_int(t) and t >= 0 for t in prefix),
            "a list of token ids (integers >= 0)",
        )


def bearer_status(authorization: str | None, token: str) -> int | None:
    """Authorize a control request: None when `authorization` is `Bearer <token>`, 401 when no bearer
    credential is presented, 403 when a wrong one is. The comparison is constant-time
    (`hmac.compare_digest` over UTF-8 bytes); neither token appears in any message."""
    if not token:
        raise ValueError("a control route needs a non-empty bearer token")
    if not authorization:
        return 401
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return 401
    presented = credential.strip().encode("utf-8", errors="replace")
    return None if hmac.compare_digest(presented, token.encode("utf-8")) else 403


# The rollout-id rule (docs/design-docs/token-capture-receipts.md, "Rollout ids").
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
    """`rollout_id` itself when usable, else `RolloutIdError` naming the problem and the rule."""
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
    """`"<run_id>-s<step>-g<group>-i<index>-a<attempt>"`: distinct per attempt within a run."""
    return check_rollout_id(f"{run_id}-s{step}-g{group_index}-i{sample_index}-a{attempt}")


# The staged-row codec. What one data-plane row holds; the codecs (this module's, `train`'s) build rows that satisfy it.
# torch is imported where a row is built or read, not at load: the gate only needs the rules.
FieldValue = Union["torch.Tensor", str, bytes]
Row = dict[str, FieldValue]

TOKEN_IDS_FIELD = "token_ids_delta"
TOKEN_MASK_FIELD = "token_mask_delta"
LOGPROBS_FIELD = "generation_log_probs_delta"
HEADER_FIELD = "header"
EXTRAS_FIELD = "extras"
_ARRAY_FIELDS = (TOKEN_IDS_FIELD, TOKEN_MASK_FIELD, LOGPROBS_FIELD)
BASE_FIELDS = (*_ARRAY_FIELDS, HEADER_FIELD)
ALL_FIELDS = (*BASE_FIELDS, EXTRAS_FIELD)


class StagingFetchError(RecoverableError, RuntimeError):
    """A staged record could not be fetched as a valid snapshot."""


class StagedRecordInvalidError(StagingFetchError):
    """A stored row does not form a valid staged record (corrupt, foreign, or mis-keyed)."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        super().__init__(f"staged record under key {key!r} is invalid: {reason}")


class ExtrasDigestMismatchError(StagedRecordInvalidError):
    """A fetched extras payload does not hash to the digest it is bound to."""

    def __init__(self, key: str, expected: str, actual: str, bound_by: str) -> None:
        self.expected = expected
        self.actual = actual
        self.bound_by = bound_by
        super().__init__(
            key,
            f"extras digest {actual} does not match the {bound_by} extras_digest {expected}; the extras were "
            f"altered after staging or belong to another record, so they must not be used",
        )


def record_to_row(record: StagedCallRecord) -> Row:
    """One staged record as a row: `token_ids_delta` int64, mask and logprobs float64 (bit-exact), `header`
    (JSON of every other base field) and `extras` (JSON, never moved by a base read)."""
    import torch

    if record.token_ids_delta and max(record.token_ids_delta) > INT64_MAX:
        raise ValueError(f"token_ids_delta of {record.staging_key!r} holds an id above int64 max")
    header = record.model_dump(mode="json", exclude={*_ARRAY_FIELDS, "extras"})
    return {
        TOKEN_IDS_FIELD: torch.tensor(record.token_ids_delta, dtype=torch.int64),
        TOKEN_MASK_FIELD: torch.tensor(record.token_mask_delta, dtype=torch.float64),
        LOGPROBS_FIELD: torch.tensor(record.generation_log_probs_delta, dtype=torch.float64),
        HEADER_FIELD: json.dumps(header, sort_keys=True, allow_nan=False),
        EXTRAS_FIELD: json.dumps(record.extras, sort_keys=True, allow_nan=False),
    }


def row_nbytes(row: Row) -> int:
    """Bytes one staged row holds in the data plane: tensor payloads plus the UTF-8 JSON fields."""
    tensors = sum(row[name].element_size() * row[name].numel() for name in _ARRAY_FIELDS)
    return tensors + len(row[HEADER_FIELD].encode()) + len(row[EXTRAS_FIELD].encode())


def _header(key: str, row: Row) -> dict[str, Any]:
    """The row's `header` as a JSON object, else `StagedRecordInvalidError` naming `key`."""
    try:
        header = json.loads(row[HEADER_FIELD])
    except (TypeError, json.JSONDecodeError) as e:
        raise StagedRecordInvalidError(key, f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise StagedRecordInvalidError(key, f"header is {type(header).__name__}, expected a JSON object")
    return header


def _row_payload(key: str, row: Row) -> dict[str, Any]:
    import torch

    payload = _header(key, row)
    for name in _ARRAY_FIELDS:
        value = row[name]
        if not isinstance(value, torch.Tensor):
            raise StagedRecordInvalidError(key, f"field {name!r} is {type(value).__name__}, expected a tensor")
        payload[name] = value.tolist()
    return payload


def _validated(key: str, model: type[StagedCallBaseSnapshot], payload: dict[str, Any]) -> Any:
    try:
        snapshot = model.model_validate(payload)
    except ValidationError as e:
        raise StagedRecordInvalidError(key, str(e)) from e
    if snapshot.staging_key != key:
        raise StagedRecordInvalidError(key, f"it describes staging key {snapshot.staging_key!r}")
    return snapshot


def row_to_snapshot(key: str, row: Row) -> StagedCallBaseSnapshot:
    """Validate one base row as Gym's snapshot (digest recomputed by Gym's model)."""
    return _validated(key, StagedCallBaseSnapshot, _row_payload(key, row))


def _row_extras(key: str, row: Row) -> dict[str, Any] | None:
    try:
        extras = json.loads(row[EXTRAS_FIELD])
    except (TypeError, json.JSONDecodeError) as e:
        raise StagedRecordInvalidError(key, f"extras is not JSON: {e}") from e
    if extras is not None and not isinstance(extras, dict):
        raise StagedRecordInvalidError(key, f"extras is {type(extras).__name__}, expected a JSON object or null")
    return extras


def _extras_digest(key: str, extras: dict[str, Any] | None) -> str:
    try:
        return compute_extras_digest(extras)
    except (TypeError, ValueError) as e:
        raise StagedRecordInvalidError(key, f"extras cannot be digested: {e}") from e


def verified_extras(key: str, row: Row, expected_extras_digest: str | None = None) -> dict[str, Any] | None:
    """The extras of one `header` + `extras` row, checked against the stored and expected digests.

    Raises `StagedRecordInvalidError` for a malformed row and `ExtrasDigestMismatchError` when the
    payload's digest differs from the header's `extras_digest` or from `expected_extras_digest`.
    """
    header = _header(key, row)
    try:
        described = staging_key(header.get("rollout_id", ""), header.get("model_call_id", ""))
    except ValueError as e:
        raise StagedRecordInvalidError(key, f"header names no record: {e}") from e
    if described != key:
        raise StagedRecordInvalidError(key, f"it describes staging key {described!r}")
    stored = header.get("extras_digest")
    if not isinstance(stored, str):
        raise StagedRecordInvalidError(key, "header has no extras_digest")
    extras = _row_extras(key, row)
    actual = _extras_digest(key, extras)
    if actual != stored:
        raise ExtrasDigestMismatchError(key, stored, actual, "staged")
    if expected_extras_digest is not None and actual != expected_extras_digest:
        raise ExtrasDigestMismatchError(key, expected_extras_digest, actual, "committed")
    return extras


def row_to_record(key: str, row: Row) -> StagedCallSnapshot:
    """Validate one full row, extras included (extras digest recomputed by Gym's model)."""
    payload = _row_payload(key, row)
    payload["extras"] = _row_extras(key, row)
    stored = payload.get("extras_digest")
    actual = _extras_digest(key, payload["extras"])
    if isinstance(stored, str) and stored != actual:
        raise ExtrasDigestMismatchError(key, stored, actual, "staged")
    return _validated(key, StagedCallSnapshot, payload)


def has_assistant_turn(messages: Sequence[Any]) -> bool:
    """Whether a request's history holds model-authored output: an assistant turn or a function call (Gym's rule)."""
    return any(
        isinstance(message, dict) and (message.get("role") == "assistant" or message.get("type") == "function_call")
        for message in messages
    )


@dataclass(frozen=True, slots=True)
class ServedCall:
    """One admitted call that produced a completion; crosses Ray as a dict (`to_wire`, `from_wire`).

    `staged` is True exactly when the delta is durable and the reply carried staged coordinates (else
    `failure` says why); `unresolved_continuation` is True exactly for a `text` admission whose history
    holds an assistant turn (`has_assistant_turn`).
    """

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
            raise RecordInvariantError(f"{where}: rollout_id and model_call_id must be non-empty", kind="served_call")
        if self.mode not in ("text", "token_in"):
            raise RecordInvariantError(f"{where}: mode must be 'text' or 'token_in', got {self.mode!r}", kind="served_call")
        if (self.mode == "text") != (self.parent_call_id is None):
            raise RecordInvariantError(f"{where}: a text root has no parent and a token_in call has one", kind="served_call")
        if type(self.generated_tokens) is not int or self.generated_tokens < 0:
            raise RecordInvariantError(f"{where}: generated_tokens must be a non-negative int", kind="served_call")
        if self.staged != (self.failure is None):
            raise RecordInvariantError(f"{where}: a staged call has no failure and an unstaged call names one", kind="served_call")
        if type(self.unresolved_continuation) is not bool or (self.unresolved_continuation and self.mode != "text"):
            raise RecordInvariantError(f"{where}: unresolved_continuation is a bool, True only for a text admission "
                                       f"(got {self.unresolved_continuation!r} on a {self.mode} call)", kind="served_call")

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "ServedCall":
        try:
            return cls(**data)
        except TypeError as e:
            raise RecordInvariantError(f"served-call record has unexpected fields: {sorted(data)}", kind="served_call") from e
