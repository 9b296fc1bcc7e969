"""A tiny local tool-using policy for the arithmetic task, built on this machine (no model hub).

Public API: `TinyModelConfig`, `build_tiny_model(cfg, out_dir, progress)`,
`ensure_tiny_model(cfg, cache_root, progress)`, `cache_folder(cfg, cache_root)`, `cache_key(cfg)`,
`CHAT_TEMPLATE` and its token constants (ChatML), the template families (`FAMILIES`, `CHATML`,
`LLAMA3`, `TemplateFamily`; chosen by `TinyModelConfig.template_family`). The submodules state their contracts: config
(defaults), chat_template (rendering rules), tokenizer (BPE), corpus (task transcripts),
encoding (capture-path token encoding), sft (initialisation and warm start), build (artefact
and cache). The HF `generate` check of the two-call tool loop lives with the task
(`examples.arith.episodes`): this package uses only the task spec (`examples.arith.task`).
"""

from examples.arith.tiny_model.build import (
    TinyModelBuildError,
    build_tiny_model,
    cache_folder,
    cache_key,
    ensure_tiny_model,
)
from examples.arith.tiny_model.chat_template import (
    CHAT_TEMPLATE,
    CHATML,
    EOS_TOKEN,
    FAMILIES,
    GENERATION_PROMPT,
    LLAMA3,
    PAD_TOKEN,
    TOOL_CALL_PATTERN,
    TURN_END,
    TemplateFamily,
)
from examples.arith.tiny_model.config import TinyModelConfig, config_digest

__all__ = [
    "CHATML",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "FAMILIES",
    "GENERATION_PROMPT",
    "LLAMA3",
    "PAD_TOKEN",
    "TOOL_CALL_PATTERN",
    "TURN_END",
    "TemplateFamily",
    "TinyModelBuildError",
    "TinyModelConfig",
    "build_tiny_model",
    "cache_folder",
    "cache_key",
    "config_digest",
    "ensure_tiny_model",
]
