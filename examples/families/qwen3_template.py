"""A Qwen3 chat template (Jinja), written here, that renders what `renderers`' `qwen3` renderer renders.

Contract: with the Qwen3 family tokenizer (`examples.families.vocab.QWEN3`), encoding this
template's text (`apply_chat_template`, kwarg `enable_thinking`, default on) gives exactly the ids
of `create_renderer(tokenizer, Qwen3RendererConfig(enable_thinking=...)).render_ids(...)` for the
same messages, tools and `add_generation_prompt` (proven over a fixture set by
`tests/unit/examples/test_qwen3_template.py`). So stock vLLM and the legacy text path serve the
renderer's prompts. The rules it follows are the renderer's, including its documented departure
from Qwen's own template: with thinking off, a history assistant turn without reasoning keeps the
empty `<think>\\n\\n</think>\\n\\n` block the generation prompt prefilled. Reasoning
(`reasoning_content`, or a `<think>...</think>` head in the content) is kept only on assistant
turns after the last user query that are the last message or carry reasoning.
Limit: the renderer encodes `assistant\\n` apart from the body; a text template cannot, so a
history body rendered without a think block that starts with whitespace before a newline
tokenizes differently (BPE joins the newlines).
"""

from __future__ import annotations

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

_TEMPLATE = r"""
{%- macro text_of(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for part in content -%}
      {%- if part is string -%}{{- part -}}
      {%- elif part is mapping and part.text is string -%}{{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set thinking_on = not (enable_thinking is defined and not enable_thinking) -%}
{%- set opens_with_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if opens_with_system -%}{{- text_of(messages[0].content) + '\n\n' -}}{%- endif -%}
  {{- '@@TOOLS_HEADER@@' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '@@TOOLS_FOOTER@@' + '<|im_end|>\n' -}}
{%- elif opens_with_system -%}
  {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- set query = namespace(index=messages | length - 1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {%- set said = text_of(m.content) | trim -%}
    {%- if not (said.startswith('<tool_response>') and said.endswith('</tool_response>')) -%}
      {%- set query.index = loop.index0 -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
  {%- set i = loop.index0 -%}
  {%- if m.role == 'system' and i > 0 or m.role == 'user' -%}
    {{- '<|im_start|>' + m.role + '\n' + text_of(m.content) + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set answer = text_of(m.content) -%}
    {%- set reasoning = '' -%}
    {%- if m.reasoning_content is string -%}
      {%- set reasoning = m.reasoning_content -%}
    {%- elif '</think>' in answer -%}
      {%- set head = answer.split('</think>', 1)[0] -%}
      {%- set reasoning = head.split('<think>')[-1].lstrip('\n').rstrip('\n') -%}
      {%- set answer = answer.split('</think>', 1)[1].lstrip('\n') -%}
    {%- endif -%}
    {%- set in_window = i > query.index and (loop.last or reasoning) -%}
    {%- if in_window or (not thinking_on and not reasoning) -%}
      {%- set body = '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + answer.lstrip('\n') -%}
    {%- else -%}
      {%- set body = answer -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\n' + body -}}
    {%- for call in m.tool_calls or [] -%}
      {%- set fn = call.function or call -%}
      {%- set args = fn.arguments if fn.arguments is defined else {} -%}
      {%- if loop.first -%}{{- '\n' if answer else '' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": "' + (fn.name if fn.name is defined else '') + '", "arguments": ' -}}
      {{- (args if args is string else args | tojson) + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if i == 0 or messages[i - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + text_of(m.content) + '\n</tool_response>' -}}
    {%- if loop.last or messages[i + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if not thinking_on -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""


def _jinja_literal(text: str) -> str:
    # The header and footer enter the template as single-quoted Jinja string literals.
    return text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")


QWEN3_CHAT_TEMPLATE: str = (
    _TEMPLATE.strip()
    .replace("@@TOOLS_HEADER@@", _jinja_literal(TOOLS_HEADER))
    .replace("@@TOOLS_FOOTER@@", _jinja_literal(TOOLS_FOOTER))
)
