"""`generation.tool_call_parser` / `generation.reasoning_parser` take the names of vLLM's registries.

The driver has no vLLM, so the recipe is checked against the committed lists (`parser_names.py`);
`tests/integration/test_vllm_parsers.py` proves those lists equal the worker venv's registries.
Until the worker's chat path parses through `parsers.py`, the launcher refuses (before any venv
or engine) a name the worker would not apply (`launcher.check_parsers_served`).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_rl.models.generation.vllm.config import GenerationConfig, GenerationSetupError
from nemo_rl.models.generation.vllm.launcher import check_parsers_served
from nemo_rl.models.generation.vllm.parser_names import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES


def test_defaults_are_hermes_and_no_reasoning_parser():
    cfg = GenerationConfig()
    assert (cfg.tool_call_parser, cfg.reasoning_parser) == ("hermes", None)


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSER_NAMES))
def test_every_tool_parser_name_of_vllm_is_accepted(name):
    assert GenerationConfig(tool_call_parser=name).tool_call_parser == name


@pytest.mark.parametrize("name", sorted(REASONING_PARSER_NAMES))
def test_every_reasoning_parser_name_of_vllm_is_accepted(name):
    assert GenerationConfig(reasoning_parser=name).reasoning_parser == name


@pytest.mark.parametrize(
    ("field", "flag", "count"),
    [("tool_call_parser", "--tool-call-parser", 54), ("reasoning_parser", "--reasoning-parser", 38)],
)
@pytest.mark.parametrize("value", ["no_such_parser", "Hermes", ""])
def test_a_name_outside_the_registry_fails_at_load_naming_field_value_and_fix(field, flag, count, value):
    with pytest.raises(ValidationError) as e:
        GenerationConfig(**{field: value})
    (error,) = e.value.errors()
    assert error["loc"] == (field,)
    assert error["msg"] == (
        f"Value error, generation.{field}={value!r} is not a name of vLLM's registry ({count} names, e.g. "
        + ", ".join(sorted(TOOL_CALL_PARSER_NAMES if field == "tool_call_parser" else REASONING_PARSER_NAMES)[:6])
        + f", ...; all in nemo_rl/models/generation/vllm/parser_names.py) (fix: set generation.{field} to the name "
        f"stock vLLM's {flag} takes for this model)"
    )


def test_the_reasoning_parser_kind_is_a_setup_kind():
    assert GenerationSetupError("x", kind="reasoning_parser").kind == "reasoning_parser"
    assert set(GenerationSetupError.KINDS) == {"no_gpu", "too_few_gpus", "tool_call_parser", "reasoning_parser"}


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_the_parsers_the_worker_applies_today_pass_the_launch_check(name):
    check_parsers_served(GenerationConfig(tool_call_parser=name))


def test_a_parser_the_worker_does_not_apply_yet_fails_the_launch_check_naming_knob_and_fix():
    with pytest.raises(GenerationSetupError) as e:
        check_parsers_served(GenerationConfig(tool_call_parser="qwen3_coder"))
    assert e.value.kind == "tool_call_parser"
    assert str(e.value) == (
        "generation.tool_call_parser='qwen3_coder' is a name of vLLM's registry, but the worker's chat path applies "
        "only ['hermes', 'llama3_json'] until it parses through parsers.py (fix: set generation.tool_call_parser to "
        "one of those)"
    )
    with pytest.raises(GenerationSetupError) as e:
        check_parsers_served(GenerationConfig(reasoning_parser="qwen3"))
    assert e.value.kind == "reasoning_parser"
    assert str(e.value) == (
        "generation.reasoning_parser='qwen3' is a name of vLLM's registry, but the worker's chat path applies no "
        "reasoning parser until it parses through parsers.py (fix: set generation.reasoning_parser=null)"
    )
