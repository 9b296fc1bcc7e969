"""Does GRPO learn? Run the learning recipe on several seeds and plot `reward/mean` per step.

    uv run python benchmarks/learning_curve.py --out DIR [--steps N] [--seeds 1,2] [--config YAML] [--control] [key=value ...]

For each seed k the loop runs in this process (`load_and_resolve` from `examples/arith/recipe.py`,
which builds the tiny model for a null `model.path`, then `run_grpo`) with `grpo.seed=k` and
`logger.log_dir=DIR/seed_<k>`; then:
- `DIR/summary.json`: `seeds`, `reward_first5`, `reward_last5` (one number per seed: the mean
  `reward/mean` of the first and of the last 5 logged steps), `rising` (one bool per seed, see
  `is_rising`), the per-step `rewards`, `steps`, the config, the overrides and `wall_time_s`;
- `DIR/curve.png`: `reward/mean` per step, one line per seed, with its rolling mean.
With `--control`, each seed also runs once more with `policy.learning_rate=1e-12` (`CONTROL_LR`:
the same loop, problems and sampling, but an update below float32 resolution, so the weights stay
bit-identical): `summary.json` gains `control` (the same figures for those runs) and the plot
their rolling means, dashed. It separates learning from the drift of which problems come up.
Progress goes to stderr. Not part of the unit lane: it starts the real stack once per seed
(~1.5 min each on 2 CPU cores) and trains; see docs/guides/token-capture.md (Learning curve).

Contract of the pure part (`step_rewards`, `window_means`, `is_rising`, `rolling_mean`,
`summarize`), tested in tests/unit/benchmarks/test_learning_curve.py:
- `step_rewards(lines)` reads metrics.jsonl lines (blank lines skipped) and returns the
  `reward/mean` of each line that has one, in step order; a repeated step is an error (the
  logger appends, so a reused log dir would mix runs).
- `window_means(rewards, window)` = (mean of the first `window`, mean of the last `window`);
  fewer than `2 * window` steps is an error (the windows would overlap).
- `is_rising(rewards, window)`: last mean - first mean > `max(MIN_RISE, 2 * se)` where `se` is
  the standard error of that difference from the spread of the steps inside the two windows
  (sqrt(var_first / w + var_last / w), sample variances). The per-step reward of this task is
  dominated by which problems a step draws (an untrained policy swings between ~0.2 and 1.0
  from step to step), so a rise must clear its own noise, and at least MIN_RISE in absolute terms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "examples" / "configs" / "grpo_learn_tiny_cpu.yaml"
REWARD_KEY = "reward/mean"
WINDOW = 5
MIN_RISE = 0.05
CONTROL_LR = "1.0e-12"


class CurveError(ValueError):
    """The metrics cannot be summarised (missing, repeated or too few steps)."""


def step_rewards(lines: Iterable[str]) -> list[float]:
    """`reward/mean` per logged step, in step order (see the module docstring)."""
    by_step: dict[int, float] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if REWARD_KEY not in record:
            continue
        step = int(record["step"])
        if step in by_step:
            raise CurveError(f"line {number}: step {step} appears twice (a reused log dir mixes runs)")
        by_step[step] = float(record[REWARD_KEY])
    return [by_step[s] for s in sorted(by_step)]


def window_means(rewards: Sequence[float], window: int = WINDOW) -> tuple[float, float]:
    if len(rewards) < 2 * window:
        raise CurveError(f"{len(rewards)} steps with {REWARD_KEY}; need at least {2 * window} (two windows of {window})")
    return statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])


def rise_threshold(rewards: Sequence[float], window: int = WINDOW) -> float:
    """max(MIN_RISE, 2 * standard error of last-window mean - first-window mean)."""
    first, last = rewards[:window], rewards[-window:]
    se = math.sqrt(statistics.variance(first) / window + statistics.variance(last) / window)
    return max(MIN_RISE, 2.0 * se)


def is_rising(rewards: Sequence[float], window: int = WINDOW) -> bool:
    first, last = window_means(rewards, window)
    return last - first > rise_threshold(rewards, window)


def rolling_mean(values: Sequence[float], window: int = WINDOW) -> list[float]:
    """Trailing mean over up to `window` values ending at each position."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(statistics.fmean(part))
    return out


def summarize(per_seed: dict[int, Sequence[float]], window: int = WINDOW) -> dict:
    seeds = list(per_seed)
    means = [window_means(per_seed[s], window) for s in seeds]
    return {
        "seeds": seeds,
        "reward_first5": [round(m[0], 6) for m in means],
        "reward_last5": [round(m[1], 6) for m in means],
        "rise": [round(m[1] - m[0], 6) for m in means],
        "rise_threshold": [round(rise_threshold(per_seed[s], window), 6) for s in seeds],
        "rising": [is_rising(per_seed[s], window) for s in seeds],
        "window": window,
        "rewards": {str(s): [round(r, 6) for r in per_seed[s]] for s in seeds},
    }


def plot(
    per_seed: dict[int, Sequence[float]],
    path: Path,
    title: str,
    control: dict[int, Sequence[float]] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (seed, rewards) in enumerate(per_seed.items()):
        color = f"C{i}"
        steps = list(range(1, len(rewards) + 1))
        ax.plot(steps, rewards, color=color, alpha=0.35, marker=".", label=f"seed {seed}")
        ax.plot(steps, rolling_mean(rewards), color=color, linewidth=2.2, label=f"seed {seed}, rolling mean ({WINDOW})")
        if control and seed in control:
            ax.plot(steps[: len(control[seed])], rolling_mean(control[seed]), color=color, linestyle="--",
                    linewidth=1.4, label=f"seed {seed}, no-update control")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(REWARD_KEY)
    ax.set_ylim(0.0, 1.05)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _log(msg: str) -> None:
    print(f"[learning_curve] {msg}", file=sys.stderr, flush=True)


def run_seed(
    config: Path, seed: int, steps: int | None, out: Path, extra: Sequence[str], name: str = "seed"
) -> list[float]:
    from examples.arith.recipe import load_and_resolve
    from nemo_rl.algorithms.grpo_single_controller import run_grpo

    log_dir = out / f"{name}_{seed}"
    shutil.rmtree(log_dir, ignore_errors=True)  # the logger appends: never mix two runs
    overrides = [f"grpo.seed={seed}", f"logger.log_dir={log_dir}", *extra]
    if steps is not None:
        overrides.append(f"grpo.max_num_steps={steps}")
    progress = lambda m: print(f"[{name} {seed}] {m}", file=sys.stderr, flush=True)  # noqa: E731
    cfg = load_and_resolve(config, overrides, progress=progress)  # model.path null: the tiny model
    _log(f"{name} {seed}: {cfg.grpo.max_num_steps} steps, log_dir={log_dir}")
    path = asyncio.run(run_grpo(cfg, progress=progress))
    return step_rewards(Path(path).read_text().splitlines())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder (curve.png, summary.json, seed_<k>/)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per seed (default: the recipe's)")
    parser.add_argument("--seeds", default="1,2", help="comma-separated grpo.seed values (default 1,2)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="recipe (default grpo_learn_tiny_cpu.yaml)")
    parser.add_argument("--control", action="store_true",
                        help=f"also run each seed with policy.learning_rate={CONTROL_LR} (no-update control)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra-style overrides for every seed")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.steps is not None and args.steps < 2 * WINDOW:
        parser.error(f"--steps={args.steps}: need at least {2 * WINDOW} for the first/last {WINDOW}-step windows")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    per_seed: dict[int, list[float]] = {}
    for seed in seeds:
        t_seed = time.monotonic()
        per_seed[seed] = run_seed(args.config, seed, args.steps, args.out, args.overrides)
        first, last = window_means(per_seed[seed])
        _log(f"seed {seed}: first5 {first:.3f} last5 {last:.3f} ({time.monotonic() - t_seed:.0f} s)")
    control: dict[int, list[float]] = {}
    if args.control:
        for seed in seeds:
            extra = [*args.overrides, f"policy.learning_rate={CONTROL_LR}"]
            control[seed] = run_seed(args.config, seed, args.steps, args.out, extra, name="control")
            first, last = window_means(control[seed])
            _log(f"control {seed}: first5 {first:.3f} last5 {last:.3f}")
    summary = summarize(per_seed)
    if control:
        summary["control"] = summarize(control)
    summary.update({
        "config": str(args.config),
        "overrides": list(args.overrides),
        "steps": len(next(iter(per_seed.values()))),
        "wall_time_s": round(time.monotonic() - t0, 1),
    })
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(per_seed, args.out / "curve.png", f"{args.config.name}: {REWARD_KEY} per step (seeds {seeds})", control)
    _log(f"wrote {args.out / 'summary.json'} and {args.out / 'curve.png'} in {summary['wall_time_s']:.0f} s")
    print(json.dumps({k: summary[k] for k in ("seeds", "reward_first5", "reward_last5", "rising", "wall_time_s")}))
    return 0 if all(summary["rising"]) else 1


if __name__ == "__main__":
    sys.exit(main())
