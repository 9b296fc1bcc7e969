"""TokenCaptureConfig: the only home of capture defaults; strict, frozen, bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.utils.config import ConfigError, load_config, validate_section


def test_defaults() -> None:
    cfg = TokenCaptureConfig()
    assert cfg.model_dump() == {
        "enabled": False,
        "num_finalizer_workers": 1,
        "staging_partition": "token_capture_staging",
        "train_partition": "token_capture_train",
        "manifest_timeout_s": 30.0,
        "finalize_timeout_s": 120.0,
        "stage_timeout_s": 10.0,
        "stage_write": "behind_reply",
        "prefix_cache_max_tokens": 1_000_000,
        "control_token_env": "NRL_TOKEN_CAPTURE_CONTROL_TOKEN",
        "retire_after_commit": True,
        "branch_policy": "all_chains",
        "mixed_weight_version_policy": "allow",
        "min_valid_fraction_per_group": 0.0,
        "max_consecutive_masked_steps": 3,
        "on_component_failure": "abort",
        "component_check_interval_s": 1.0,
        "component_probe_timeout_s": 5.0,
    }


def test_the_removed_null_train_partition_is_refused_with_its_fix(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("token_capture:\n  enabled: true\n  train_partition: null\n")
    data = load_config(recipe)
    with pytest.raises(ConfigError) as e:
        validate_section(TokenCaptureConfig, data["token_capture"], "token_capture")
    assert e.value.kind == "section"
    assert str(e.value).splitlines() == [
        "invalid config section token_capture (1 problem(s)):",
        "token_capture.train_partition=None: null no longer exists: capture rows reach the policy only through "
        "the train partition (the Ray-values path through the driver was removed) (fix: remove "
        "token_capture.train_partition from the recipe (default token_capture_train) or set it to a partition name)",
    ]


def test_every_field_is_described() -> None:
    for name, field in TokenCaptureConfig.model_fields.items():
        assert field.description, name


def test_frozen() -> None:
    cfg = TokenCaptureConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.enabled = True  # type: ignore[misc]


def test_enabled_from_recipe_override(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("token_capture:\n  enabled: false\n  num_finalizer_workers: 2\n")
    data = load_config(recipe, ["token_capture.enabled=true"])
    cfg = validate_section(TokenCaptureConfig, data["token_capture"], "token_capture")
    assert cfg == TokenCaptureConfig(enabled=True, num_finalizer_workers=2)


@pytest.mark.parametrize(
    ("data", "line"),
    [
        (
            {"enabled": "yes"},
            "token_capture.enabled='yes': Input should be a valid boolean "
            "(fix: set token_capture.enabled to a value of type bool)",
        ),
        (
            {"num_finalizer_workers": 0},
            "token_capture.num_finalizer_workers=0: Input should be greater than or equal to 1 "
            "(fix: set token_capture.num_finalizer_workers to a value >= 1)",
        ),
        (
            {"num_finalizer_workers": 1.5},
            "token_capture.num_finalizer_workers=1.5: Input should be a valid integer "
            "(fix: set token_capture.num_finalizer_workers to a value of type int)",
        ),
        (
            {"staging_partition": ""},
            "token_capture.staging_partition='': String should have at least 1 character "
            "(fix: set token_capture.staging_partition to a string of at least 1 character(s))",
        ),
        (
            {"staging_partition": "a/b"},
            "token_capture.staging_partition='a/b': String should match pattern "
            "'^[A-Za-z0-9_-]+$' (fix: set token_capture.staging_partition to a string "
            "matching ^[A-Za-z0-9_-]+$)",
        ),
        (
            {"train_partition": "a/b"},
            "token_capture.train_partition='a/b': String should match pattern "
            "'^[A-Za-z0-9_-]+$' (fix: set token_capture.train_partition to a string "
            "matching ^[A-Za-z0-9_-]+$)",
        ),
        (
            {"manifest_timeout_s": 0.0},
            "token_capture.manifest_timeout_s=0.0: Input should be greater than 0 "
            "(fix: set token_capture.manifest_timeout_s to a value > 0)",
        ),
        (
            {"finalize_timeout_s": float("inf")},
            "token_capture.finalize_timeout_s=inf: Input should be a finite number "
            "(fix: set token_capture.finalize_timeout_s to a finite number)",
        ),
        (
            {"stage_timeout_s": -1},
            "token_capture.stage_timeout_s=-1: Input should be greater than 0 "
            "(fix: set token_capture.stage_timeout_s to a value > 0)",
        ),
        (
            {"prefix_cache_max_tokens": -1},
            "token_capture.prefix_cache_max_tokens=-1: Input should be greater than or equal "
            "to 0 (fix: set token_capture.prefix_cache_max_tokens to a value >= 0)",
        ),
        (
            {"control_token_env": "1BAD"},
            "token_capture.control_token_env='1BAD': String should match pattern "
            "'^[A-Za-z_][A-Za-z0-9_]*$' (fix: set token_capture.control_token_env to a "
            "string matching ^[A-Za-z_][A-Za-z0-9_]*$)",
        ),
        (
            {"branch_policy": "some"},
            "token_capture.branch_policy='some': Input should be 'terminal_chain' or 'all_chains' (fix: set "
            "token_capture.branch_policy to a value of type Literal['terminal_chain', 'all_chains'])",
        ),
        (
            {"mixed_weight_version_policy": "deny"},
            "token_capture.mixed_weight_version_policy='deny': Input should be 'allow' or 'reject' (fix: set "
            "token_capture.mixed_weight_version_policy to a value of type Literal['allow', 'reject'])",
        ),
        (
            {"min_valid_fraction_per_group": 1.5},
            "token_capture.min_valid_fraction_per_group=1.5: Input should be less than or equal to 1 (fix: set "
            "token_capture.min_valid_fraction_per_group to a value <= 1)",
        ),
        (
            {"max_consecutive_masked_steps": 0},
            "token_capture.max_consecutive_masked_steps=0: Input should be greater than or equal to 1 (fix: set "
            "token_capture.max_consecutive_masked_steps to a value >= 1)",
        ),
        (
            {"on_component_failure": "ignore"},
            "token_capture.on_component_failure='ignore': Input should be 'continue' or 'abort' (fix: set "
            "token_capture.on_component_failure to a value of type Literal['continue', 'abort'])",
        ),
        (
            {"component_check_interval_s": 0},
            "token_capture.component_check_interval_s=0: Input should be greater than 0 (fix: set "
            "token_capture.component_check_interval_s to a value > 0)",
        ),
        (
            {"finalizer_workers": 2},
            "token_capture.finalizer_workers=2: unknown key token_capture.finalizer_workers; "
            "allowed keys: enabled, num_finalizer_workers, staging_partition, train_partition, "
            "manifest_timeout_s, finalize_timeout_s, stage_timeout_s, stage_write, prefix_cache_max_tokens, "
            "control_token_env, retire_after_commit, branch_policy, mixed_weight_version_policy, "
            "min_valid_fraction_per_group, max_consecutive_masked_steps, on_component_failure, "
            "component_check_interval_s, component_probe_timeout_s (fix: remove "
            "token_capture.finalizer_workers or rename it to an allowed key)",
        ),
    ],
)
def test_invalid_values(data: dict, line: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate_section(TokenCaptureConfig, data, "token_capture")
    assert e.value.kind == "section"
    assert str(e.value).splitlines() == [
        "invalid config section token_capture (1 problem(s)):",
        line,
    ]
