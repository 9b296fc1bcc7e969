"""validate_section: pydantic errors become one ConfigError line per problem, with a fix."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

from nemo_rl.utils.config import ConfigError, validate_section


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rank: int = Field(default=8, ge=1)
    alpha: float = 16.0


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    steps: int = Field(default=10, gt=0, le=1000)
    lora: Inner = Inner()
    adapters: list[Inner] = []


def test_valid_section_returns_model() -> None:
    got = validate_section(Outer, {"name": "r", "lora": {"rank": 4}}, "policy")
    assert got == Outer(name="r", lora=Inner(rank=4))


def test_unknown_key_lists_allowed_keys() -> None:
    with pytest.raises(ConfigError) as e:
        validate_section(Outer, {"name": "r", "stepz": 3}, "policy")
    assert e.value.kind == "section"
    assert str(e.value) == (
        "invalid config section policy (1 problem(s)):\n"
        "policy.stepz=3: unknown key policy.stepz; allowed keys: name, steps, lora, adapters "
        "(fix: remove policy.stepz or rename it to an allowed key)"
    )


def test_nested_unknown_key_lists_the_nested_models_keys() -> None:
    with pytest.raises(ConfigError) as e:
        validate_section(Outer, {"name": "r", "adapters": [{"rnak": 2}]}, "policy")
    assert e.value.kind == "section"
    assert str(e.value).splitlines()[1] == (
        "policy.adapters.0.rnak=2: unknown key policy.adapters.0.rnak; allowed keys: rank, "
        "alpha (fix: remove policy.adapters.0.rnak or rename it to an allowed key)"
    )


def test_wrong_type() -> None:
    with pytest.raises(ConfigError) as e:
        validate_section(Outer, {"name": "r", "steps": "ten"}, "grpo")
    assert e.value.kind == "section"
    assert str(e.value).splitlines()[1] == (
        "grpo.steps='ten': Input should be a valid integer "
        "(fix: set grpo.steps to a value of type int)"
    )


def test_out_of_range_reports_each_problem() -> None:
    with pytest.raises(ConfigError) as e:
        validate_section(Outer, {"name": "r", "steps": 0, "lora": {"rank": 0}}, "grpo")
    assert e.value.kind == "section"
    assert str(e.value) == (
        "invalid config section grpo (2 problem(s)):\n"
        "grpo.steps=0: Input should be greater than 0 (fix: set grpo.steps to a value > 0)\n"
        "grpo.lora.rank=0: Input should be greater than or equal to 1 "
        "(fix: set grpo.lora.rank to a value >= 1)"
    )


def test_upper_bound_and_missing_required() -> None:
    with pytest.raises(ConfigError) as e:
        validate_section(Outer, {"steps": 5000}, "grpo")
    assert e.value.kind == "section"
    assert str(e.value).splitlines()[1:] == [
        "grpo.name=<unset>: Field required (fix: add grpo.name=<value>)",
        "grpo.steps=5000: Input should be less than or equal to 1000 "
        "(fix: set grpo.steps to a value <= 1000)",
    ]


def test_section_that_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError) as e:
        validate_section(Outer, [1, 2], "grpo")  # type: ignore[arg-type]
    assert e.value.kind == "section"
    assert str(e.value) == (
        "grpo=[1, 2]: expected a mapping for section grpo "
        "(fix: make grpo a mapping of keys to values)"
    )


def test_config_error_is_a_value_error_with_a_validated_kind() -> None:
    assert issubclass(ConfigError, ValueError)
    error = ConfigError("grpo.steps: bad", kind="section")
    assert (str(error), error.kind) == ("grpo.steps: bad", "section")
    assert repr(error) == "ConfigError('grpo.steps: bad', kind='section')"
    with pytest.raises(ValueError, match=r"ConfigError: unknown kind 'sectoin'; the kinds are \['defaults', "):
        ConfigError("grpo.steps: bad", kind="sectoin")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ConfigError("grpo.steps: bad")  # type: ignore[call-arg]
