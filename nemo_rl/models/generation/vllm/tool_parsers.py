"""Tool-call parsers by vLLM's name, resolved once at set-up (off the rollout path).

`get_tool_call_parser(name)` resolves `generation.tool_call_parser` (`config.ToolCallParserName`,
the same names): the default `hermes` lives with the chat logic (`chat.HERMES`, run per call); the
others live here. Each follows its vLLM class rule for rule; an unknown name is a
`GenerationSetupError` (kind `tool_call_parser`) naming the choices, raised when the worker
builds its service. Only `chat` and `serving` use them: `serving.chat_service` resolves the
parser once, and every reply goes through the one `chat.ToolParser` seam.
See docs/design-docs/vllm-worker-capture.md ("Tool calls").
"""

from __future__ import annotations

import json
import re

from nemo_rl.models.generation.vllm.config import GenerationSetupError
from nemo_rl.models.generation.vllm.chat import HERMES, ParsedAssistant, ToolParser, function_call

_LLAMA3_CALL_START_RE = re.compile(r"\{")
_JSON_DECODER = json.JSONDecoder()


def parse_llama3_json(text: str) -> ParsedAssistant:
    """vLLM's `llama3_json`: every top-level JSON object `{"name", "arguments"|"parameters"}` in the
    text is a call (separators such as `; ` and surrounding text are dropped; content None).
    If any `{` does not open such an object, the whole text stays content and nothing is called.
    """
    calls: list[dict] = []
    end = -1
    for m in _LLAMA3_CALL_START_RE.finditer(text):
        if m.start() <= end:
            continue
        try:
            obj, length = _JSON_DECODER.raw_decode(text[m.start() :])
        except json.JSONDecodeError:
            return ParsedAssistant(content=text, tool_calls=[])
        end = m.start() + length
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return ParsedAssistant(content=text, tool_calls=[])
        calls.append(function_call(obj["name"], json.dumps(args, ensure_ascii=False)))
    if calls:
        return ParsedAssistant(content=None, tool_calls=calls)
    return ParsedAssistant(content=text, tool_calls=[])


LLAMA3_JSON = ToolParser("llama3_json", parse_llama3_json)
TOOL_CALL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HERMES, LLAMA3_JSON)}


def get_tool_call_parser(name: str) -> ToolParser:
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise GenerationSetupError(
            f"tool_call_parser={name!r} is not one of {sorted(TOOL_CALL_PARSERS)}; set generation.tool_call_parser",
            kind="tool_call_parser",
        ) from None
