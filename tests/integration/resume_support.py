"""What the kill-and-resume tests read: JSONL logs (whole lines, while a driver may be appending)
and the prompt sequence an uninterrupted run dispatches, computed from the prompt source itself.

The recipes' prompt sources are pure in (seed, step) (`tests/unit/algorithms/test_grpo_checkpoint.py`
proves it for every source), so no third, uninterrupted stack run is needed for the reference.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """The records of `path`'s whole lines (a line its writer is appending is left out); [] if absent."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def uninterrupted_prompts(recipe: Path, overrides: Sequence[str], steps: int, model_dir: Path) -> list[tuple[int, int, str]]:
    """(step, group, row digest) of every group an uninterrupted run of `recipe` dispatches, in order:
    the source the loop calls (`make_prompt_source`), batch by batch."""
    from nemo_rl.algorithms.grpo_checkpoint import batch_digest
    from nemo_rl.algorithms.grpo_config import load_master_config
    from nemo_rl.environments.datasets import make_prompt_source
    from nemo_rl.environments.task import RowSampling

    cfg = load_master_config(recipe, list(overrides))
    sampling = RowSampling(temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p, max_output_tokens=cfg.grpo.max_output_tokens)
    source = make_prompt_source(cfg.env, seed=cfg.grpo.seed, sampling=sampling, model_dir=model_dir,
                                max_model_len=cfg.generation.vllm.max_model_len, progress=lambda _: None)
    p = cfg.grpo.num_prompts_per_step
    return [(s, g, batch_digest([row])) for s in range(1, steps + 1) for g, row in enumerate(source.batch(s, p))]
