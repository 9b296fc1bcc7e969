"""Build the tiny local policy model and check its tool-use behaviour on the arithmetic task.

Usage (from the repository root):
    python examples/build_tiny_model.py                      # into the content-keyed cache
    python examples/build_tiny_model.py --out /some/new/dir  # into a fresh folder
    python examples/build_tiny_model.py --seed 7 --sft-steps 400 --check 20

Prints the folder, the build time and, with --check N > 0, how many of N held-out problems get
a parseable calculator call, the exact expression, a final answer and the correct answer under
greedy decoding, and the same counts when sampling at temperature 1.0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.arith import task as arith_task
from examples.arith.episodes import Sampling, run_episode, summarize
from examples.arith.tiny_model import TinyModelConfig, build_tiny_model, ensure_tiny_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="new or empty folder; default: the cache")
    parser.add_argument(
        "--cache-root", type=Path, default=None, help="cache root (default: $NRL_CACHE_DIR or <repo>/.cache)"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--sft-steps", type=int, default=None)
    parser.add_argument("--sft-batch-size", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--check", type=int, default=5, help="held-out problems to check (0 to skip)")
    parser.add_argument("--check-seed", type=int, default=7, help="seed of the held-out problems")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TinyModelConfig:
    overrides = {
        "seed": args.seed,
        "sft_steps": args.sft_steps,
        "sft_batch_size": args.sft_batch_size,
        "learning_rate": args.learning_rate,
    }
    return TinyModelConfig(**{k: v for k, v in overrides.items() if v is not None})


def check_behaviour(folder: Path, count: int, seed: int) -> None:
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    problems = arith_task.make_problems(seed, count)
    start = time.monotonic()
    greedy = [run_episode(model, tokenizer, p, Sampling(do_sample=False)) for p in problems]
    for e in greedy:
        print(f"  {e.problem.expression!r:>18} -> call {e.expression!r}, final {e.final_reply!r}, reward {e.reward}")
    g = summarize(greedy)
    print(
        f"greedy: tool call {g.tool_call_ok}/{g.episodes}, exact expression {g.expression_exact}/{g.episodes}, "
        f"final answer {g.final_answer_ok}/{g.episodes}, correct {g.correct}/{g.episodes}"
    )
    sampled = summarize(
        [run_episode(model, tokenizer, p, Sampling(do_sample=True, seed=i)) for i, p in enumerate(problems)]
    )
    print(
        f"sampled (T=1.0): tool call {sampled.tool_call_ok}/{sampled.episodes}, "
        f"exact expression {sampled.expression_exact}/{sampled.episodes}, correct {sampled.correct}/{sampled.episodes}"
    )
    print(f"check took {time.monotonic() - start:.1f}s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from_args(args)
    start = time.monotonic()
    if args.out is not None:
        folder = build_tiny_model(cfg, args.out)
    else:
        folder = ensure_tiny_model(cfg, args.cache_root)
    print(f"tiny model at {folder} (ready in {time.monotonic() - start:.1f}s)")
    if args.check > 0:
        check_behaviour(folder, args.check, args.check_seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
