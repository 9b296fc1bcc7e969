"""Single-controller GRPO on exact captured tokens (the project's main job).

    uv run python examples/run_grpo_single_controller.py \
        --config examples/configs/grpo_capture_tiny_cpu.yaml [key=value ...] [+new.key=value ...]

Overrides use Hydra's grammar (`token_capture.enabled=false`, `grpo.max_num_steps=3`,
`logger.log_dir=DIR`). With `model.path: null` the example's tiny model is built from the
recipe's `model.tiny:` block (`examples/arith/recipe.py`) and passed to the library as
`model.path`; it and the vLLM venv are built on first use.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from examples.arith.recipe import load_recipe, resolve_model
from nemo_rl.algorithms.grpo_single_controller import run_grpo
from nemo_rl.utils.config import ConfigError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML recipe (may use a defaults: chain)")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides")
    args = parser.parse_args()
    try:
        recipe = load_recipe(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    cfg = resolve_model(recipe)
    print(f"[grpo] token_capture.enabled={cfg.token_capture.enabled} steps={cfg.grpo.max_num_steps} log_dir={cfg.logger.log_dir}")
    path = asyncio.run(run_grpo(cfg))
    print(f"[grpo] done; metrics in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
