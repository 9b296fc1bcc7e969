"""ChatML chat template (Jinja) with hermes/Qwen-style tool calls for the tiny model.

Rendering rules (what the vLLM worker and the tests rely on):
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

Invariants: for k >= 1, rendering messages[:k] (same tools, add_generation_prompt=False) is a
text prefix of rendering messages[:k+m]; an assistant turn's text ends exactly with
`<|im_end|>\\n`; nothing a turn renders depends on later messages.
"""

from __future__ import annotations

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
    """{%- macro render_content(content) -%}
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
{%- if tools -%}
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
