"""Soak (issue 9 item 5): many concurrent multi-turn rollouts per step, several steps, bounded memory.

    uv run python benchmarks/soak.py --out DIR [--steps N] [--prompts P] [--generations G]
        [--config YAML] [--max-tokens T] [--interval-s S] [--base-step K] [--growth-pct X]
        [--growth-floor-mib M] [--min-calls-per-rollout C] [--timeout-s S] [key=value ...]

Runs the real GRPO driver (`examples/run_grpo_single_controller.py --config <recipe>`, default
`examples/configs/grpo_soak_cpu.yaml`) as a child process with `token_capture.enabled=true`,
`grpo.num_prompts_per_step=P`, `grpo.num_generations_per_prompt=G` (defaults 8 x 8 = 64
rollouts in flight per step: every group of a step runs concurrently), `grpo.max_num_steps=N`
(default 5) and `logger.log_dir=DIR/logs`; `--max-tokens T` sets `grpo.max_output_tokens` and
`generation.max_new_tokens`; further `key=value` overrides go to the driver as given. Each
arithmetic rollout is a tool loop (a calculator call, its result, the answer: 2 model calls).

While the driver runs, a sampler thread reads the RSS of every process of the run every
`--interval-s` (0.5 s) with psutil: the driver's descendants (its private Ray cluster's raylet is
its child, so every actor process is a descendant; the Gym servers are its children in their own
sessions) plus any process that inherited the run's `NRL_SOAK_TAG` environment value (rescanned
every `TAG_RESCAN_S`). Each process is classified by `classify` (its process title / command
line, `COMPONENT_PATTERNS`; the driver by pid) and RSS is summed per component. The driver's
output goes to `DIR/driver.log`; its `[step k] dispatching` line marks the start of step 1, and
each line appended to `DIR/logs/metrics.jsonl` marks the end of its step.

Outputs: `DIR/soak.json`, `DIR/report.md`, `DIR/samples.jsonl` (every sample: seconds since the
start, MiB per component and its anonymous part, processes per component), `DIR/driver.log`. Progress lines (`[soak] ...`) go to stdout.
Exit status: 0 when every check passed, 1 when a check failed (both write the outputs), 2 when
the run itself failed (the driver exited non-zero or passed `--timeout-s`: the outputs hold what
was sampled, and the error names the driver's exit and its log; or a `SoakError`: a reused
`--out`, a malformed metrics line, a failed sampler). Processes of the run still alive
`LEFTOVER_GRACE_S` after the driver exits are SIGKILLed by pid (only those carrying the run's tag
or seen during the run with the same start time) and listed in `leftover_processes_killed`.

Checks (`soak.json["checks"]`, each `{"ok": true | false | null, "detail": str}`; null means
"not logged" and fails nothing):
- `steps`: metrics.jsonl has exactly steps 1..N.
- `accounting`: every step `rollouts/dispatched == finalize/kept_rollouts + finalize/placeholders
  == P * G`.
- `exactness`: every step keeps rows (`finalize/kept_rollouts > 0`), `finalize/token_in_rate == 1.0`
  (every continuation call served from exact parent ids), `finalize/capture_poisoned_rollouts == 0`.
- `multi_turn`: every step's model calls per rollout (the `generation/worker_*/calls` the
  workers served in the step / `rollouts/dispatched`) >= `--min-calls-per-rollout`
  (`MIN_CALLS_PER_ROLLOUT`, 1.5: the tool loop is 2 calls, and most rollouts must make both; a
  sampled policy sometimes answers at once, and while it trains it may do so more often: measured
  1.64-2.00 per step over a 12-step soak).
- `retention`: `retention/staged_keys_remaining`, `retention/ledger_files_remaining` and
  `retention/train_keys_remaining` (the train partition) are 0
  every step (null, "not logged", while the driver does not log them).
- `sampled`: every component of `REQUIRED_COMPONENTS` was sampled with a peak > 0.
- `bounded`: no component of `VERDICT_COMPONENTS` is "growing" (see `growth_verdict`) from the
  peak of step `--base-step` (2: step 1 carries first-use costs — compilation, allocator arenas,
  caches filling) to the peak of the last step; null when the run has no step after the base.
  Defaults `--growth-pct 15 --growth-floor-mib 64`: the measured step-to-step jitter and why they
  fit it are in the Soak section of docs/design-docs/token-capture-reliability.md.

Contract of the pure part (tests/unit/benchmarks/test_soak.py):
- `classify(pid, root_pid, cmdline)`: "driver" for `root_pid`, else the first component of
  `COMPONENT_PATTERNS` one of whose substrings is in `cmdline`, else `OTHER` (Ray's own
  processes: raylet, GCS, dashboard, idle workers, ...).
- `phase_of(t, start, step_ends)`: "startup" before `start` (the first dispatch), the first step
  whose metrics line arrived at or after `t`, "teardown" after the last line.
- `peaks(samples, start, step_ends)`: the largest MiB per component overall, per step (keys are
  step numbers) and in "startup" / "teardown"; `anon_by_step`: the same per step for the
  anonymous part (RSS minus file-backed and shared-memory pages), which says whether a growth is
  heap or mapped files.
- `growth_verdict(base_mib, last_mib, pct, floor_mib)`: growth = last - base; "growing" when it
  exceeds max(pct% of base, floor_mib), else "bounded"; "not sampled" when either is missing.
- `step_accounting(record, expected)`, `retention_figures(record)`, `calls_per_rollout(record)`,
  `summarize(...)`: the per-step figures and the checks above.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_rl.utils.logger import metrics_by_step

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "examples" / "configs" / "grpo_soak_cpu.yaml"
DRIVER_SCRIPT = REPO_ROOT / "examples" / "run_grpo_single_controller.py"
TAG_VAR = "NRL_SOAK_TAG"
TAG_RESCAN_S = 5.0
HEARTBEAT_S = 30.0
LEFTOVER_GRACE_S = 30.0
OTHER = "ray_and_other"
# (component, substrings of the process title / command line); first match wins.
COMPONENT_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("finalizer", ("ray::FinalizerWorker",)),
    ("vllm_worker", ("ray::VllmGenerationWorker",)),
    ("vllm_engine", ("VLLM::",)),  # the engine-core process the worker starts
    ("tq_controller", ("ray::TransferQueueController",)),
    ("tq_storage", ("ray::SimpleStorageUnit",)),
    ("policy", ("ray::PolicyWorker",)),
    ("gym_gate", ("nemo_rl.environments.gate.app", "responses_api_models.")),
    ("gym_agent", ("responses_api_agents.", "nemo_rl.environments.agents.compacting_agent")),
    ("gym_resources", ("examples.arith.resources", "resources_servers.")),
)
COMPONENTS = ("driver", *(name for name, _ in COMPONENT_PATTERNS), OTHER)
REQUIRED_COMPONENTS = (
    "driver", "vllm_worker", "tq_controller", "tq_storage", "finalizer", "policy", "gym_gate", "gym_agent",
    "gym_resources",
)
# Ray's own processes (OTHER) are reported but are not ours to bound.
VERDICT_COMPONENTS = tuple(c for c in COMPONENTS if c != OTHER)
ACCOUNTING_KEYS = ("rollouts/dispatched", "finalize/kept_rollouts", "finalize/placeholders")
RETENTION_KEYS = ("retention/staged_keys_remaining", "retention/ledger_files_remaining", "retention/train_keys_remaining")
EXACTNESS_KEYS = (
    "finalize/token_in_rate", "finalize/capture_poisoned_rollouts", "finalize/calls_per_rollout",
    "finalize/token_in_calls", "finalize/text_root_calls", "token_mult_prob_error", "gen_kl_error",
    "finalize/invalid_row_rate",
)
OTHER_STEP_KEYS = (
    "timing/step_s", "timing/generation_s", "timing/finalize_s", "timing/train_s", "timing/refit_s",
    "reward/mean", "finalize/orphaned_staged_keys", "finalize/dropped_groups", "retention/failures",
)
# The tool loop is 2 model calls; at temperature 1.0 the tiny policy now and then answers without
# the tool (measured: 1 of 64 rollouts in 4 of 5 steps), so a step counts as multi-turn when its
# mean is at least 1.9 (at most ~6 of 64 rollouts answering directly, if none loops longer).
MIN_CALLS_PER_ROLLOUT = 1.5
WORKER_CALLS_PREFIX, WORKER_CALLS_SUFFIX = "generation/worker_", "/calls"
DISPATCH_MARK = "] dispatching "
ECHO_PREFIXES = ("[step", "[stack]", "[grpo]", "[checkpoint]", "[component")


class SoakError(RuntimeError):
    """The soak could not run or summarise (the message names what failed)."""


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the driver started
    mib: Mapping[str, float]  # RSS per component
    procs: Mapping[str, int]  # processes per component
    anon: Mapping[str, float] = field(default_factory=dict)  # of which anonymous (RSS - file-backed - shmem)


# --- the pure part --------------------------------------------------------------------------------


def classify(pid: int, root_pid: int, cmdline: str) -> str:
    if pid == root_pid:
        return "driver"
    for component, patterns in COMPONENT_PATTERNS:
        if any(p in cmdline for p in patterns):
            return component
    return OTHER


def phase_of(t: float, start: float, step_ends: Sequence[tuple[int, float]]) -> int | str:
    """The step a sample at `t` belongs to (see the module docstring); `step_ends` in arrival order."""
    if t < start:
        return "startup"
    for step, end in step_ends:
        if t <= end:
            return step
    return "teardown"


def _max_into(into: dict[str, float], mib: Mapping[str, float]) -> None:
    for component, value in mib.items():
        into[component] = max(into.get(component, 0.0), value)


def peaks(samples: Iterable[Sample], start: float, step_ends: Sequence[tuple[int, float]]) -> dict[str, Any]:
    overall: dict[str, float] = {}
    by_phase: dict[int | str, dict[str, float]] = {}
    anon_by_phase: dict[int | str, dict[str, float]] = {}
    for s in samples:
        phase = phase_of(s.t, start, step_ends)
        _max_into(overall, s.mib)
        _max_into(by_phase.setdefault(phase, {}), s.mib)
        _max_into(anon_by_phase.setdefault(phase, {}), s.anon)
    steps = sorted(k for k in by_phase if isinstance(k, int))
    return {
        "overall": overall,
        "by_step": {k: by_phase[k] for k in steps},
        "anon_by_step": {k: anon_by_phase[k] for k in steps},
        "startup": by_phase.get("startup", {}),
        "teardown": by_phase.get("teardown", {}),
    }


def growth_verdict(base_mib: float | None, last_mib: float | None, pct: float, floor_mib: float) -> dict[str, Any]:
    if base_mib is None or last_mib is None or base_mib <= 0:
        return {"base_mib": base_mib, "last_mib": last_mib, "growth_mib": None, "growth_pct": None,
                "threshold_mib": None, "verdict": "not sampled"}
    growth = last_mib - base_mib
    threshold = max(pct / 100.0 * base_mib, floor_mib)
    return {
        "base_mib": base_mib,
        "last_mib": last_mib,
        "growth_mib": growth,
        "growth_pct": 100.0 * growth / base_mib,
        "threshold_mib": threshold,
        "verdict": "growing" if growth > threshold else "bounded",
    }


def step_accounting(record: Mapping[str, Any], expected: int) -> dict[str, Any]:
    missing = [k for k in ACCOUNTING_KEYS if k not in record]
    if missing:
        raise SoakError(f"metrics.jsonl step {record.get('step')} lacks {missing}")
    dispatched, kept, placeholders = (float(record[k]) for k in ACCOUNTING_KEYS)
    return {
        "rollouts/dispatched": dispatched,
        "finalize/kept_rollouts": kept,
        "finalize/placeholders": placeholders,
        "expected": expected,
        "holds": dispatched == kept + placeholders == expected,
    }


def retention_figures(record: Mapping[str, Any]) -> dict[str, float | None]:
    """The retention metrics of one step; None for a key the driver did not log."""
    return {k: (float(record[k]) if k in record else None) for k in RETENTION_KEYS}


def calls_per_rollout(record: Mapping[str, Any]) -> float | None:
    """Model calls the workers served in the step per dispatched rollout; None if no worker logged calls."""
    calls = [float(v) for k, v in record.items()
             if k.startswith(WORKER_CALLS_PREFIX) and k.endswith(WORKER_CALLS_SUFFIX)]
    dispatched = float(record.get("rollouts/dispatched", 0.0))
    if not calls or dispatched <= 0:
        return None
    return sum(calls) / dispatched


def metrics_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """metrics.jsonl records in step order (`nemo_rl.utils.logger.metrics_by_step`)."""
    return metrics_by_step(lines, SoakError)


def _check(ok: bool | None, detail: str) -> dict[str, Any]:
    return {"ok": ok, "detail": detail}


def summarize(
    samples: Sequence[Sample],
    start: float | None,
    step_ends: Sequence[tuple[int, float]],
    records: Sequence[Mapping[str, Any]],
    *,
    steps: int,
    expected: int,
    base_step: int,
    growth_pct: float,
    growth_floor_mib: float,
    min_calls_per_rollout: float,
) -> dict[str, Any]:
    """Everything soak.json holds apart from the run's own facts (command, duration, processes)."""
    if start is None:
        start = step_ends[0][1] if step_ends else float("inf")
    pk = peaks(samples, start, step_ends)
    per_step: list[dict[str, Any]] = []
    for r in records:
        step = r["step"]
        per_step.append({
            "step": step,
            "accounting": step_accounting(r, expected),
            "retention": retention_figures(r),
            "model_calls_per_rollout": calls_per_rollout(r),
            "exactness": {k: r.get(k) for k in EXACTNESS_KEYS},
            "other": {k: r.get(k) for k in OTHER_STEP_KEYS if k in r},
            "peak_rss_mib": pk["by_step"].get(step, {}),
        })
    logged = [s["step"] for s in per_step]
    last = logged[-1] if logged else None
    growth = {
        c: growth_verdict(pk["by_step"].get(base_step, {}).get(c), pk["by_step"].get(last, {}).get(c) if last else None,
                          growth_pct, growth_floor_mib)
        for c in COMPONENTS if c in pk["overall"]
    }
    for c, g in growth.items():  # where it grew: anonymous memory (heap) or file-backed pages (mmaps)
        base_anon = pk["anon_by_step"].get(base_step, {}).get(c)
        last_anon = pk["anon_by_step"].get(last, {}).get(c) if last else None
        g["anon_growth_mib"] = last_anon - base_anon if base_anon is not None and last_anon is not None else None
    first = logged[0] if logged else None
    first_to_last = {
        c: (pk["by_step"][last].get(c, 0.0) - pk["by_step"][first].get(c, 0.0))
        for c in pk["overall"] if first is not None and first in pk["by_step"] and last in pk["by_step"]
    }

    checks: dict[str, dict[str, Any]] = {}
    checks["steps"] = _check(logged == list(range(1, steps + 1)), f"logged steps {logged}, expected 1..{steps}")
    bad = [s["step"] for s in per_step if not s["accounting"]["holds"]]
    checks["accounting"] = _check(
        bool(per_step) and not bad,
        f"dispatched == kept + placeholders == {expected} " + (f"fails at steps {bad}" if bad else "every step"),
    )
    bad = [s["step"] for s in per_step
           if not (s["accounting"]["finalize/kept_rollouts"] > 0 and s["exactness"]["finalize/token_in_rate"] == 1.0
                   and s["exactness"]["finalize/capture_poisoned_rollouts"] == 0.0)]
    checks["exactness"] = _check(
        bool(per_step) and not bad,
        "kept > 0, token_in_rate == 1.0, capture_poisoned == 0 " + (f"fails at steps {bad}" if bad else "every step"),
    )
    calls = {s["step"]: s["model_calls_per_rollout"] for s in per_step}
    bad = [k for k, v in calls.items() if v is None or v < min_calls_per_rollout]
    checks["multi_turn"] = _check(
        bool(per_step) and not bad, f"model calls per rollout {calls} (need >= {min_calls_per_rollout})"
    )
    unlogged = sorted({k for s in per_step for k, v in s["retention"].items() if v is None})
    nonzero = {s["step"]: {k: v for k, v in s["retention"].items() if v not in (None, 0.0)} for s in per_step}
    nonzero = {k: v for k, v in nonzero.items() if v}
    if nonzero:
        checks["retention"] = _check(False, f"left after retirement: {nonzero}")
    elif unlogged or not per_step:
        checks["retention"] = _check(None, f"not logged: {unlogged or list(RETENTION_KEYS)}")
    else:
        checks["retention"] = _check(True, "staged keys, ledger files and train keys remaining are 0 every step")
    unsampled = [c for c in REQUIRED_COMPONENTS if pk["overall"].get(c, 0.0) <= 0.0]
    checks["sampled"] = _check(not unsampled, f"never sampled: {unsampled}" if unsampled else "every component sampled")
    if last is None or last <= base_step:
        checks["bounded"] = _check(None, f"needs a step after --base-step={base_step} (last logged: {last})")
    else:
        growing = {c: round(g["growth_mib"], 1) for c, g in growth.items()
                   if c in VERDICT_COMPONENTS and g["verdict"] == "growing"}
        unsampled = [c for c in VERDICT_COMPONENTS if c in growth and growth[c]["verdict"] == "not sampled"]
        checks["bounded"] = _check(
            not growing and not unsampled,
            (f"growing (MiB from step {base_step} to {last}): {growing}" if growing else
             f"no component grew beyond max({growth_pct:g}%, {growth_floor_mib:g} MiB) from step {base_step} to {last}")
            + (f"; not sampled in both steps: {unsampled}" if unsampled else ""),
        )
    return {
        "peak_rss_mib": pk["overall"],
        "peak_rss_mib_by_step": {str(k): v for k, v in pk["by_step"].items()},
        "peak_anon_rss_mib_by_step": {str(k): v for k, v in pk["anon_by_step"].items()},
        "peak_rss_mib_startup": pk["startup"],
        "peak_rss_mib_teardown": pk["teardown"],
        "rss_growth_first_to_last_step_mib": first_to_last,
        "growth_base_step": base_step,
        "growth_last_step": last,
        "growth": growth,
        "steps": per_step,
        "checks": checks,
        "passed": all(c["ok"] is not False for c in checks.values()),
    }


# --- the run --------------------------------------------------------------------------------------


def _say(msg: str) -> None:
    print(f"[soak] {msg}", flush=True)


def _fmt_mib(mib: Mapping[str, float]) -> str:
    return ", ".join(f"{c} {mib[c]:.0f}" for c in COMPONENTS if c in mib)


@dataclass
class Observation:
    """What the sampler and the output pump saw (shared between threads; appends only)."""

    t0: float
    samples: list[Sample] = field(default_factory=list)
    dispatched: dict[int, float] = field(default_factory=dict)  # step -> t of its dispatch line
    step_ends: list[tuple[int, float]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    processes: dict[int, dict[str, Any]] = field(default_factory=dict)  # pid -> first seen component/title

    def now(self) -> float:
        return time.monotonic() - self.t0


def _tagged_pids(tag: str) -> set[int]:
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if f"{TAG_VAR}={tag}".encode() in f.read().split(b"\0"):
                    found.add(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone, or not ours
    return found


class Sampler:
    """Samples RSS per component of the run's processes and watches metrics.jsonl, on a thread."""

    def __init__(self, root_pid: int, tag: str, metrics_path: Path, obs: Observation, interval_s: float,
                 expected: int, steps: int) -> None:
        import psutil

        self._psutil = psutil
        self._root_pid = root_pid
        self._tag = tag
        self._metrics_path = metrics_path
        self._obs = obs
        self._interval_s = interval_s
        self._expected = expected
        self._steps = steps
        self._tagged: set[int] = set()
        self._last_rescan = -TAG_RESCAN_S
        self._last_heartbeat = 0.0
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30.0)
        self._poll_metrics()  # the last lines, written just before the driver exited

    def run_pids(self) -> set[int]:
        psutil = self._psutil
        pids = {self._root_pid} | self._tagged
        try:
            pids |= {p.pid for p in psutil.Process(self._root_pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        return pids

    def _sample(self) -> Sample:
        psutil = self._psutil
        now = self._obs.now()
        if now - self._last_rescan >= TAG_RESCAN_S:
            self._tagged = _tagged_pids(self._tag)
            self._last_rescan = now
        mib: dict[str, float] = {}
        anon: dict[str, float] = {}
        procs: dict[str, int] = {}
        for pid in self.run_pids():
            try:
                proc = psutil.Process(pid)
                title = " ".join(proc.cmdline())
                mem = proc.memory_info()  # Linux: `shared` is RssFile + RssShmem (statm), no extra read
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue  # exited between the listing and the read: no memory to count
            component = classify(pid, self._root_pid, title)
            mib[component] = mib.get(component, 0.0) + mem.rss / 2**20
            anon[component] = anon.get(component, 0.0) + (mem.rss - mem.shared) / 2**20
            procs[component] = procs.get(component, 0) + 1
            seen = self._obs.processes.get(pid)
            if seen is None or seen["component"] != component:  # Ray retitles an idle worker as its actor
                self._obs.processes[pid] = {"component": component, "title": title[:160], "first_seen_s": round(now, 1),
                                            "create_time": proc.create_time()}
        return Sample(t=now, mib=mib, procs=procs, anon=anon)

    def _poll_metrics(self) -> None:
        if not self._metrics_path.exists():
            return
        with self._metrics_path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # whole lines only: the driver may be appending
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            t = self._obs.now()
            self._obs.records.append(record)
            self._obs.step_ends.append((int(record["step"]), t))
            self._report_step(record, t)

    def _report_step(self, record: Mapping[str, Any], t: float) -> None:
        step = int(record["step"])
        start = self._obs.dispatched.get(step, self._obs.step_ends[-2][1] if len(self._obs.step_ends) > 1 else t)
        peak: dict[str, float] = {}
        for s in self._obs.samples:
            if s.t >= start:
                _max_into(peak, s.mib)
        acc = step_accounting(record, self._expected)
        ret = retention_figures(record)
        shown = ", ".join(f"{k.split('/')[1]} {'not logged' if v is None else f'{v:g}'}" for k, v in ret.items())
        _say(
            f"step {step} logged at {t:.0f}s ({float(record.get('timing/step_s', 0.0)):.0f}s): dispatched "
            f"{acc['rollouts/dispatched']:g} = kept {acc['finalize/kept_rollouts']:g} + placeholders "
            f"{acc['finalize/placeholders']:g} ({'holds' if acc['holds'] else 'DOES NOT HOLD'}); calls/rollout "
            f"{calls_per_rollout(record)}; retention: {shown}; step peak RSS MiB: {_fmt_mib(peak)}"
        )

    def _run(self) -> None:
        try:
            while True:
                sample = self._sample()
                self._obs.samples.append(sample)
                self._poll_metrics()
                if sample.t - self._last_heartbeat >= HEARTBEAT_S:
                    self._last_heartbeat = sample.t
                    done = len(self._obs.step_ends)
                    phase = ("startup" if not self._obs.dispatched
                             else "teardown" if done >= self._steps else f"step {done + 1}")
                    _say(f"{sample.t:.0f}s [{phase}] {sum(sample.procs.values())} processes; "
                         f"RSS MiB: {_fmt_mib(sample.mib)}")
                if self._stop.wait(self._interval_s):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
            self.error = e


def _pump(stream: Any, log_path: Path, obs: Observation) -> None:
    with log_path.open("w") as log:
        for line in stream:
            log.write(line)
            log.flush()
            if line.startswith("[step ") and DISPATCH_MARK in line:
                obs.dispatched.setdefault(int(line[len("[step "):line.index("]")]), obs.now())
            if line.startswith(ECHO_PREFIXES) or "Error" in line:
                print(f"  | {line.rstrip()}", flush=True)


def _alive(psutil: Any, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _reap_leftovers(psutil: Any, tag: str, known: Mapping[int, float], grace_s: float) -> list[str]:
    """Processes of this run still alive `grace_s` after the driver exited: SIGKILLed by pid, listed."""
    end = time.monotonic() + grace_s
    while True:
        left = {pid for pid in _tagged_pids(tag) | set(known) if _alive(psutil, pid)}
        # A pid seen during the run may have been reused since: only the same process (start time) counts.
        left = {pid for pid in left if pid not in known or _create_time(psutil, pid) == known[pid]}
        if not left or time.monotonic() > end:
            break
        time.sleep(0.5)
    killed = []
    for pid in sorted(left):
        try:
            proc = psutil.Process(pid)
            killed.append(f"{pid}: {' '.join(proc.cmdline())[:120]}")
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    return killed


def _create_time(psutil: Any, pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def driver_command(args: argparse.Namespace, log_dir: Path) -> list[str]:
    command = [
        sys.executable, str(DRIVER_SCRIPT), "--config", str(args.config),
        "token_capture.enabled=true",
        f"grpo.max_num_steps={args.steps}",
        f"grpo.num_prompts_per_step={args.prompts}",
        f"grpo.num_generations_per_prompt={args.generations}",
        f"logger.log_dir={log_dir}",
    ]
    if args.max_tokens is not None:
        command += [f"grpo.max_output_tokens={args.max_tokens}", f"generation.max_new_tokens={args.max_tokens}"]
    return command + list(args.overrides)


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    import psutil

    out: Path = args.out
    log_dir = out / "logs"
    if log_dir.exists():
        raise SoakError(f"{log_dir} exists: the driver appends to metrics.jsonl, so a reused --out would mix runs "
                        "(fix: a new --out, or remove it)")
    out.mkdir(parents=True, exist_ok=True)
    command = driver_command(args, log_dir)
    expected = args.prompts * args.generations
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", TAG_VAR: tag}
    _say(f"{args.steps} steps x {args.prompts} prompts x {args.generations} generations = {expected} rollouts in "
         f"flight per step; RSS every {args.interval_s}s; driver: {' '.join(command[1:])}")
    obs = Observation(t0=time.monotonic())
    proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    sampler = Sampler(proc.pid, tag, log_dir / "metrics.jsonl", obs, args.interval_s, expected, args.steps)
    sampler.start()
    pump = threading.Thread(target=_pump, args=(proc.stdout, out / "driver.log", obs), daemon=True)
    pump.start()
    failure: str | None = None
    known: dict[int, float] = {}
    try:
        code = proc.wait(timeout=args.timeout_s)
        if code != 0:
            failure = f"the driver exited with status {code}; see {out / 'driver.log'}"
    except subprocess.TimeoutExpired:
        failure = f"the driver did not finish within --timeout-s={args.timeout_s:g}; SIGTERM, then SIGKILL"
        _say(failure)
        proc.send_signal(signal.SIGTERM)  # run_grpo's teardown stops what it started
        try:
            proc.wait(timeout=120.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30.0)
    finally:
        known = {pid: info["create_time"] for pid, info in obs.processes.items() if pid != proc.pid}
        sampler.stop()
        pump.join(timeout=30.0)
    if sampler.error is not None:
        raise SoakError(f"the RSS sampler failed: {sampler.error!r}") from sampler.error
    wall_s = obs.now()
    leftovers = _reap_leftovers(psutil, tag, known, LEFTOVER_GRACE_S)
    if leftovers:
        _say(f"{len(leftovers)} process(es) of the run outlived the driver by {LEFTOVER_GRACE_S:g}s; "
             f"SIGKILLed: {leftovers}")

    records = metrics_records(json.dumps(r) for r in obs.records)
    first_dispatch = min(obs.dispatched.values(), default=None)
    summary = summarize(
        obs.samples, first_dispatch, obs.step_ends, records, steps=args.steps, expected=expected,
        base_step=args.base_step, growth_pct=args.growth_pct, growth_floor_mib=args.growth_floor_mib,
        min_calls_per_rollout=args.min_calls_per_rollout,
    )
    step_times = [float(r.get("timing/step_s", 0.0)) for r in records]
    soak = {
        "command": command,
        "config": str(args.config),
        "steps_requested": args.steps,
        "rollouts_per_step": expected,
        "prompts": args.prompts,
        "generations": args.generations,
        "interval_s": args.interval_s,
        "growth_pct": args.growth_pct,
        "growth_floor_mib": args.growth_floor_mib,
        "wall_s": wall_s,
        "startup_s": first_dispatch,
        "step_s": step_times,
        "samples": len(obs.samples),
        "driver_failure": failure,
        "leftover_processes_killed": leftovers,
        "processes": {str(pid): info for pid, info in sorted(obs.processes.items())},
        "load_average": list(os.getloadavg()),
        **summary,
    }
    with (out / "samples.jsonl").open("w") as f:
        for s in obs.samples:
            f.write(json.dumps({"t": round(s.t, 2), "mib": {k: round(v, 1) for k, v in s.mib.items()},
                                "anon_mib": {k: round(v, 1) for k, v in s.anon.items()},
                                "procs": dict(s.procs)}) + "\n")
    (out / "soak.json").write_text(json.dumps(soak, indent=1, sort_keys=True))
    write_report(out / "report.md", soak)
    return soak


def _n(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def write_report(path: Path, soak: Mapping[str, Any]) -> None:
    steps = soak["steps"]
    lines = [
        "# Soak",
        "",
        f"`{' '.join(Path(soak['command'][0]).name if i == 0 else a for i, a in enumerate(soak['command']))}`",
        "",
        f"{soak['rollouts_per_step']} rollouts in flight per step ({soak['prompts']} prompts x {soak['generations']} "
        f"generations), {len(steps)} of {soak['steps_requested']} steps logged; wall {soak['wall_s']:.0f} s "
        f"(start-up {_n(soak['startup_s'])} s, steps {', '.join(f'{s:.0f}' for s in soak['step_s'])} s); "
        f"{soak['samples']} RSS samples every {soak['interval_s']} s; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in soak['load_average'])}.",
        "",
        f"**Verdict: {'PASSED' if soak['passed'] else 'FAILED'}**" + (f" (run failure: {soak['driver_failure']})"
                                                                     if soak["driver_failure"] else ""),
        "",
        "| Check | Result | Detail |",
        "|---|---|---|",
    ]
    for name, c in soak["checks"].items():
        result = {True: "ok", False: "FAILED", None: "not logged"}[c["ok"]]
        lines.append(f"| {name} | {result} | {c['detail']} |")
    by_step = soak["peak_rss_mib_by_step"]
    step_keys = [str(s["step"]) for s in steps]
    lines += [
        "",
        f"## Peak RSS per component (MiB; summed over the component's processes)",
        "",
        f"Growth and verdict: step {soak['growth_base_step']} peak to step {_n(soak['growth_last_step'])} peak; "
        f"\"growing\" above max({soak['growth_pct']:g}% of the base, {soak['growth_floor_mib']:g} MiB).",
        "",
        "| Component | Start-up | " + " | ".join(f"Step {k}" for k in step_keys)
        + " | Overall | Growth | of which anon | Verdict |",
        "|---|---:|" + "---:|" * len(step_keys) + "---:|---:|---:|---|",
    ]
    for c in COMPONENTS:
        if c not in soak["peak_rss_mib"]:
            continue
        g = soak["growth"].get(c, {})
        growth = (f"{g['growth_mib']:+.0f} ({g['growth_pct']:+.1f}%)" if g.get("growth_mib") is not None else "-")
        lines.append(
            f"| {c} | {_n(soak['peak_rss_mib_startup'].get(c))} | "
            + " | ".join(_n(by_step.get(k, {}).get(c)) for k in step_keys)
            + f" | {_n(soak['peak_rss_mib'][c])} | {growth} | {_n(g.get('anon_growth_mib'))} | "
            f"{g.get('verdict', '-')} |"
        )
    lines += [
        "",
        "## Per step",
        "",
        "| Step | Dispatched | Kept | Placeholders | Holds | Calls/rollout | token_in_rate | Staged keys left | "
        "Ledger files left | Train keys left | step_s |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in steps:
        a, r = s["accounting"], s["retention"]
        lines.append(
            f"| {s['step']} | {a['rollouts/dispatched']:g} | {a['finalize/kept_rollouts']:g} | "
            f"{a['finalize/placeholders']:g} | {'yes' if a['holds'] else 'NO'} | "
            f"{_n(s['model_calls_per_rollout'], 2)} | "
            f"{_n(s['exactness']['finalize/token_in_rate'], 3)} | "
            + " | ".join("not logged" if r[k] is None else f"{r[k]:g}" for k in RETENTION_KEYS)
            + f" | {_n(s['other'].get('timing/step_s'), 1)} |"
        )
    if soak["leftover_processes_killed"]:
        lines += ["", "Processes that outlived the driver (SIGKILLed by pid):", ""]
        lines += [f"- `{p}`" for p in soak["leftover_processes_killed"]]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (its logs/ must not exist)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8, help="groups per step (grpo.num_prompts_per_step)")
    p.add_argument("--generations", type=int, default=8, help="rollouts per group (grpo.num_generations_per_prompt)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--max-tokens", type=int, default=None, help="grpo.max_output_tokens and generation.max_new_tokens")
    p.add_argument("--interval-s", type=float, default=0.5)
    p.add_argument("--base-step", type=int, default=2, help="growth is measured from this step's peak to the last's")
    p.add_argument("--growth-pct", type=float, default=15.0)
    p.add_argument("--growth-floor-mib", type=float, default=64.0)
    p.add_argument("--min-calls-per-rollout", type=float, default=MIN_CALLS_PER_ROLLOUT)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("overrides", nargs="*", help="key=value overrides passed to the driver")
    args = p.parse_args(argv)
    for name in ("steps", "prompts", "generations", "base_step"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.interval_s <= 0 or args.timeout_s <= 0:
        p.error("--interval-s and --timeout-s must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        soak = run_soak(args)
    except SoakError as e:
        print(f"[soak] error: {e}", file=sys.stderr)
        return 2
    failed = [name for name, c in soak["checks"].items() if c["ok"] is False]
    _say(f"peak RSS MiB: {_fmt_mib(soak['peak_rss_mib'])}")
    for name, c in soak["checks"].items():
        _say(f"check {name}: {({True: 'ok', False: 'FAILED', None: 'not logged'})[c['ok']]} - {c['detail']}")
    _say(f"wrote {args.out / 'soak.json'} and {args.out / 'report.md'} ({soak['wall_s']:.0f}s)")
    if soak["driver_failure"]:
        print(f"[soak] error: {soak['driver_failure']}", file=sys.stderr)
        return 2
    if failed:
        print(f"[soak] error: checks failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
