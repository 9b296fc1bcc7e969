"""The names vLLM's tool-call and reasoning-parser registries hold, as the driver sees them.

Contract: `TOOL_CALL_PARSER_NAMES` equals the names of `vllm.tool_parsers.ToolParserManager` and
`REASONING_PARSER_NAMES` those of `vllm.reasoning.ReasoningParserManager` in the worker's venv
(`nemo_rl/utils/venv_specs/vllm-cpu.txt`), exactly: the driver's venv has no vLLM, so the recipe
is checked against these lists at load time, and `tests/integration/test_vllm_parsers.py` asserts
they equal the registries both ways (a vLLM upgrade that adds or removes a name fails there).
`parsers.py` resolves the names against the registries themselves when the worker starts.
"""

from __future__ import annotations

TOOL_CALL_PARSER_NAMES: frozenset[str] = frozenset(
    {
        "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
        "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45",
        "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4",
        "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
        "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral",
        "muse_glimmer", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic", "qwen3_coder",
        "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
    }
)

REASONING_PARSER_NAMES: frozenset[str] = frozenset(
    {
        "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41",
        "ernie45", "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2",
        "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo",
        "minicpmv", "minimax_m2", "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer",
        "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3", "step3p5",
    }
)


def unknown_name_message(field: str, value: str, names: frozenset[str]) -> str:
    """The message for a parser name vLLM's registry lacks: the field, the value, and the fix."""
    return (
        f"generation.{field}={value!r} is not a name of vLLM's registry ({len(names)} names, e.g. "
        f"{', '.join(sorted(names)[:6])}, ...; all in nemo_rl/models/generation/vllm/parser_names.py) (fix: set "
        f"generation.{field} to the name stock vLLM's --{field.replace('_', '-')} takes for this model)"
    )
