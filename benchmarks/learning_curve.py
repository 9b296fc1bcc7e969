"""Does GRPO learn, sync and async? Run the learning recipe on several seeds and plot `reward/mean`.

    uv run python benchmarks/learning_curve.py --out DIR [--async | --compare] [--steps N] [--seeds 1,2]
                                               [--config YAML] [--control] [key=value ...]

Each run is the loop in this process (`load_and_resolve` from `examples/arith/recipe.py`, which
builds the tiny model for a null `model.path`, then `run_grpo`) with `grpo.seed=k` and its own log
dir: `DIR/seed_<k>` (sync, the default), `DIR/async_seed_<k>` (`--async`: `MODE_OVERRIDES["async"]`,
the async loop with what it needs, capture on and `on_component_failure=abort`), both per seed
with `--compare` (async first, so a failing async loop shows within the first run). Then:
- `DIR/summary.json`: `summarize`'s figures per mode (`reward_first5`, `reward_last5`, `rise`,
  `rise_threshold`, `rising`, the per-step `rewards` and cumulative `wall_s`, one entry per seed),
  at the top level for one mode, under `sync` and `async` with `--compare` (plus `wall_ratio`);
  and the config, overrides, `steps`, per-run `run_time_s` (start-up included), `wall_time_s`;
- `DIR/curve.png`: the rolling mean of `reward/mean` against the step and against the loop's wall
  time, one line per (mode, seed): sync solid, async dashed.
`--control` (sync only) also runs each seed with `policy.learning_rate=1e-12` (`CONTROL_LR`: an
update below float32 resolution, the weights stay bit-identical) into `DIR/control_<k>`:
`summary.json` gains `control` and the plot its rolling means, dotted. It separates learning from
the drift of which problems come up. Progress goes to stderr; the exit status is 0 only if every
run is rising. Not part of the unit lane: it starts the real stack once per run (~1.5 min each on
2 CPU cores) and trains; see docs/guides/token-capture.md and docs/guides/async-grpo.md.

Contract of the pure part, tested in tests/unit/benchmarks/test_learning_curve.py:
- `step_rewards(lines)`: the `reward/mean` of each metrics.jsonl line that has one, in step order
  (blank lines skipped; a repeated step is an error: the logger appends, a reused dir mixes runs).
  `step_wall_s(lines)`: for the same steps, the cumulative sum of their `timing/step_s` (the loop's
  own step timer; start-up and checkpoint writes excluded); a reward line without it is an error.
- `window_means(rewards, window)` = (mean of the first `window`, mean of the last `window`);
  fewer than `2 * window` steps is an error (the windows would overlap).
- `is_rising(rewards, window)`: last mean - first mean > `max(MIN_RISE, 2 * se)`, `se` the standard
  error of that difference from the spread inside the two windows (sample variances). The
  per-step reward of this task is dominated by which problems a step draws, so a rise must clear
  its own noise, and at least MIN_RISE in absolute terms.
- `run_plan(seeds, modes)`: (mode, seed) per run, per seed in `modes` order; `wall_ratio`: per seed,
  sync loop seconds / async loop seconds.
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
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "examples" / "configs" / "grpo_learn_tiny_cpu.yaml"
REWARD_KEY = "reward/mean"
STEP_TIME_KEY = "timing/step_s"
WINDOW = 5
MIN_RISE = 0.05
CONTROL_LR = "1.0e-12"
# What each mode adds to the recipe. Sync says so explicitly, so a recipe with async on compares too;
# async states what the async loop needs (async_config.async_cross_check): capture on, abort on death.
MODE_OVERRIDES: dict[str, tuple[str, ...]] = {
    "sync": ("grpo.async_rollouts.enabled=false",),
    "async": (
        "grpo.async_rollouts.enabled=true",
        "token_capture.enabled=true",
        "token_capture.on_component_failure=abort",
    ),
}
LOG_PREFIX = {"sync": "seed", "async": "async_seed"}  # DIR/<prefix>_<seed>: sync keeps its old name
LINESTYLE = {"sync": "-", "async": "--"}


class CurveError(ValueError):
    """The metrics cannot be summarised (missing, repeated or too few steps)."""


def _reward_records(lines: Iterable[str]) -> list[dict]:
    """The metrics records that have a `reward/mean`, in step order; a repeated step is an error."""
    by_step: dict[int, dict] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if REWARD_KEY not in record:
            continue
        step = int(record["step"])
        if step in by_step:
            raise CurveError(f"line {number}: step {step} appears twice (a reused log dir mixes runs)")
        by_step[step] = record
    return [by_step[s] for s in sorted(by_step)]


def step_rewards(lines: Iterable[str]) -> list[float]:
    """`reward/mean` per logged step, in step order (see the module docstring)."""
    return [float(r[REWARD_KEY]) for r in _reward_records(lines)]


def step_wall_s(lines: Iterable[str]) -> list[float]:
    """Cumulative `timing/step_s` at each step `step_rewards` returns (see the module docstring)."""
    out, total = [], 0.0
    for record in _reward_records(lines):
        if STEP_TIME_KEY not in record:
            raise CurveError(f"step {record['step']} has {REWARD_KEY} but no {STEP_TIME_KEY}")
        total += float(record[STEP_TIME_KEY])
        out.append(total)
    return out


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


def summarize(per_seed: Mapping[int, Sequence[float]], window: int = WINDOW,
              wall: Mapping[int, Sequence[float]] | None = None) -> dict:
    """One number per seed (first/last window means, rise, threshold, rising) and the per-step rewards;
    with `wall` (cumulative seconds per step, as many as rewards) also `wall_s` and `wall_total_s`."""
    seeds = list(per_seed)
    means = [window_means(per_seed[s], window) for s in seeds]
    out = {
        "seeds": seeds,
        "reward_first5": [round(m[0], 6) for m in means],
        "reward_last5": [round(m[1], 6) for m in means],
        "rise": [round(m[1] - m[0], 6) for m in means],
        "rise_threshold": [round(rise_threshold(per_seed[s], window), 6) for s in seeds],
        "rising": [is_rising(per_seed[s], window) for s in seeds],
        "window": window,
        "rewards": {str(s): [round(r, 6) for r in per_seed[s]] for s in seeds},
    }
    if wall is not None:
        for s in seeds:
            if len(wall[s]) != len(per_seed[s]):
                raise CurveError(f"seed {s}: {len(wall[s])} wall times for {len(per_seed[s])} rewards")
        out["wall_s"] = {str(s): [round(t, 3) for t in wall[s]] for s in seeds}
        out["wall_total_s"] = [round(wall[s][-1], 3) for s in seeds]
    return out


def run_plan(seeds: Sequence[int], modes: Sequence[str]) -> list[tuple[str, int]]:
    """(mode, seed) per run: every mode of a seed before the next seed, so the modes of a seed run
    under about the same load of the shared machine."""
    unknown = [m for m in modes if m not in MODE_OVERRIDES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise CurveError(f"modes {list(modes)}: need distinct modes among {sorted(MODE_OVERRIDES)}")
    return [(mode, seed) for seed in seeds for mode in modes]


def wall_ratio(sync_wall: Mapping[int, Sequence[float]], async_wall: Mapping[int, Sequence[float]]) -> list[float]:
    """Per seed (in `sync_wall`'s order): the sync loop's seconds over the async loop's, same steps."""
    out = []
    for seed, sync in sync_wall.items():
        other = async_wall[seed]
        if len(other) != len(sync):
            raise CurveError(f"seed {seed}: sync ran {len(sync)} steps, async {len(other)}; compare equal runs")
        out.append(round(sync[-1] / other[-1], 4))
    return out


def build_summary(
    runs: Mapping[str, Mapping[int, tuple[Sequence[float], Sequence[float]]]],
    run_time: Mapping[str, Mapping[int, float]],
    compare: bool,
    control: Mapping[int, Sequence[float]] | None = None,
) -> dict:
    """summary.json's figures: `summarize` per mode with `wall_s` and `run_time_s`, at the top level for
    one mode, under `sync` and `async` with `compare` (plus `seeds` and `wall_ratio`); `mode`, `steps`,
    and `control` when given. `runs[mode][seed] = (rewards, cumulative wall seconds)`."""
    modes = list(runs)
    if compare and sorted(modes) != ["async", "sync"]:
        raise CurveError(f"a comparison needs a sync and an async run set, got {modes}")
    if not compare and len(modes) != 1:
        raise CurveError(f"one mode without compare, got {modes}")
    per_mode = {}
    for mode in modes:
        seeds = list(runs[mode])
        per_mode[mode] = {
            **summarize({s: runs[mode][s][0] for s in seeds}, wall={s: runs[mode][s][1] for s in seeds}),
            "run_time_s": [run_time[mode][s] for s in seeds],
        }
    if compare:
        wall = {m: {s: w for s, (_, w) in runs[m].items()} for m in modes}
        summary = {"mode": "compare", "seeds": list(runs["sync"]), "sync": per_mode["sync"],
                   "async": per_mode["async"], "wall_ratio": wall_ratio(wall["sync"], wall["async"])}
    else:
        summary = {"mode": modes[0], **per_mode[modes[0]]}
    summary["steps"] = len(next(iter(runs[modes[0]].values()))[0])
    if control:
        summary["control"] = summarize(control)
    return summary


def plot(
    runs: Mapping[str, Mapping[int, tuple[Sequence[float], Sequence[float]]]],
    path: Path,
    title: str,
    control: Mapping[int, Sequence[float]] | None = None,
) -> None:
    """Two panels: the rolling mean of `reward/mean` per step and against the loop's wall time.

    `runs[mode][seed] = (rewards, cumulative wall seconds)`; a seed keeps its colour, a mode its line
    style (sync solid, async dashed); the step panel also shows each step's reward, faint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    seeds = sorted({seed for per_seed in runs.values() for seed in per_seed})
    for mode, per_seed in runs.items():
        for seed, (rewards, wall) in per_seed.items():
            color, style = f"C{seeds.index(seed)}", LINESTYLE[mode]
            steps = list(range(1, len(rewards) + 1))
            smooth = rolling_mean(rewards)
            by_step.plot(steps, rewards, color=color, alpha=0.25, marker="." if mode == "sync" else "x",
                         linestyle="none")
            by_step.plot(steps, smooth, color=color, linestyle=style, linewidth=2.0, label=f"{mode}, seed {seed}")
            by_time.plot([t / 60.0 for t in wall], smooth, color=color, linestyle=style, linewidth=2.0,
                         marker=".", markersize=3, label=f"{mode}, seed {seed}")
    for seed, rewards in (control or {}).items():
        by_step.plot(range(1, len(rewards) + 1), rolling_mean(rewards), color=f"C{seeds.index(seed)}",
                     linestyle=":", linewidth=1.4, label=f"seed {seed}, no-update control")
    by_step.set_xlabel("GRPO step")
    by_time.set_xlabel("loop wall time (min, sum of timing/step_s)")
    by_step.set_ylabel(f"{REWARD_KEY}, rolling mean ({WINDOW} steps)")
    by_step.set_ylim(0.0, 1.05)
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _log(msg: str) -> None:
    print(f"[learning_curve] {msg}", file=sys.stderr, flush=True)


def run_seed(
    config: Path, seed: int, steps: int | None, out: Path, extra: Sequence[str], name: str = "seed"
) -> tuple[list[float], list[float]]:
    """One run of the loop in this process; returns (rewards, cumulative wall seconds) per step."""
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
    lines = Path(path).read_text().splitlines()
    return step_rewards(lines), step_wall_s(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder (curve.png, summary.json, run logs)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: the recipe's)")
    parser.add_argument("--seeds", default="1,2", help="comma-separated grpo.seed values (default 1,2)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="recipe (default grpo_learn_tiny_cpu.yaml)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--async", dest="async_", action="store_true",
                       help="run the async loop (grpo.async_rollouts.enabled=true) instead of the sync one")
    which.add_argument("--compare", action="store_true", help="run async and sync on every seed, one after the other")
    parser.add_argument("--control", action="store_true",
                        help=f"also run each seed with policy.learning_rate={CONTROL_LR} (no-update control; sync only)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra-style overrides for every run")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.steps is not None and args.steps < 2 * WINDOW:
        parser.error(f"--steps={args.steps}: need at least {2 * WINDOW} for the first/last {WINDOW}-step windows")
    modes = ["async", "sync"] if args.compare else ["async"] if args.async_ else ["sync"]
    if args.control and modes != ["sync"]:
        parser.error("--control runs the sync loop only; drop --async/--compare")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs: dict[str, dict[int, tuple[list[float], list[float]]]] = {m: {} for m in modes}
    run_time: dict[str, dict[int, float]] = {m: {} for m in modes}
    for mode, seed in run_plan(seeds, modes):
        t_run = time.monotonic()
        runs[mode][seed] = run_seed(args.config, seed, args.steps, args.out,
                                    [*MODE_OVERRIDES[mode], *args.overrides], name=LOG_PREFIX[mode])
        run_time[mode][seed] = round(time.monotonic() - t_run, 1)
        first, last = window_means(runs[mode][seed][0])
        _log(f"{mode} seed {seed}: first5 {first:.3f} last5 {last:.3f}, loop {runs[mode][seed][1][-1]:.0f} s "
             f"({run_time[mode][seed]:.0f} s with start-up)")
    control: dict[int, list[float]] = {}
    if args.control:
        for seed in seeds:
            extra = [*MODE_OVERRIDES["sync"], *args.overrides, f"policy.learning_rate={CONTROL_LR}"]
            control[seed] = run_seed(args.config, seed, args.steps, args.out, extra, name="control")[0]
            first, last = window_means(control[seed])
            _log(f"control {seed}: first5 {first:.3f} last5 {last:.3f}")
    summary = build_summary(runs, run_time, compare=args.compare, control=control)
    summary.update({"config": str(args.config), "overrides": list(args.overrides),
                    "wall_time_s": round(time.monotonic() - t0, 1)})
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(runs, args.out / "curve.png", f"{args.config.name}: {REWARD_KEY} ({', '.join(modes)}; seeds {seeds})", control)
    _log(f"wrote {args.out / 'summary.json'} and {args.out / 'curve.png'} in {summary['wall_time_s']:.0f} s")
    per_mode = {m: summary[m] for m in modes} if args.compare else {modes[0]: summary}
    brief = {m: {k: s[k] for k in ("reward_first5", "reward_last5", "rising", "wall_total_s")} for m, s in per_mode.items()}
    print(json.dumps({"seeds": seeds, **brief, "wall_time_s": summary["wall_time_s"]}))
    return 0 if all(all(s["rising"]) for s in per_mode.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
