"""Chat templates (Jinja) of the tiny model, one per template family: `chatml` and `llama3`.

`TemplateFamily` bundles what a family changes: its special tokens, added tool tokens, eos and
pad tokens, the generation prompt, the end-of-turn text and the template. `FAMILIES` maps
`TinyModelConfig.template_family` to it. The module-level constants (`CHAT_TEMPLATE`,
`EOS_TOKEN`, ...) are the ChatML family's.

ChatML rendering rules (what the vLLM worker and the tests rely on):
- Every turn is `<|im_start|>{role}\\n{body}<|im_end|>\\n`; roles are system, developer, user,
  assistant and tool. Any other role, or a non-text content part, raises (never skipped).
- Content is a string, None (renders empty) or a list of `{"type": "text", "text": ...}` parts
  (concatenated). Content is rendered verbatim: no stripping, no `<think>` handling.
- With `tools`, the first turn is a system turn: the first message's content (when that message
  is a system message) followed by a `# Tools` section listing each tool as canonical JSON
  `{"type": "function", "function": {"name", "description", "parameters"}}`. Tools may be given
  in chat-completions form (`{"type": "function", "function": {...}}`) or Responses form
  (name at top level); keys other than name/description/parameters (e.g. `strict`) are not
  rendered, so both forms give the same prompt.
- An assistant turn is its content, then each tool call as
  `<tool_call>\\n{"name": <json name>, "arguments": <args>}\\n</tool_call>`, separated from the
  content and from each other by one `\\n`. Arguments rule: a string (the OpenAI wire form) is
  emitted verbatim, it is assumed to already be the JSON text the model produced; a mapping is
  emitted as `tojson` (`json.dumps` with default separators, insertion order). The model emits
  `{"expression": "..."}` in exactly that json.dumps form, so both paths agree for it.
- A tool result is `<|im_start|>tool\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n`,
  one turn per tool message (consecutive results are never merged, which would re-render history).
- `add_generation_prompt=True` appends `<|im_start|>assistant\\n`.

Llama-3 rendering rules (family `llama3`; tool calls as JSON, parsed by vLLM's `llama3_json`):
- The text starts with `<|begin_of_text|>`; every turn is
  `<|start_header_id|>{role}<|end_header_id|>\n\n{body}<|eot_id|>` (no newline after it).
- With `tools`, the first turn is a system turn: the first message's content (when system)
  followed by `\n\n` and a tools section listing each tool as canonical JSON (as ChatML).
- An assistant turn is its content, then (after `\n` when content is non-empty) each tool call
  as `{"name": <json name>, "parameters": <args>}`, calls joined by `; `; arguments rule as ChatML.
- A tool result is an `ipython` turn whose body is the content verbatim.
- `add_generation_prompt=True` appends `<|start_header_id|>assistant<|end_header_id|>\n\n`.
- eos is `<|eot_id|>`, pad `<|end_of_text|>`; `<|python_tag|>` exists (vLLM's llama3_json parser
  requires it in the vocabulary) but the template never renders it.

Invariants (both families): for k >= 1, rendering messages[:k] (same tools, add_generation_prompt=False) is a
text prefix of rendering messages[:k+m]; an assistant turn's text ends exactly with
`<|im_end|>\\n`; nothing a turn renders depends on later messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

# Control tokens: special (dropped by skip_special_tokens).
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# Tool markup: added but not special, so decoded text keeps it for the hermes tool parser.
TOOL_TOKENS: tuple[str, ...] = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)

EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT
GENERATION_PROMPT = f"{IM_START}assistant\n"
TURN_END = f"{IM_END}\n"

# The regex the worker uses over generated text; kept beside the template that produces it.
TOOL_CALL_PATTERN = r"<tool_call>\s*(\{.*?\})\s*</tool_call>"

# Shared by both template families: text content, or a list of text parts; anything else is refused.
_RENDER_CONTENT_MACRO = """{%- macro render_content(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{- content -}}
{%- else -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{- part.text -}}
{%- else -%}{{- raise_exception('tiny model chat template: content part type ' ~ part.type ~ ' is not supported; send text parts only') -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
"""

_TOOLS_HEADER = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FOOTER = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
)

CHAT_TEMPLATE = (
    _RENDER_CONTENT_MACRO
    + """{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages and messages[0].role == 'system' -%}{{- render_content(messages[0].content) + '\\n\\n' -}}{%- endif -%}
{{- '"""
    + _TOOLS_HEADER
    + """' -}}
{%- for tool in tools -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
{{- '\\n{"type": "function", "function": {"name": ' + (fn.name | tojson) -}}
{%- if fn.description is defined and fn.description is not none -%}{{- ', "description": ' + (fn.description | tojson) -}}{%- endif -%}
{%- if fn.parameters is defined and fn.parameters is not none -%}{{- ', "parameters": ' + (fn.parameters | tojson) -}}{%- endif -%}
{{- '}}' -}}
{%- endfor -%}
{{- '"""
    + _TOOLS_FOOTER
    + """<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and tools and message.role == 'system' -%}
{%- elif message.role in ['system', 'developer', 'user'] -%}
{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set text = render_content(message.content) -%}
{{- '<|im_start|>assistant\\n' + text -}}
{%- if message.tool_calls -%}
{%- for tc in message.tool_calls -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{%- if not loop.first or text | length > 0 -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>tool\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response><|im_end|>\\n' -}}
{%- else -%}
{{- raise_exception('tiny model chat template: message role ' ~ message.role ~ ' is not supported; use system, developer, user, assistant or tool') -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
)


BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PYTHON_TAG = "<|python_tag|>"

_LLAMA3_TOOLS_HEADER = (
    "You have access to the following functions. To call a function, respond with a JSON object "
    "of the form {\\\"name\\\": function name, \\\"parameters\\\": dictionary of argument name and its value}. "
    "Do not use variables.\\n"
)

LLAMA3_CHAT_TEMPLATE = (
    _RENDER_CONTENT_MACRO
    + """{{- '<|begin_of_text|>' -}}
{%- if tools -%}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}
{%- if messages and messages[0].role == 'system' -%}{{- render_content(messages[0].content) + '\\n\\n' -}}{%- endif -%}
{{- '"""
    + _LLAMA3_TOOLS_HEADER
    + """' -}}
{%- for tool in tools -%}
{%- set fn = tool.function if tool.function is defined else tool -%}
{{- '\\n{"type": "function", "function": {"name": ' + (fn.name | tojson) -}}
{%- if fn.description is defined and fn.description is not none -%}{{- ', "description": ' + (fn.description | tojson) -}}{%- endif -%}
{%- if fn.parameters is defined and fn.parameters is not none -%}{{- ', "parameters": ' + (fn.parameters | tojson) -}}{%- endif -%}
{{- '}}' -}}
{%- endfor -%}
{{- '<|eot_id|>' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and tools and message.role == 'system' -%}
{%- elif message.role in ['system', 'developer', 'user'] -%}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + render_content(message.content) + '<|eot_id|>' -}}
{%- elif message.role == 'assistant' -%}
{%- set text = render_content(message.content) -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + text -}}
{%- if message.tool_calls -%}
{%- if text | length > 0 -%}{{- '\\n' -}}{%- endif -%}
{%- for tc in message.tool_calls -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{%- if not loop.first -%}{{- '; ' -}}{%- endif -%}
{{- '{"name": ' + (fn.name | tojson) + ', "parameters": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|eot_id|>' -}}
{%- elif message.role == 'tool' -%}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + render_content(message.content) + '<|eot_id|>' -}}
{%- else -%}
{{- raise_exception('tiny model chat template: message role ' ~ message.role ~ ' is not supported; use system, developer, user, assistant or tool') -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}
"""
)

TemplateFamilyName = Literal["chatml", "llama3"]


@dataclass(frozen=True)
class TemplateFamily:
    """What a chat-template family changes in the tiny model."""

    name: str
    chat_template: str
    special_tokens: tuple[str, ...]  # special: dropped by skip_special_tokens
    tool_tokens: tuple[str, ...]  # added, not special: kept in decoded text for the tool parser
    eos_token: str
    pad_token: str
    generation_prompt: str
    turn_end: str  # what follows an assistant turn's content; begins with eos_token
    tool_call_parser: str  # vLLM's parser name for this family's tool-call format

    def __post_init__(self) -> None:
        if not self.turn_end.startswith(self.eos_token):
            raise ValueError(f"family {self.name}: turn_end {self.turn_end!r} must begin with eos {self.eos_token!r}")


CHATML = TemplateFamily(
    name="chatml",
    chat_template=CHAT_TEMPLATE,
    special_tokens=SPECIAL_TOKENS,
    tool_tokens=TOOL_TOKENS,
    eos_token=EOS_TOKEN,
    pad_token=PAD_TOKEN,
    generation_prompt=GENERATION_PROMPT,
    turn_end=TURN_END,
    tool_call_parser="hermes",
)

LLAMA3 = TemplateFamily(
    name="llama3",
    chat_template=LLAMA3_CHAT_TEMPLATE,
    special_tokens=(END_OF_TEXT, BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT, PYTHON_TAG),
    tool_tokens=(),
    eos_token=EOT,
    pad_token=END_OF_TEXT,
    generation_prompt=f"{START_HEADER}assistant{END_HEADER}\n\n",
    turn_end=EOT,
    tool_call_parser="llama3_json",
)

FAMILIES: dict[str, TemplateFamily] = {f.name: f for f in (CHATML, LLAMA3)}
