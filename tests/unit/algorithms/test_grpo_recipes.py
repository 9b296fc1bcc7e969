"""Every example recipe validates; the loop's batch assembly trains rows only (exact values)."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.arith.recipe import load_recipe
from nemo_rl.algorithms.grpo_config import load_master_config, policy_config, refit_root
from nemo_rl.algorithms.grpo_single_controller import build_train_batch
from nemo_rl.data.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason, RowOrigin, TrainRow
from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy import PolicyConfig, PolicySettings
from nemo_rl.utils.config import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "examples" / "configs").glob("*.yaml"))
CHILD_RECIPES = [p for p in CONFIGS if p.name != "grpo_base.yaml"]


def test_example_configs_exist():
    assert {p.name for p in CONFIGS} >= {"grpo_base.yaml", "grpo_capture_tiny_cpu.yaml", "grpo_legacy_tiny_cpu.yaml"}


@pytest.mark.parametrize("path", CHILD_RECIPES, ids=lambda p: p.name)
def test_every_example_recipe_validates(path):
    needs = ["model.path=/models/any"] if path.name == "grpo_capture_gpu.yaml" else []  # a real model is mandatory
    cfg = load_recipe(path, ["grpo.max_num_steps=1", *needs]).config  # as the example entry point loads it
    assert cfg.grpo.max_num_steps == 1
    assert cfg.logger.log_dir


def test_base_recipe_needs_a_log_dir_and_capture_recipe_turns_capture_on():
    with pytest.raises(ConfigError, match=r"logger\.log_dir is mandatory"):
        load_master_config(CONFIGS[0].parent / "grpo_base.yaml")
    cfg = load_master_config(CONFIGS[0].parent / "grpo_base.yaml", ["logger.log_dir=/tmp/x"])
    assert cfg.token_capture.enabled is False
    capture = load_master_config(CONFIGS[0].parent / "grpo_capture_tiny_cpu.yaml")
    assert capture.token_capture.enabled is True
    off = load_master_config(CONFIGS[0].parent / "grpo_capture_tiny_cpu.yaml", ["token_capture.enabled=false"])
    assert off.token_capture.enabled is False


def test_bad_values_name_the_key():
    recipe = CONFIGS[0].parent / "grpo_capture_tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=r"token_capture\.num_finalizer_workers=0"):
        load_master_config(recipe, ["token_capture.num_finalizer_workers=0"])
    with pytest.raises(ConfigError, match=r"policy\.model_path"):
        load_master_config(recipe, ["+policy.model_path=/x"])
    with pytest.raises(ConfigError, match=r"policy\.engine_flavor='gpu': setup sets it from generation\.vllm\.flavor"):
        load_master_config(recipe, ["+policy.engine_flavor=gpu"])
    assert load_master_config(recipe, ["+policy.router_replay=replay"]).policy.router_replay == "replay"
    with pytest.raises(ConfigError, match=r"policy\.learning_rate"):
        load_master_config(recipe, ["policy.learning_rate=-1"])
    with pytest.raises(ConfigError, match="grpo.no_such_key"):
        load_master_config(recipe, ["grpo.no_such_key=1"])


def test_one_error_lists_every_problem_of_every_section():
    recipe = CONFIGS[0].parent / "grpo_capture_tiny_cpu.yaml"
    with pytest.raises(ConfigError) as excinfo:
        load_master_config(recipe, ["token_capture.num_finalizer_workers=0", "policy.learning_rate=-1",
                                    "+policy.model_path=/x", "+foo.bar=1"])
    assert excinfo.value.kind == "section"
    assert str(excinfo.value).splitlines() == [
        "invalid recipe (4 problem(s)):",
        "policy.learning_rate=-1: Input should be greater than 0 (fix: set policy.learning_rate to a value > 0)",
        "policy.model_path='/x': the policy weights come from the model section (fix: set model.path=<folder> instead)",
        "token_capture.num_finalizer_workers=0: Input should be greater than or equal to 1 (fix: set "
        "token_capture.num_finalizer_workers to a value >= 1)",
        "foo={'bar': 1}: unknown key foo; allowed keys: grpo, loss_fn, policy, model, generation, env, token_capture, "
        "data_plane, logger, cluster, checkpointing (fix: remove foo or rename it to an allowed key)",
    ]


def test_rules_across_sections_are_listed_together():
    recipe = CONFIGS[0].parent / "grpo_capture_tiny_cpu.yaml"
    with pytest.raises(ConfigError) as excinfo:
        load_master_config(recipe, ["policy.dtype=bfloat16", "grpo.async_rollouts.enabled=true",
                                    "token_capture.enabled=false"])
    assert str(excinfo.value).splitlines() == [
        "invalid recipe (2 problem(s)):",
        "policy.dtype='bfloat16' != generation.vllm.dtype='float32': the trainer would recompute the sampler's "
        "logprobs at another precision and token_mult_prob_error drifts from 1 (fix: set both to 'float32', or "
        "both to 'bfloat16')",
        "grpo.async_rollouts.enabled=true needs token_capture.enabled=true: the async loop reads every token's "
        "weight version from the captured rows, and legacy rows (Gym's token echo) carry none (fix: set "
        "token_capture.enabled=true, or grpo.async_rollouts.enabled=false)",
    ]


def test_the_policy_section_is_validated_once_and_completed_by_setup():
    recipe = CONFIGS[0].parent / "grpo_capture_tiny_cpu.yaml"
    cfg = load_master_config(recipe, ["policy.lr_warmup_steps=5"])
    assert isinstance(cfg.policy, PolicySettings) and cfg.policy.lr_warmup_steps == 5
    pcfg = policy_config(cfg, "/models/m", "gpu")
    assert pcfg == PolicyConfig(**cfg.policy.model_dump(), model_path="/models/m", engine_flavor="gpu")


def test_multinode_knobs_default_to_one_node_and_are_checked():
    recipe = CONFIGS[0].parent / "grpo_capture_tiny_cpu.yaml"
    cfg = load_master_config(recipe)
    assert (cfg.generation.vllm.bind, cfg.generation.vllm.placement, cfg.data_plane.bind) == ("loopback", "spread", "loopback")
    multi = load_master_config(recipe, ["generation.vllm.bind=node_ip", "data_plane.bind=node_ip",
                                        "generation.vllm.placement=ray"])
    assert (multi.generation.vllm.bind, multi.generation.vllm.placement, multi.data_plane.bind) == ("node_ip", "ray", "node_ip")
    with pytest.raises(ConfigError, match=r"generation\.vllm\.bind"):
        load_master_config(recipe, ["generation.vllm.bind=0.0.0.0"])
    with pytest.raises(ConfigError, match=r"generation\.vllm\.placement"):
        load_master_config(recipe, ["generation.vllm.placement=pack"])


def test_the_refit_folder_is_absolute_and_defaults_under_the_log_dir(tmp_path, monkeypatch):
    recipe = CONFIGS[0].parent / "grpo_capture_tiny_cpu.yaml"
    monkeypatch.chdir(tmp_path)
    assert refit_root(load_master_config(recipe, ["logger.log_dir=runs/a"])) == tmp_path / "runs" / "a" / "weights"
    assert refit_root(load_master_config(recipe, ["grpo.refit_dir=/shared/refit"])) == Path("/shared/refit")
    assert refit_root(load_master_config(recipe, ["grpo.refit_dir=scratch"])) == tmp_path / "scratch"
    with pytest.raises(ConfigError, match=r"grpo\.refit_dir"):
        load_master_config(recipe, ["grpo.refit_dir="])


def _train_row(group: int, index: int, reward: float, chain: int = 0, call: str = "c") -> TrainRow:
    return TrainRow(
        rollout_id=f"r-{group}-{index}", group_index=group, sample_index=index,
        token_ids=(1, 2, 3), token_mask=(0.0, 1.0, 1.0), generation_logprobs=(0.0, -0.5, -0.25),
        reward=reward, prompt_len=1, model_call_ids=(call,), weight_versions=(0,),
        token_in_calls=0, text_root_calls=1, terminal_selection="response_id", origin=RowOrigin.CAPTURE,
        call_spans=((0, 3),), chain_index=chain,
    )


def _row(group: int, index: int, reward: float, chains: int = 1) -> KeptRollout:
    rows = tuple(_train_row(group, index, reward, chain, f"c{chain}") for chain in range(chains))
    return KeptRollout(f"r-{group}-{index}", group, index, rows, reward, "response_id")


def test_build_train_batch_skips_placeholders_and_normalises_per_group():
    ph = Placeholder(rollout_id="r-0-2", group_index=0, sample_index=2, reason=PlaceholderReason.CAPTURE_POISONED, detail="x")
    groups = [GroupResult(0, (_row(0, 0, 1.0), _row(0, 1, 0.0), ph)), GroupResult(1, (_row(1, 0, 1.0), _row(1, 1, 1.0)))]
    out = build_train_batch(groups, normalize=False, train_partition="train")
    assert isinstance(out.rows, TrainBatch) and out.rows.num_samples == 4 and out.train_keys == ()
    assert out.rows.advantages == (0.5, -0.5, 0.0, 0.0)
    assert out.rows.token_mask[0] == (0, 1, 1)
    assert out.rewards_mean == pytest.approx(3.0 / 5.0)


def test_build_train_batch_gives_every_row_of_a_rollout_its_rollout_advantage():
    # Rollout 0 branched into 3 rows; normalisation is per rollout, so it does not weigh 3x.
    groups = [GroupResult(0, (_row(0, 0, 1.0, chains=3), _row(0, 1, 0.0)))]
    out = build_train_batch(groups, normalize=False, train_partition="train")
    assert isinstance(out.rows, TrainBatch) and out.rows.num_samples == 4
    assert out.rows.advantages == (0.5, 0.5, 0.5, -0.5)
    assert out.rewards_mean == pytest.approx(0.5)


def test_masked_steps_are_counted_and_stop_the_run_at_the_limit():
    from nemo_rl.algorithms.grpo_single_controller import MaskedStepsError, next_masked_streak

    assert next_masked_streak(0, trainable=False, limit=3, step=1) == 1
    assert next_masked_streak(1, trainable=False, limit=3, step=2) == 2
    assert next_masked_streak(2, trainable=True, limit=3, step=3) == 0  # a trainable step resets the count
    with pytest.raises(MaskedStepsError, match=r"step 7: 3 consecutive steps .*max_consecutive_masked_steps=3") as excinfo:
        next_masked_streak(2, trainable=False, limit=3, step=7)
    assert excinfo.value.kind == "masked_steps"


def test_rows_must_carry_the_version_the_workers_were_refit_to():
    from nemo_rl.algorithms.grpo_single_controller import GRPOError, check_row_versions

    groups = [GroupResult(0, (_row(0, 0, 1.0), _row(0, 1, 0.0)))]  # rows carry version 0
    check_row_versions(groups, served_version=0, step=1)
    with pytest.raises(GRPOError, match=r"step 2: rows carry weight versions \[0\] but every worker was refit to version 1") as excinfo:
        check_row_versions(groups, served_version=1, step=2)
    assert excinfo.value.kind == "stale_weights"


def test_worker_call_metrics_are_per_step_deltas_of_each_workers_counter():
    from nemo_rl.algorithms.grpo_single_controller import GRPOError, worker_call_metrics

    assert worker_call_metrics([3, 10], [7, 12]) == {"generation/worker_0/calls": 4.0, "generation/worker_1/calls": 2.0}
    with pytest.raises(GRPOError, match="worker count changed during the step: 2 -> 1") as excinfo:
        worker_call_metrics([3, 10], [7])
    assert excinfo.value.kind == "worker_metrics"
