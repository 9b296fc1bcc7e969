"""`grpo.async_rollouts`: defaults, bounds, and `enabled: true` refused (the loop is not wired in this build)."""

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
def test_enabled_true_is_refused_naming_the_key_the_reason_and_the_fix(value):
    with pytest.raises(ConfigError) as info:
        load_master_config(RECIPE, [f"grpo.async_rollouts.enabled={value}"])
    message = str(info.value)
    assert "grpo.async_rollouts.enabled=" in message
    assert "the async GRPO loop is not available in this build" in message
    assert "Set grpo.async_rollouts.enabled=false" in message
    with pytest.raises(ValidationError, match="not available in this build"):
        AsyncRolloutsConfig(enabled=True)


@pytest.mark.parametrize(("override", "message"), [
    ("grpo.async_rollouts.max_trajectory_age_steps=-1",
     r"grpo\.async_rollouts\.max_trajectory_age_steps=-1: .*fix: set grpo\.async_rollouts\.max_trajectory_age_steps to a value >= 0"),
    ("grpo.async_rollouts.max_in_flight_groups=0",
     r"grpo\.async_rollouts\.max_in_flight_groups=0: .*fix: set grpo\.async_rollouts\.max_in_flight_groups to a value >= 1"),
    ("grpo.async_rollouts.enabled=maybe", r"grpo\.async_rollouts\.enabled='maybe': Input should be False"),
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
