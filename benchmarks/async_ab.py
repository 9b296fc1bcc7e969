"""Sync against async GRPO on the long-tail workload: throughput, engine idle time, staleness, exactness.

    uv run python benchmarks/async_ab.py --out DIR [--steps 13] [--rounds 2] [--skip-steps 1]
        [--sync-config YAML] [--async-config YAML] [--async-override key=value ...]
        [--arm-timeout-s S] [--summarize-only] [key=value ...]

Each round runs the synchronous recipe (`examples/configs/grpo_longtail_cpu.yaml`), then its async
twin (`grpo_async_longtail_cpu.yaml`), with the recipes' seed (`grpo.seed` 42 unless an override
sets it), so both arms train the same prompts per step. Each arm is a child process
(`async_ab.py --arm MODE`) that starts a fresh stack and runs `run_grpo` unchanged, writing its
`metrics.jsonl` under `DIR/arms/<mode>_r<k>/`; a child past `--arm-timeout-s` is killed by process
group. `key=value` overrides go to both arms, `--async-override` ones to the async arm only. The
defaults (2 rounds of 13 steps) take 15-20 minutes on 2 loaded cores. Progress goes to stderr; no
figure is asserted (the issue's targets are printed beside them). Outputs: `DIR/results.json`,
`DIR/report.md`, `DIR/reward_vs_wall.png`, `DIR/step_phases.png`, `DIR/trajectory_age.png`.

Every figure comes from what the loops log themselves (metrics.jsonl), over the measured steps
(the first `--skip-steps` of each arm left out: warm-up, and the async loop's first step, which has
nothing to overlap with):
- wall time: the sum of the steps' own `timing/step_s` (the stack's start is left out);
- trained generated tokens: the sum of `train/num_tokens` (the loss-masked, i.e. generated,
  tokens the policy trained on); trained rollouts: the sum of `finalize/kept_rollouts`;
- `throughput_ratio` = (async tokens / async wall) / (sync tokens / sync wall), pooled over rounds;
  `rollouts_per_s_ratio` likewise; the per-round ratios too;
- `engine_idle_fraction_<mode>`: `async/engine_idle_fraction` (the engines' own idle clock over
  each step's window; both loops log it) averaged with each step's `timing/step_s` as weight;
- `trajectory_age_steps`: the async arm's `async/trajectory_age_steps/hist/*` summed; the sync
  loop refuses any row not at the served version (`check_row_versions`), so all its trained
  rollouts are age 0 (reported as such, with that source);
- `token_mult_prob_error`, `gen_kl_error`: mean and max over the measured steps, per mode.
Contract of the pure part (tests/unit/benchmarks/test_async_ab.py): `arm_figures`, `age_histogram`,
`reward_curve`, `summarize`, `write_report`; a missing key or an empty window is a `BenchError`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rl.utils.child_process import wait_for_group

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "examples" / "configs"
MODES = ("sync", "async")
DEFAULT_CONFIGS = {"sync": CONFIGS / "grpo_longtail_cpu.yaml", "async": CONFIGS / "grpo_async_longtail_cpu.yaml"}
STEP_S, TOKENS, ROLLOUTS, IDLE = "timing/step_s", "train/num_tokens", "finalize/kept_rollouts", "async/engine_idle_fraction"
EXACTNESS_KEYS = ("token_mult_prob_error", "gen_kl_error")
# Per-step phases, mean over the measured steps (a mode lacking one reports None): where the time goes.
PHASES = ("timing/step_s", "timing/generation_s", "async/trainer_wait_s", "timing/train_s", "timing/refit_s",
          "async/refit_pause_s", "timing/finalize_s")
AGE_PREFIX = "async/trajectory_age_steps/hist/"
TARGETS = {"throughput_ratio": ">= 1.5", "token_mult_prob_error": "async no worse than sync"}


class BenchError(ValueError):
    """The arms' logs cannot be summarised (missing key, empty window, a failed arm)."""


def _log(msg: str) -> None:
    print(f"[async_ab] {msg}", file=sys.stderr, flush=True)


# -- the pure part ---------------------------------------------------------------------------------


def metrics_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """metrics.jsonl records in step order (a repeated step is a `BenchError`)."""
    from nemo_rl.utils.logger import metrics_by_step

    return metrics_by_step(lines, BenchError)


def _measured(records: Sequence[Mapping[str, Any]], skip_steps: int) -> list[Mapping[str, Any]]:
    kept = list(records)[skip_steps:]
    if not kept:
        raise BenchError(f"{len(records)} logged steps, {skip_steps} skipped: nothing to measure")
    return kept


def _need(record: Mapping[str, Any], key: str) -> float:
    if key not in record:
        raise BenchError(f"step {record.get('step')} has no {key!r}")
    return float(record[key])


def age_histogram(records: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Kept rollouts per trajectory age (`async/trajectory_age_steps/hist/<a>` summed over `records`)."""
    hist: dict[str, int] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith(AGE_PREFIX):
                bucket = key[len(AGE_PREFIX):]
                hist[bucket] = hist.get(bucket, 0) + int(value)
    return dict(sorted(hist.items(), key=lambda kv: (kv[0] == "older", int(kv[0]) if kv[0] != "older" else 0)))


def reward_curve(records: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(wall seconds at the step's end: cumulative `timing/step_s` from step 1, `reward/mean`) per step."""
    out, wall = [], 0.0
    for record in records:
        wall += _need(record, STEP_S)
        out.append((round(wall, 6), _need(record, "reward/mean")))
    return out


def arm_figures(records: Sequence[Mapping[str, Any]], skip_steps: int) -> dict[str, Any]:
    """One arm's figures over its measured steps (see the module docstring for each one's source)."""
    kept = _measured(records, skip_steps)
    wall = sum(_need(r, STEP_S) for r in kept)
    if wall <= 0:
        raise BenchError("the measured steps took no time")
    tokens = sum(float(r.get(TOKENS, 0.0)) for r in kept)  # a masked step trains nothing and logs no tokens
    rollouts = sum(_need(r, ROLLOUTS) for r in kept)
    idle = sum(_need(r, IDLE) * _need(r, STEP_S) for r in kept) / wall
    exact = {}
    for key in EXACTNESS_KEYS:
        values = [float(r[key]) for r in kept if key in r]
        if not values:
            raise BenchError(f"no measured step logged {key!r} (nothing trained?)")
        exact[key] = {"mean": statistics.fmean(values), "max": max(values)}
    phases = {}
    for key in PHASES:
        values = [float(r[key]) for r in kept if key in r]
        phases[key] = statistics.fmean(values) if values else None
    return {
        "steps": len(kept), "wall_s": wall, "trained_tokens": tokens, "trained_rollouts": rollouts,
        "tokens_per_s": tokens / wall, "rollouts_per_s": rollouts / wall, "engine_idle_fraction": idle,
        **exact, "phases_mean_s": phases, "trajectory_age_steps": age_histogram(kept),
        "dropped_stale_groups": sum(float(r.get("async/dropped_stale_groups", 0.0)) for r in kept),
        "reward_mean": statistics.fmean(_need(r, "reward/mean") for r in kept),
    }


def _ratio(a: float, b: float, what: str) -> float:
    if b == 0:
        raise BenchError(f"{what}: the sync figure is 0")
    return a / b


def summarize(arms: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Pooled figures per mode over rounds (sums of tokens, rollouts and wall), the async/sync ratios
    of the pooled rates, the per-round ratios, and the issue's named keys."""
    if set(arms) != set(MODES) or len(arms["sync"]) != len(arms["async"]) or not arms["sync"]:
        raise BenchError(f"need the same, non-zero number of rounds per mode: {({m: len(v) for m, v in arms.items()})}")
    pooled: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        rounds = arms[mode]
        wall = sum(r["wall_s"] for r in rounds)
        pooled[mode] = {
            "rounds": len(rounds), "wall_s": wall,
            "trained_tokens": sum(r["trained_tokens"] for r in rounds),
            "trained_rollouts": sum(r["trained_rollouts"] for r in rounds),
            "tokens_per_s": sum(r["trained_tokens"] for r in rounds) / wall,
            "rollouts_per_s": sum(r["trained_rollouts"] for r in rounds) / wall,
            "engine_idle_fraction": sum(r["engine_idle_fraction"] * r["wall_s"] for r in rounds) / wall,
            "token_mult_prob_error": {"mean": statistics.fmean(r["token_mult_prob_error"]["mean"] for r in rounds),
                                      "max": max(r["token_mult_prob_error"]["max"] for r in rounds)},
            "gen_kl_error": {"mean": statistics.fmean(r["gen_kl_error"]["mean"] for r in rounds),
                             "max": max(r["gen_kl_error"]["max"] for r in rounds)},
            "phases_mean_s": {k: (statistics.fmean(v) if (v := [r["phases_mean_s"][k] for r in rounds
                                                                if r["phases_mean_s"][k] is not None]) else None)
                              for k in PHASES},
            "dropped_stale_groups": sum(r["dropped_stale_groups"] for r in rounds),
            "reward_mean": statistics.fmean(r["reward_mean"] for r in rounds),
        }
    ages: dict[str, int] = {}
    for r in arms["async"]:
        for bucket, count in r["trajectory_age_steps"].items():
            ages[bucket] = ages.get(bucket, 0) + count
    s, a = pooled["sync"], pooled["async"]
    return {
        "throughput_ratio": _ratio(a["tokens_per_s"], s["tokens_per_s"], "tokens/s"),
        "rollouts_per_s_ratio": _ratio(a["rollouts_per_s"], s["rollouts_per_s"], "rollouts/s"),
        "throughput_ratio_per_round": [_ratio(ra["tokens_per_s"], rs["tokens_per_s"], "tokens/s")
                                       for rs, ra in zip(arms["sync"], arms["async"])],
        "engine_idle_fraction_sync": s["engine_idle_fraction"],
        "engine_idle_fraction_async": a["engine_idle_fraction"],
        "trajectory_age_steps": {"async": ages, "sync": {"0": int(s["trained_rollouts"])},
                                 "sync_source": "check_row_versions: every sync row is at the served version"},
        "token_mult_prob_error": {m: pooled[m]["token_mult_prob_error"] for m in MODES},
        "gen_kl_error": {m: pooled[m]["gen_kl_error"] for m in MODES},
        "train_s_ratio": (_ratio(a["phases_mean_s"]["timing/train_s"], s["phases_mean_s"]["timing/train_s"], "train_s")
                          if a["phases_mean_s"]["timing/train_s"] and s["phases_mean_s"]["timing/train_s"] else None),
        "pooled": pooled,
        "targets": TARGETS,
    }


def _f(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_report(results: Mapping[str, Any]) -> str:
    """report.md: the headline ratios against the targets, per-mode figures, phases and ages."""
    s, a = results["pooled"]["sync"], results["pooled"]["async"]
    cfg = results["config"]
    lines = [
        "# Async A/B: sync against async GRPO on the long-tail workload", "",
        f"`{cfg['command']}`", "",
        f"{cfg['rounds']} rounds (sync then async, same seed), {cfg['steps']} steps per arm, the first "
        f"{cfg['skip_steps']} of each left out. Wall time is the sum of the steps' own `timing/step_s`. "
        f"Load average (1, 5, 15 min) at the start {cfg['load_start']}, at the end {cfg['load_end']}.", "",
        f"- **throughput_ratio** (trained generated tokens/s, async / sync): **{_f(results['throughput_ratio'])}** "
        f"(target {TARGETS['throughput_ratio']}; per round "
        + ", ".join(_f(r) for r in results["throughput_ratio_per_round"]) + ")",
        f"- rollouts_per_s_ratio (trained rollouts/s): {_f(results['rollouts_per_s_ratio'])}",
        f"- engine idle fraction: sync {_f(results['engine_idle_fraction_sync'])}, async "
        f"{_f(results['engine_idle_fraction_async'])}",
        f"- token_mult_prob_error mean: sync {_f(s['token_mult_prob_error']['mean'], 4)}, async "
        f"{_f(a['token_mult_prob_error']['mean'], 4)} (target: {TARGETS['token_mult_prob_error']})",
        "", "| | sync | async |", "|---|---|---|",
    ]
    rows = [("measured wall, s", "wall_s", 1), ("trained generated tokens", "trained_tokens", 0),
            ("trained rollouts", "trained_rollouts", 0), ("tokens/s", "tokens_per_s", 2),
            ("rollouts/s", "rollouts_per_s", 3), ("engine idle fraction", "engine_idle_fraction", 3),
            ("dropped stale groups", "dropped_stale_groups", 0), ("reward/mean (measured steps)", "reward_mean", 3)]
    for label, key, digits in rows:
        lines.append(f"| {label} | {_f(s[key], digits)} | {_f(a[key], digits)} |")
    for key in EXACTNESS_KEYS:
        for stat in ("mean", "max"):
            lines.append(f"| {key} {stat} | {_f(s[key][stat], 4)} | {_f(a[key][stat], 4)} |")
    lines += ["", "Per step, mean seconds (where the time goes):", "", "| phase | sync | async |", "|---|---|---|"]
    for key in PHASES:
        lines.append(f"| `{key}` | {_f(s['phases_mean_s'][key])} | {_f(a['phases_mean_s'][key])} |")
    ages = results["trajectory_age_steps"]
    lines += ["", "Trained rollouts per trajectory age (policy updates behind the trainer): async "
              + ", ".join(f"{k}: {v}" for k, v in ages["async"].items())
              + f"; sync 0: {ages['sync']['0']} ({ages['sync_source']}).", ""]
    return "\n".join(lines)


# -- plots -------------------------------------------------------------------------------------------


def plot(results: Mapping[str, Any], curves: Mapping[str, Sequence[Sequence[tuple[float, float]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, mode in enumerate(MODES):
        for k, curve in enumerate(curves[mode]):
            ax.plot([w for w, _ in curve], [r for _, r in curve], color=f"C{i}", marker=".", alpha=0.5 + 0.5 / (k + 1),
                    label=f"{mode}, round {k + 1}")
    ax.set_xlabel("wall time, s (cumulative timing/step_s)")
    ax.set_ylabel("reward/mean")
    ax.set_title("reward against wall time", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward_vs_wall.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    phases = [k for k in PHASES if k != STEP_S]
    width = 0.38
    for i, mode in enumerate(MODES):
        values = [results["pooled"][mode]["phases_mean_s"][k] or 0.0 for k in phases]
        ax.bar([x + (i - 0.5) * width for x in range(len(phases))], values, width, label=mode, color=f"C{i}")
    ax.set_xticks(range(len(phases)), [k.split("/")[-1] for k in phases], rotation=20, fontsize=8)
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("where a step's time goes (step_s: sync "
                 f"{_f(results['pooled']['sync']['phases_mean_s'][STEP_S], 2)}, async "
                 f"{_f(results['pooled']['async']['phases_mean_s'][STEP_S], 2)})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "step_phases.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ages = results["trajectory_age_steps"]["async"]
    ax.bar(list(ages), list(ages.values()), color="C1")
    ax.set_xlabel("trajectory age, policy updates")
    ax.set_ylabel("trained rollouts (async)")
    ax.set_title("async: trained rollouts per age", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "trajectory_age.png", dpi=120)
    plt.close(fig)


# -- the arms ----------------------------------------------------------------------------------------


def run_arm(config: Path, log_dir: Path, overrides: Sequence[str]) -> None:
    """In the child: one recipe run in this process (a fresh stack), as learning_curve.py runs it."""
    from examples.arith.recipe import load_and_resolve
    from nemo_rl.algorithms.grpo_single_controller import run_grpo

    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cfg = load_and_resolve(config, [*overrides, f"logger.log_dir={log_dir}"], progress=progress)
    asyncio.run(run_grpo(cfg, progress=progress))


def _run_child(argv: list[str], log_path: Path, timeout_s: float, tag: str) -> dict[str, Any]:
    """The child in its own session, stderr teed to `log_path`; killed by its process group at the deadline."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started, load_before = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], cwd=REPO_ROOT,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                log.write(line)
                log.flush()
                if line.startswith(("[step", "[async]", "[stack]")) and ("training on" in line or "dispatch" in line
                                                                         or "dropped" in line or "[stack]" in line):
                    print(f"[{tag}] {line.rstrip()}", file=sys.stderr, flush=True)
                elif "Error" in line:
                    print(f"[{tag}] {line.rstrip()}", file=sys.stderr, flush=True)

        wait_for_group(proc, timeout_s, tag, log_path, BenchError, _log, pump)
    run = {"wall_s": round(time.monotonic() - started, 1), "load_before": load_before,
           "load_after": [round(x, 2) for x in os.getloadavg()]}
    (log_path.parent / "run.json").write_text(json.dumps(run, indent=1))
    return run


def _arm_dir(out: Path, mode: str, k: int) -> Path:
    return out / "arms" / f"{mode}_r{k}"


def collect(args: argparse.Namespace) -> tuple[dict[str, list[dict]], dict[str, list[list[tuple[float, float]]]], dict]:
    """Every arm's figures and reward curve from `DIR/arms/`, and the children's wall and load."""
    arms: dict[str, list[dict]] = {m: [] for m in MODES}
    curves: dict[str, list[list[tuple[float, float]]]] = {m: [] for m in MODES}
    runs: dict[str, Any] = {}
    for k in range(args.rounds):
        for mode in MODES:
            folder = _arm_dir(args.out, mode, k)
            path = folder / "metrics.jsonl"
            if not path.exists():
                raise BenchError(f"{path} is missing")
            records = metrics_records(path.read_text().splitlines())
            if len(records) != args.steps:
                raise BenchError(f"{path}: {len(records)} steps logged, expected {args.steps}")
            arms[mode].append(arm_figures(records, args.skip_steps))
            curves[mode].append(reward_curve(records))
            run_json = folder / "run.json"
            runs[f"{mode}_r{k}"] = json.loads(run_json.read_text()) if run_json.exists() else None
    return arms, curves, runs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (results.json, report.md, PNGs, arms/)")
    p.add_argument("--steps", type=int, default=13, help="GRPO steps per arm (default 13)")
    p.add_argument("--rounds", type=int, default=2, help="sync+async rounds (default 2)")
    p.add_argument("--skip-steps", type=int, default=1, help="first steps of each arm left out (default 1)")
    p.add_argument("--sync-config", type=Path, default=DEFAULT_CONFIGS["sync"])
    p.add_argument("--async-config", type=Path, default=DEFAULT_CONFIGS["async"])
    p.add_argument("--async-override", action="append", default=[], help="key=value for the async arm only")
    p.add_argument("--arm-timeout-s", type=float, default=900.0, help="deadline per arm (default 900)")
    p.add_argument("--summarize-only", action="store_true", help="rebuild the outputs from DIR/arms/")
    p.add_argument("--arm", choices=MODES, help=argparse.SUPPRESS)  # internal: run one arm in this process
    p.add_argument("--log-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value overrides for both arms")
    args = p.parse_args(argv)
    if args.steps <= args.skip_steps:
        p.error(f"--steps={args.steps} must exceed --skip-steps={args.skip_steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.arm is not None:
        config = args.sync_config if args.arm == "sync" else args.async_config
        extra = args.async_override if args.arm == "async" else []
        run_arm(config, args.log_dir, [*args.overrides, *extra, f"grpo.max_num_steps={args.steps}"])
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    command = "uv run python benchmarks/async_ab.py " + " ".join(
        [f"--out {args.out.name}", f"--steps {args.steps}", f"--rounds {args.rounds}", f"--skip-steps {args.skip_steps}",
         *(f"--async-override {o}" for o in args.async_override), *args.overrides])
    started, load_start = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    if not args.summarize_only:
        for k in range(args.rounds):
            for mode in MODES:
                folder = _arm_dir(args.out, mode, k)
                if folder.exists():
                    raise BenchError(f"{folder} exists: use a fresh --out (the logger appends, runs would mix)")
                _log(f"round {k + 1}/{args.rounds}: {mode} ({args.steps} steps), load {os.getloadavg()[0]:.2f}")
                argv_child = ["--out", str(args.out), "--arm", mode, "--log-dir", str(folder), "--steps", str(args.steps),
                              "--sync-config", str(args.sync_config), "--async-config", str(args.async_config),
                              *(f"--async-override={o}" for o in args.async_override), *args.overrides]
                run = _run_child(argv_child, folder / "child.log", args.arm_timeout_s, f"{mode} r{k + 1}")
                _log(f"round {k + 1}: {mode} done in {run['wall_s']:.0f} s")
    arms, curves, runs = collect(args)
    results = summarize(arms)
    results["per_round"] = arms
    results["reward_vs_wall"] = curves
    results["runs"] = runs
    results["config"] = {"command": command, "steps": args.steps, "rounds": args.rounds, "skip_steps": args.skip_steps,
                         "sync_config": str(args.sync_config.relative_to(REPO_ROOT)) if args.sync_config.is_relative_to(REPO_ROOT) else str(args.sync_config),
                         "async_config": str(args.async_config.relative_to(REPO_ROOT)) if args.async_config.is_relative_to(REPO_ROOT) else str(args.async_config),
                         "overrides": list(args.overrides), "async_overrides": list(args.async_override),
                         "load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()],
                         "invocation_s": round(time.monotonic() - started, 1), "cpus": os.cpu_count()}
    (args.out / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    (args.out / "report.md").write_text(write_report(results))
    plot(results, curves, args.out)
    _log(f"wrote {args.out}/results.json, report.md and 3 PNGs in {time.monotonic() - started:.0f} s")
    print(json.dumps({k: results[k] for k in ("throughput_ratio", "rollouts_per_s_ratio", "engine_idle_fraction_sync",
                                              "engine_idle_fraction_async", "token_mult_prob_error")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
