"""`grpo.async_rollouts`: defaults, bounds, and the cross-section checks of `enabled: true`."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from nemo_rl.algorithms.async_config import AsyncRolloutsConfig, in_flight_limit
from nemo_rl.algorithms.grpo_config import GRPOConfig, load_master_config
from nemo_rl.utils.config import ConfigError

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_capture_tiny_cpu.yaml"


def test_defaults_are_off_age_one_and_one_step_in_flight():
    cfg = load_master_config(RECIPE)
    assert cfg.grpo.async_rollouts == AsyncRolloutsConfig()
    assert (cfg.grpo.async_rollouts.enabled, cfg.grpo.async_rollouts.max_trajectory_age_steps,
            cfg.grpo.async_rollouts.max_in_flight_groups) == (False, 1, None)
    assert GRPOConfig().async_rollouts.enabled is False


def test_knobs_validate_and_enabled_false_is_accepted():
    cfg = load_master_config(RECIPE, ["grpo.async_rollouts.enabled=false", "grpo.async_rollouts.max_trajectory_age_steps=0",
                                      "grpo.async_rollouts.max_in_flight_groups=5"])
    assert cfg.grpo.async_rollouts == AsyncRolloutsConfig(max_trajectory_age_steps=0, max_in_flight_groups=5)


@pytest.mark.parametrize("value", ["true", "True", "1"])
def test_enabled_true_is_accepted_with_capture_on(value):
    cfg = load_master_config(RECIPE, [f"grpo.async_rollouts.enabled={value}"])
    assert cfg.grpo.async_rollouts.enabled is True
    assert AsyncRolloutsConfig(enabled=True).enabled is True


def test_the_async_recipe_runs_one_step_in_flight_at_age_one():
    cfg = load_master_config(RECIPE.parent / "grpo_async_tiny_cpu.yaml")
    assert cfg.grpo.async_rollouts == AsyncRolloutsConfig(enabled=True, max_trajectory_age_steps=1)
    assert cfg.token_capture.enabled is True
    assert in_flight_limit(cfg.grpo.async_rollouts, cfg.grpo.num_prompts_per_step) == cfg.grpo.num_prompts_per_step


@pytest.mark.parametrize(("overrides", "message"), [
    (["token_capture.enabled=false"],
     r"grpo\.async_rollouts\.enabled=true needs token_capture\.enabled=true: .*legacy rows .* carry none \(fix: set "
     r"token_capture\.enabled=true, or grpo\.async_rollouts\.enabled=false\)"),
    (["token_capture.on_component_failure=continue"],
     r"supports token_capture\.on_component_failure=abort only: .*\(fix: set token_capture\.on_component_failure=abort"),
    (["grpo.async_rollouts.max_in_flight_groups=1"],
     r"max_in_flight_groups=1 < grpo\.num_prompts_per_step=2: .*fix: set grpo\.async_rollouts\.max_in_flight_groups >= 2"),
])
def test_enabled_true_is_refused_against_the_rest_of_the_recipe_naming_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_master_config(RECIPE, ["grpo.async_rollouts.enabled=true", *overrides])


def test_the_cross_checks_hold_only_when_enabled():
    # async off: a small cap or capture off is today's loop, which reads neither
    cfg = load_master_config(RECIPE, ["token_capture.enabled=false", "grpo.async_rollouts.max_in_flight_groups=1"])
    assert cfg.grpo.async_rollouts.enabled is False
    with pytest.raises(ValidationError):
        AsyncRolloutsConfig(enabled="maybe")


@pytest.mark.parametrize(("override", "message"), [
    ("grpo.async_rollouts.max_trajectory_age_steps=-1",
     r"grpo\.async_rollouts\.max_trajectory_age_steps=-1: .*fix: set grpo\.async_rollouts\.max_trajectory_age_steps to a value >= 0"),
    ("grpo.async_rollouts.max_in_flight_groups=0",
     r"grpo\.async_rollouts\.max_in_flight_groups=0: .*fix: set grpo\.async_rollouts\.max_in_flight_groups to a value >= 1"),
    ("grpo.async_rollouts.enabled=maybe", r"grpo\.async_rollouts\.enabled='maybe': Input should be a valid boolean"),
    ("+grpo.async_rollouts.bogus=1", r"grpo\.async_rollouts\.bogus=1: unknown key .*allowed keys: enabled, "
                                     r"max_trajectory_age_steps, max_in_flight_groups"),
])
def test_bad_values_name_key_value_and_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_master_config(RECIPE, [override])


def test_the_in_flight_limit_defaults_to_one_step_and_never_below_it():
    assert in_flight_limit(AsyncRolloutsConfig(), 4) == 4
    assert in_flight_limit(AsyncRolloutsConfig(max_in_flight_groups=9), 4) == 9
    with pytest.raises(ValueError, match=r"max_in_flight_groups=3 < grpo\.num_prompts_per_step=4.*fix: set "
                                         r"grpo\.async_rollouts\.max_in_flight_groups >= 4, or null"):
        in_flight_limit(AsyncRolloutsConfig(max_in_flight_groups=3), 4)
    with pytest.raises(ValueError, match="num_prompts_per_step must be an int >= 1"):
        in_flight_limit(AsyncRolloutsConfig(), 0)
