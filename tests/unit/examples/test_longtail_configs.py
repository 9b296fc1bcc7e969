"""The long-tail recipes: the sync one loads as stated; the async one is the sync one with async rollouts on."""

from __future__ import annotations

from pathlib import Path

from examples.arith.recipe import load_recipe

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs"
SYNC = CONFIGS / "grpo_longtail_cpu.yaml"
ASYNC = CONFIGS / "grpo_async_longtail_cpu.yaml"


def test_the_sync_long_tail_recipe_runs_the_chained_task() -> None:
    recipe = load_recipe(SYNC)
    cfg = recipe.config
    assert recipe.tiny_corpus == "arith_chain" and cfg.model.path is None
    assert cfg.env.task == "examples.arith.gym_task:CHAINED_TASK"
    assert cfg.env.agent_max_steps == 16 >= 12 + 1  # 12 tool calls and the answer
    assert (cfg.env.arith_problem_pool, cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (16, 4, 4)
    assert cfg.token_capture.enabled and cfg.grpo.async_rollouts.enabled is False
    assert cfg.logger.log_dir == "logs/grpo_longtail_cpu"


def test_the_async_long_tail_recipe_is_the_sync_one_with_async_rollouts() -> None:
    recipe = load_recipe(ASYNC)
    assert recipe.config.grpo.async_rollouts.enabled is True
    sync = load_recipe(SYNC, ["logger.log_dir=logs/grpo_async_longtail_cpu"]).config
    assert recipe.config.model_dump(exclude={"grpo": {"async_rollouts"}}) == sync.model_dump(
        exclude={"grpo": {"async_rollouts"}})
