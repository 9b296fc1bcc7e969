"""What a model call's request must look like before anything is generated, staged or ledgered (pure).

One set of rules for every process that takes or makes a call: the vLLM worker's endpoint
(`serving.ChatService`), our capture gate (`gate.app`) and the driver that mints rollout ids.
`parse_json_body` is strict JSON; `check_chat_request` and `check_sampling_fields` raise
`RequestFieldError` naming the first field at fault (its JSON path) and the fix;
`bearer_status` authorizes control routes in constant time (None, 401 or 403);
`check_rollout_id` is the one rollout-id rule and `rollout_id_for` mints
`"<run_id>-s<step>-g<group>-i<index>-a<attempt>"` (distinct per attempt within a run).
Invariants: a part or value is refused, never silently dropped; JSON booleans are never numbers;
every minted id passes a gate left at its default limit.
Every rule: docs/design-docs/token-capture-reliability.md, "The chat-request rules".
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Sequence
from typing import Any

from nemo_rl.data.errors import RecoverableError

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


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _reject_constant(name: str) -> Any:
    raise RequestFieldError("body", f"request body contains {name}, which is not JSON (fix: send finite numbers)")


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON of a request body (see the module contract)."""
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
    """The numeric sampling rules of the module contract (token counts, temperature, top_p, seed)."""
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
    """Raise `RequestFieldError` for the first field `body` gets wrong (see the module contract)."""
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
