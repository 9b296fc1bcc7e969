"""What capture costs and what it buys: the same recipe with token capture on and off, side by side.

    uv run python benchmarks/capture_ab.py --out DIR [--steps N] [--group-size N] [--repeats N]
        [--turns 2,8,32,64] [--finalizers N] [--config YAML] [--arm-timeout-s S]
        [--skip-ab] [--skip-synthetic] [--summarize-only] [key=value ...]

Defaults (6 steps, the first a warm-up; group size 4; 2 repeats) take 6-7 minutes on 2 quiet cores.

Two parts, each in child processes of this one (this process only orchestrates, samples memory
and summarises):

1. A/B on the real stack. For each repeat, the recipe (default
   `examples/configs/grpo_capture_tiny_cpu.yaml`) runs once with `token_capture.enabled=true` and
   once with `false`, interleaved ABBA (capture first on even repeats, legacy first on odd ones) so
   that drift in the machine's load hits both arms alike. Each arm is a child
   `capture_ab.py --arm MODE` that runs `run_grpo` unchanged, with `NRL_INSTRUMENTATION` naming
   `benchmarks/wire_metrics.py` and `NRL_WIRE_METRICS_DIR` set, so the Gym servers and the vLLM
   worker count HTTP body bytes and per-call capture time. The child wraps `build_train_batch`
   to keep a reference to each step's `TrainBatch` or `TrainPlan` and the groups it came from
   (no copy, no work inside the step) and, after the run, counts trained tokens, checks every trained row for
   re-tokenization drift (`audit.retokenization_drift`) and measures the row bytes that went
   through the driver (pickled groups + what it sent the policy worker). Rows that went through
   the train partition never reach the driver: the child reads each plan's rows back with
   `partitions.read_train_batch` right before the step's retention clears them (one TQ get per
   step, after the train phase; it counts in `step_s`).
   Why children rather than in-process runs: every arm then pays the same imports, a hang is
   bounded by `--arm-timeout-s` and killed by process group without touching the next arm, and
   peak RSS of the driver is the arm's own (a Python process never returns freed memory).
   While a child runs, this process samples RSS of the child's whole process tree every
   `RSS_INTERVAL_S` and sums it per role (`ROLE_PATTERNS`): the peak over the arm, the peak
   divided by the rollouts in flight (all of a step's rollouts run concurrently), and the growth
   from the first measured step's dispatch to the peak after it (what the steady state adds).
2. Synthetic, through the real components (a child `capture_ab.py --synthetic`): a private Ray,
   the TransferQueue data plane, `TQTokenSink` driven by Gym's worker-side capture core,
   NeMo-Gym's custody ledger as our gate installs it (`BranchingCaptureLedger`, real files), and
   the `FinalizerPool` over TQ. The tiny model stops after ~2 calls per rollout, so scaling with
   turns (2, 8, 32, 64 calls of `SYN_TAIL + SYN_GEN` tokens each) and finalizer throughput (rows
   of 1k, 4k, 16k tokens) are measured here, plus retention time as the partition fills.
   `finalize_time_per_token_growth` uses the judge's own time per token (verify + linearize in
   one process, no fetch and no Ray call): the fixed per-rollout costs of a fetch and an actor
   call would otherwise make any rollout look cheaper per token the longer it is.

Outputs: `DIR/results.json` (every figure; the top-level numeric keys `TOP_LEVEL_KEYS`),
`DIR/report.md` (tables) and PNG plots; per arm `DIR/arms/<mode>_r<k>/` (metrics.jsonl, the
wire files, the child's log, `run.json` with its wall time and RSS), and `DIR/synthetic/`.
`--summarize-only` rebuilds the three outputs from those folders without running anything
(pass the options of the run that wrote them). Progress goes to stderr. Nothing is asserted with a timer: the
issue's targets are printed beside the figures. Not part of the unit lane (the pure summary
functions are: tests/unit/benchmarks/test_capture_ab.py).

Contract of the pure part:
- `spread(values)` = {median, min, max, n}; an empty list is a `BenchError`.
- `ratio(a, b)` = a / b, a `BenchError` when b is 0 (a ratio to nothing is no figure).
- `percentile(values, q)`: nearest rank, the smallest value with at least q% of values <= it.
- `growth(by_turns)`: value at the largest turn count / value at the smallest (1.0 = flat).
- `metrics_records(lines)`: metrics.jsonl records in step order (a repeated step is an error).
- `step_phases(records, skip_steps)`: per phase key of `PHASES`, the per-step values, leaving
  out the first `skip_steps` logged steps (warm-up).
- `http_links(files, gate_role)`: body bytes per link (`LINKS`) from the wire files of one arm.
- `route_times_ms(files, gate_role)`: mean server-side ms per request of each `ROUTE_TIMES` route.
- `call_costs(samples)`: capture's added time per worker chat call (`begin_call_s` +
  `prefix_fetch_s` + `commit_s` + `prefix_seed_s`) against the rest of the call (`total_s` - added), p50/p99;
  each part's own p50/p99 is over the calls that report it (prefix fetches: token-in calls that fetched).
- `summarize_ab(arms)` / `top_level(ab, synthetic)`: spreads over repeats, capture/legacy ratios
  of the medians, and the `TOP_LEVEL_KEYS` (None for a part that was skipped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rl.utils.child_process import wait_for_group
from nemo_rl.utils.logger import metrics_by_step

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "examples" / "configs" / "grpo_capture_tiny_cpu.yaml"
MODES = ("capture", "legacy")
PHASES = ("timing/step_s", "timing/generation_s", "timing/finalize_s", "timing/train_s", "timing/refit_s")
EXACTNESS_KEYS = ("token_mult_prob_error", "gen_kl_error")
# Links between the processes, by which server counted the bodies (see `http_links`).
LINKS = ("agent_gate", "gate_worker", "driver_agent", "driver_gate_control", "agent_resources", "agent_internal")
HEADLINE_LINKS = ("agent_gate", "gate_worker")
STAGE_WRITER_COUNTERS = ("stage_write_rows", "stage_write_batches", "stage_write_s", "stage_flushes",
                         "stage_flush_wait_s")
CALL_COST_PARTS = ("begin_call_s", "parent_wait_s", "prefix_fetch_s", "commit_s", "stage_s", "prefix_seed_s",
                   "generate_s")
# generate_s is the engine's part of the call (both paths): the rest minus it is rendering and parsing.
# stage_s is inside commit_s; parent_wait_s is a child's wait for its parents' rows (write-behind staging).
ADDED_PARTS = ("begin_call_s", "parent_wait_s", "prefix_fetch_s", "commit_s", "prefix_seed_s")
# results.json top level: step_s median capture/legacy; headline HTTP bytes per trained token
# capture/legacy; added worker time per call / the rest of the call, p50 (capture arms);
# token_mult_prob_error per path; capture rows whose ids differ from their re-tokenized text;
# finalizer rows/s per actor at HEADLINE_ROW_SIZE tokens; ledger bytes per call and judge time per
# token at the largest turn count over the smallest.
TOP_LEVEL_KEYS = (
    "step_time_ratio",
    "http_bytes_per_trained_token_ratio",
    "added_call_latency_fraction_p50",
    "token_mult_prob_error_capture",
    "token_mult_prob_error_legacy",
    "retokenization_mismatch_fraction",
    "finalizer_rows_per_s",
    "ledger_bytes_per_call_growth",
    "finalize_time_per_token_growth",
)
TARGETS = {
    "step_time_ratio": "<= 0.85",
    "http_bytes_per_trained_token_ratio": "<= 0.5",
    "added_call_latency_fraction_p50": "<= 0.02",
    "ledger_bytes_per_call_growth": "~1.0 (flat)",
    "finalize_time_per_token_growth": "~1.0 (flat)",
}
# Server-side time per request reported for these `<server>:<route>` (see `route_times_ms`).
ROUTE_TIMES = ("agent:run", "gate:model", "gate:control", "worker:model", "worker:tokenize", "resources:verify")
# The library's instrumentation seam (nemo_rl/utils/instrumentation.py) loads this hook module in
# every process of an arm; the hook module writes into NRL_WIRE_METRICS_DIR.
INSTRUMENTATION_ENV = "NRL_INSTRUMENTATION"
WIRE_METRICS_MODULE = "benchmarks.wire_metrics"
WIRE_METRICS_DIR_ENV = "NRL_WIRE_METRICS_DIR"
GATE_ROLE = "policy_model"  # the gate's Gym config key (nemo_gym_launch.GATE)
WORKER_ROLE = "worker"
RSS_INTERVAL_S = 0.5
# (role, substring of the process's command line); first match wins; the arm's own pid is "driver".
ROLE_PATTERNS = (
    ("finalizer", "ray::FinalizerWorker"),
    ("worker", "ray::VllmGenerationWorker"),
    ("worker_engine", "VLLM::EngineCore"),
    ("tq", "ray::TransferQueueController"),
    ("tq", "ray::SimpleStorageUnit"),
    ("policy", "ray::PolicyWorker"),
    ("gym_servers", "responses_api_"),
    ("gym_servers", "nemo_rl.environments."),
    ("gym_servers", "benchmarks.wire_metrics"),
)
SYNTHETIC_MARK = "[synthetic] data plane, ledger and finalizer pool up"
SYN_TAIL, SYN_GEN = 24, 24  # tokens per synthetic call: rendered tail + generated
SYN_ROLLOUTS_PER_TURNS = 6
SYN_WARMUP_ROLLOUTS = 8
ROW_SIZES = (1024, 4096, 16384)
ROWS_PER_SIZE = {1024: 32, 4096: 16, 16384: 8}
HEADLINE_ROW_SIZE = 4096
RETENTION_BACKGROUND_KEYS = (0, 2000, 10000)
RETENTION_GROUPS_PER_LEVEL = 5


class BenchError(RuntimeError):
    """The benchmark cannot produce a figure (a failed arm, missing data, a ratio to nothing)."""


# --- pure summaries (unit-tested) ----------------------------------------------------------------


def spread(values: Iterable[float]) -> dict[str, float]:
    data = [float(v) for v in values]
    if not data:
        raise BenchError("no values to summarise")
    return {"median": statistics.median(data), "min": min(data), "max": max(data), "n": len(data)}


def ratio(numerator: float, denominator: float) -> float:
    if denominator == 0:
        raise BenchError(f"ratio {numerator} / 0: the denominator arm measured nothing")
    return numerator / denominator


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value v with at least q% of the values <= v."""
    if not values:
        raise BenchError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"q={q}: must be in (0, 100]")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def growth(by_turns: Mapping[int, float]) -> float:
    """Value at the largest turn count over the value at the smallest (1.0 = flat per call)."""
    if len(by_turns) < 2:
        raise BenchError(f"growth needs at least two turn counts, got {sorted(by_turns)}")
    return ratio(by_turns[max(by_turns)], by_turns[min(by_turns)])


def metrics_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """metrics.jsonl records in step order (`nemo_rl.utils.logger.metrics_by_step`)."""
    return metrics_by_step(lines, BenchError)


def step_phases(records: Sequence[Mapping[str, Any]], skip_steps: int) -> dict[str, list[float]]:
    """Per phase, the values of the logged steps after the first `skip_steps` (steps lacking a key skip it)."""
    kept = list(records)[skip_steps:]
    return {phase: [float(r[phase]) for r in kept if phase in r] for phase in PHASES}


def http_links(files: Sequence[Mapping[str, Any]], gate_role: str = GATE_ROLE) -> dict[str, int]:
    """Request + response body bytes per link (`LINKS`) from one arm's wire files.

    The gate's model routes are agent <-> gate and its control routes driver <-> gate (manifests);
    the worker's routes (except control and health) are gate <-> worker; an agent is the server
    that answered `run` (driver <-> agent; its other routes, e.g. Gym's simple_agent calling its own
    `/v1/responses` from `/run`, are agent_internal); every other server is a resources server
    (agent <-> resources). Health probes are never counted.
    """
    links = dict.fromkeys(LINKS, 0)
    for wire in files:
        role, http = wire["role"], wire["http"]

        def body(route: str) -> int:
            entry = http[route]
            return int(entry["request_bytes"]) + int(entry["response_bytes"])

        if role == WORKER_ROLE:
            links["gate_worker"] += sum(body(r) for r in http if r not in ("control", "health"))
        elif role == gate_role:
            links["agent_gate"] += sum(body(r) for r in http if r not in ("control", "health"))
            links["driver_gate_control"] += body("control") if "control" in http else 0
        elif "run" in http:
            links["driver_agent"] += body("run")
            links["agent_internal"] += sum(body(r) for r in http if r not in ("run", "health"))
        else:
            links["agent_resources"] += sum(body(r) for r in http if r != "health")
    return links


def route_times_ms(files: Sequence[Mapping[str, Any]], gate_role: str = GATE_ROLE) -> dict[str, float]:
    """Mean server-side handling time per request (ms) of each `<server>:<route>` in `ROUTE_TIMES`."""
    totals: dict[str, list[float]] = {}
    for wire in files:
        fallback = "agent" if "run" in wire["http"] else "resources"
        server = {WORKER_ROLE: "worker", gate_role: "gate"}.get(wire["role"], fallback)
        for route, entry in wire["http"].items():
            name = f"{server}:{route}"
            if name in ROUTE_TIMES:
                acc = totals.setdefault(name, [0.0, 0.0])
                acc[0] += float(entry.get("seconds", 0.0))
                acc[1] += int(entry["requests"])
    return {name: 1000.0 * seconds / count for name, (seconds, count) in totals.items() if count}


def call_costs(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Capture's added time per successful worker chat call, absolute and as a fraction of the rest.

    added = begin_call_s + parent_wait_s + prefix_fetch_s + commit_s + prefix_seed_s (commit includes
    the staging write or its queueing, stage_s; a token-in call waits for its parents' rows under
    write-behind staging; the seed enters the staged delta into the worker's prefix cache);
    the rest of the call (total_s - added) is generation plus rendering and parsing.
    """
    ok = [s for s in samples if int(s.get("status", 0)) == 200]
    if not ok:
        raise BenchError("no successful worker chat call was sampled")
    added = [sum(float(s.get(p, 0.0)) for p in ADDED_PARTS) for s in ok]
    rest = [float(s["total_s"]) - a for s, a in zip(ok, added)]
    if min(rest) <= 0:
        raise BenchError("a call's capture time is not below its total time; the samples are inconsistent")
    fractions = [a / r for a, r in zip(added, rest)]
    out: dict[str, Any] = {
        "calls": len(ok),
        "added_ms_p50": 1000.0 * percentile(added, 50),
        "added_ms_p99": 1000.0 * percentile(added, 99),
        "fraction_p50": percentile(fractions, 50),
        "fraction_p99": percentile(fractions, 99),
        "rest_ms_p50": 1000.0 * percentile(rest, 50),
    }
    generate = [float(s.get("generate_s", 0.0)) for s in ok]
    out["render_parse_ms_p50"] = 1000.0 * percentile([r - g for r, g in zip(rest, generate)], 50)
    for part in CALL_COST_PARTS:
        # Over the calls that have the part (a prefix fetch happens on token-in calls only); 0 when none.
        values = [float(s[part]) for s in ok if part in s] or [0.0]
        out[f"{part[:-2]}_ms_p50"] = 1000.0 * percentile(values, 50)
        out[f"{part[:-2]}_ms_p99"] = 1000.0 * percentile(values, 99)
        out[f"{part[:-2]}_calls"] = sum(part in s for s in ok)
    return out


def _union_s(intervals: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def engine_load(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How busy the engine was, from the calls' generate intervals (per worker process, then summed).

    busy_s: wall time with at least one generation in the engine; in_flight of a call: the
    time-averaged number of generations in the engine during it (itself included), so a call's
    engine time can be compared at equal load; tokens_per_busy_s: generated tokens per busy second.
    The same tokens per busy second with a longer engine time per call means the calls overlapped
    more (the engine batched them), not that the engine ran slower.
    """
    timed = [s for s in samples if int(s.get("status", 0)) == 200 and "generate_t0_s" in s]
    if not timed:
        return {}
    by_worker: dict[Any, list[Mapping[str, Any]]] = {}
    for s in timed:
        by_worker.setdefault(s.get("worker_pid"), []).append(s)
    busy = 0.0
    in_flight: list[tuple[float, float]] = []  # (in_flight, generate_s) per call
    for calls in by_worker.values():
        spans = [(float(c["generate_t0_s"]), float(c["generate_t0_s"]) + float(c["generate_s"])) for c in calls]
        busy += _union_s(spans)
        for start, stop in spans:
            length = stop - start
            overlap = sum(max(0.0, min(stop, b) - max(start, a)) for a, b in spans)
            in_flight.append((overlap / length if length > 0 else 1.0, length))
    tokens = sum(int(s.get("generated_tokens", 0)) for s in timed)
    by_load: dict[str, list[float]] = {}
    for load, seconds in in_flight:
        by_load.setdefault("1" if load < 1.5 else "2" if load < 2.5 else "3-4" if load < 4.5 else "5+", []).append(seconds)
    return {
        "calls": len(timed),
        "busy_s": busy,
        "generated_tokens": tokens,
        "prompt_tokens_p50": percentile([float(s.get("prompt_tokens", 0)) for s in timed], 50),
        "generated_tokens_p50": percentile([float(s.get("generated_tokens", 0)) for s in timed], 50),
        "tokens_per_busy_s": tokens / busy if busy > 0 else None,
        "in_flight_mean": statistics.fmean(load for load, _ in in_flight),
        "generate_ms_p50_by_in_flight": {k: {"calls": len(v), "ms_p50": 1000.0 * percentile(v, 50)}
                                         for k, v in sorted(by_load.items())},
    }


# --- the A/B arms ---------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[capture_ab] {msg}", file=sys.stderr, flush=True)


def classify(pid: int, root_pid: int, cmdline: str) -> str:
    if pid == root_pid:
        return "driver"
    for role, pattern in ROLE_PATTERNS:
        if pattern in cmdline:
            return role
    return "ray_system"


class RssSampler:
    """Samples a process tree per role on a thread: RSS peaks, the RSS snapshot at a mark and the peak
    after it, and CPU seconds (user + system) per role at the mark and at an end mark.

    CPU per role is the sum over its processes of the last CPU time seen for each pid, so a process
    that exited still counts what it used up to its last sample (at most `RSS_INTERVAL_S` is lost).
    """

    def __init__(self, root_pid: int) -> None:
        import psutil

        self._psutil = psutil
        self._root = psutil.Process(root_pid)
        self.peak: dict[str, float] = {}
        self.at_mark: dict[str, float] | None = None
        self.peak_after_mark: dict[str, float] = {}
        self.cpu_at_mark: dict[str, float] | None = None
        self.cpu_at_end: dict[str, float] | None = None
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds when last seen)
        self._mark = threading.Event()
        self._end = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def sample(self) -> dict[str, float]:
        psutil = self._psutil
        totals: dict[str, float] = {}
        try:
            procs = [self._root, *self._root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return totals
        for proc in procs:
            try:
                # A process that exited between the listing and this read has no memory to count.
                role = classify(proc.pid, self._root.pid, " ".join(proc.cmdline()))
                totals[role] = totals.get(role, 0.0) + proc.memory_info().rss / 2**20
                cpu = proc.cpu_times()
                self._cpu[proc.pid] = (role, cpu.user + cpu.system)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
        return totals

    def cpu_by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, seconds in self._cpu.values():
            out[role] = out.get(role, 0.0) + seconds
        return out

    def _run(self) -> None:
        while not self._stop.wait(RSS_INTERVAL_S):
            totals = self.sample()
            if self._mark.is_set() and self.at_mark is None:
                self.at_mark = totals
                self.cpu_at_mark = self.cpu_by_role()
            if self._end.is_set() and self.cpu_at_end is None:
                self.cpu_at_end = self.cpu_by_role()
            for role, mib in totals.items():
                self.peak[role] = max(self.peak.get(role, 0.0), mib)
                if self.at_mark is not None:
                    self.peak_after_mark[role] = max(self.peak_after_mark.get(role, 0.0), mib)

    def start(self) -> None:
        self._thread.start()

    def mark(self) -> None:
        self._mark.set()

    def end(self) -> None:
        self._end.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)


def _run_child(argv: list[str], log_path: Path, env: Mapping[str, str], timeout_s: float, tag: str,
               mark: str | None = None, end_mark: str | None = None) -> dict[str, Any]:
    """Run a child in its own session, tee its stderr, sample its tree's RSS; killed by group at the deadline.

    `mark`: a stderr line containing it marks the start of the measured part (`first_step_s`);
    `end_mark`: one containing it, its end (the CPU snapshot before teardown).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *argv], cwd=REPO_ROOT, env=dict(env),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        sampler = RssSampler(proc.pid)
        sampler.start()
        first_step_s: float | None = None

        def pump() -> None:
            nonlocal first_step_s
            assert proc.stderr is not None
            for line in proc.stderr:
                log.write(line)
                log.flush()
                if mark is not None and mark in line and first_step_s is None:
                    first_step_s = time.monotonic() - started
                    sampler.mark()
                if end_mark is not None and end_mark in line:
                    sampler.end()
                if line.startswith(("[step", "[stack]", "[capture_ab", "[synthetic")) or "Error" in line:
                    print(f"[{tag}] {line.rstrip()}", file=sys.stderr, flush=True)

        try:
            wait_for_group(proc, timeout_s, tag, log_path, BenchError, _log, pump)
        finally:
            sampler.stop()
    run = {
        "wall_s": time.monotonic() - started,
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "first_step_s": first_step_s,
        "rss_peak_mib": sampler.peak,
        "rss_at_mark_mib": sampler.at_mark or {},
        "rss_peak_after_mark_mib": sampler.peak_after_mark,
        "cpu_s_at_mark": sampler.cpu_at_mark or {},
        "cpu_s_at_end": sampler.cpu_at_end or {},
    }
    # Kept beside the child's outputs, so --summarize-only can rebuild the summary without rerunning.
    (log_path.parent / "run.json").write_text(json.dumps(run, indent=1))
    return run


def _load_json(path: Path) -> Any:
    if not path.exists():
        raise BenchError(f"{path} is missing")
    return json.loads(path.read_text())


def cpu_per_step(at_mark: Mapping[str, float], at_end: Mapping[str, float], steps: int) -> dict[str, float]:
    """CPU seconds per role per measured step (a role born after the mark counts from 0); {} when unmeasured.

    The window runs from the first measured step's dispatch to the last step's training (the last
    stderr line before the logger's step line, which goes to stdout), so it holds every measured
    step's generation and finalize phases and all but the last one's train and refit."""
    if not at_end or steps <= 0:
        return {}
    return {role: (at_end[role] - at_mark.get(role, 0.0)) / steps for role in sorted(at_end)}


def arm_summary(arm_dir: Path, run: Mapping[str, Any], skip_steps: int, in_flight: int) -> dict[str, Any]:
    """Everything one arm measured (reads its metrics, wire files and the child's arm.json)."""
    records = metrics_records((arm_dir / "log" / "metrics.jsonl").read_text().splitlines())
    if len(records) <= skip_steps:
        raise BenchError(f"{arm_dir}: {len(records)} logged steps, need more than --skip-steps={skip_steps}")
    phases = step_phases(records, skip_steps)
    arm = _load_json(arm_dir / "arm.json")
    wires = [json.loads(p.read_text()) for p in sorted((arm_dir / "wire").glob("*.json"))]
    links = http_links(wires)
    worker_calls = [{**c, "worker_pid": w["pid"]} for w in wires if w["role"] == WORKER_ROLE for c in w["calls"]]
    counters: dict[str, float] = {}
    for w in wires:
        for name, value in w["counters"].items():
            counters[name] = counters.get(name, 0.0) + float(value)
    trained = sum(s["trained_tokens"] for s in arm["steps"])
    rows = sum(s["rows"] for s in arm["steps"])
    mismatched = sum(s["retokenization_mismatch_rows"] for s in arm["steps"])
    exactness = {k: statistics.median(float(r[k]) for r in records if k in r) for k in EXACTNESS_KEYS
                 if any(k in r for r in records)}
    base = run["rss_at_mark_mib"]
    return {
        "steps_logged": len(records),
        "phases_median_s": {p: statistics.median(v) for p, v in phases.items() if v},
        "phases_per_step_s": phases,
        "http_bytes": links,
        "trained_tokens": trained,
        "loss_tokens": sum(s["loss_tokens"] for s in arm["steps"]),
        "rows": rows,
        "driver_row_bytes_per_trained_token": (
            sum(s.get("driver_row_bytes", 0) for s in arm["steps"]) / trained if trained else None),
        "http_bytes_per_trained_token": {k: v / trained for k, v in links.items()} if trained else {},
        "headline_http_bytes_per_trained_token": sum(links[k] for k in HEADLINE_LINKS) / trained if trained else None,
        "all_http_bytes_per_trained_token": sum(links.values()) / trained if trained else None,
        "staged_bytes_per_trained_token": counters.get("staged_bytes", 0.0) / trained if trained else None,
        "stage_writer": {name: counters.get(name, 0.0) for name in STAGE_WRITER_COUNTERS},
        "worker_call_samples": worker_calls,
        "engine_load": engine_load(worker_calls),
        "route_ms_per_request": route_times_ms(wires),
        "exactness": exactness,
        "retokenization_mismatch_rows": mismatched,
        "queue_wait_ms": [float(r["finalize/queue_wait_ms"]) for r in records if "finalize/queue_wait_ms" in r],
        "queue_wait_ms_max": max((float(r.get("finalize/queue_wait_ms_max", 0.0)) for r in records), default=0.0),
        "wall_s": run["wall_s"],
        "startup_s": run["first_step_s"],
        "rss_peak_mib": run["rss_peak_mib"],
        "rss_per_rollout_in_flight_mib": {role: peak / in_flight for role, peak in run["rss_peak_mib"].items()},
        "rss_growth_in_measured_steps_mib": {
            role: peak - base.get(role, 0.0) for role, peak in run["rss_peak_after_mark_mib"].items()
        },
        "rollouts_in_flight": in_flight,
        "measured_steps": len(records) - skip_steps,
        "cpu_s_per_measured_step": cpu_per_step(run.get("cpu_s_at_mark", {}), run.get("cpu_s_at_end", {}),
                                                len(records) - skip_steps),
        "measured_generated_tokens": sum(s["loss_tokens"] for s in arm["steps"][skip_steps:]),
    }


def arm_main(args: argparse.Namespace) -> int:
    """Child: one run of the recipe (`run_grpo` unchanged) plus the post-run row checks."""
    import nemo_rl.algorithms.grpo_single_controller as sc
    from examples.arith.recipe import load_and_resolve
    from nemo_rl.token_capture.audit import retokenization_drift
    from nemo_rl.data.train import TrainPlan
    from nemo_rl.data_plane.partitions import read_train_batch

    arm_dir: Path = args.arm_dir
    overrides = [
        f"token_capture.enabled={'true' if args.arm == 'capture' else 'false'}",
        f"logger.log_dir={arm_dir / 'log'}",
        f"grpo.max_num_steps={args.steps}",
        f"grpo.num_generations_per_prompt={args.group_size}",
        *args.overrides,
    ]
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cfg = load_and_resolve(args.config, overrides, progress=progress)  # model.path null: the tiny model
    batches: list[Any] = []
    driver_held: list[tuple[Any, Any]] = []  # (groups, what went to the policy): pickled after the run
    original, original_clear = sc.build_train_batch, sc.clear_train_rows
    planned: dict[int, Any] = {}  # id(plan) -> the batch the policy worker read

    def observing(groups, normalize, train_partition):  # keeps references only
        step_batch = original(groups, normalize, train_partition)
        batches.append(step_batch.rows)
        driver_held.append((tuple(groups), step_batch.rows))
        return step_batch

    def reading_then_clearing(cleaner, trained_keys):
        # Rows in the train partition never reach the driver; the benchmark reads them back (one get,
        # outside the train phase, right before retention) to count tokens and check re-tokenization.
        # The loop clears the step it just built, so the plan is the last one observed.
        plan = batches[-1] if batches else None
        if isinstance(plan, TrainPlan):
            planned[id(plan)] = read_train_batch(cleaner.client, plan)
        return original_clear(cleaner, trained_keys)

    # run_grpo looks these up in its module on every step, so this sees each step's batch.
    sc.build_train_batch, sc.clear_train_rows = observing, reading_then_clearing
    asyncio.run(sc.run_grpo(cfg, progress=progress))
    batches = [planned[id(b)] if isinstance(b, TrainPlan) else b for b in batches]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.path))
    steps = []
    for index, (batch, (groups, sent)) in enumerate(zip(batches, driver_held), start=1):
        ids = list(batch.token_ids) if batch is not None else []
        masks = list(batch.token_mask) if batch is not None else []
        steps.append({
            "step": index,
            "rows": len(ids),
            "trained_tokens": sum(len(row) for row in ids),
            "loss_tokens": sum(sum(mask) for mask in masks),
            "retokenization_mismatch_rows": sum(retokenization_drift(tokenizer, list(row)) for row in ids),
            # Row bytes through the driver: the finalizers' verdicts it received + what it sent the policy.
            "driver_row_bytes": len(pickle.dumps(groups)) + len(pickle.dumps(sent)),
        })
    (arm_dir / "arm.json").write_text(json.dumps({"mode": args.arm, "steps": steps}, indent=1))
    return 0


# --- the synthetic part ---------------------------------------------------------------------------


class _TimedSink:
    """The real sink, with each stage's time and row size kept for the call being measured."""

    def __init__(self, sink: Any) -> None:
        from nemo_rl.data.calls import record_to_row, row_nbytes

        self._sink, self._to_row, self._nbytes = sink, record_to_row, row_nbytes
        self.last_s = 0.0
        self.last_bytes = 0
        self.last_record: Any = None

    def stage(self, record: Any, *, attachments: Any = None) -> Any:
        self.last_record = record
        self.last_bytes = self._nbytes(self._to_row(record))
        started = time.perf_counter()
        result = self._sink.stage(record) if attachments is None else self._sink.stage(record, attachments=attachments)
        self.last_s = time.perf_counter() - started
        return result


async def _stage_rollout(sink: _TimedSink, ledger: Any, ledger_dir: Path, rollout_id: str,
                         calls: Sequence[tuple[int, int]], rng: random.Random) -> dict[str, Any]:
    """Stage one rollout call by call like a worker (Gym's capture core) and commit each like the gate."""
    from nemo_gym.token_id_capture.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint
    from nemo_gym.token_id_capture.staging import CallRecord, CaptureAdmission, RolloutTokenCapture
    from nemo_gym.token_id_capture.staging.records import CaptureLedgerCommit, RolloutManifest

    from nemo_rl.data.calls import ServedCall

    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 0)
    sequence: list[int] = []
    conversation: list[dict] = [{"role": "user", "content": f"task {rollout_id}"}]
    parent: CallRecord | None = None
    chain: list[str] = []
    per_call: list[dict[str, float]] = []
    served: list[ServedCall] = []
    staged_records: list[Any] = []
    for index, (tail_len, gen_len) in enumerate(calls):
        call_id = f"c{index:03d}"
        if parent is None:
            admission = CaptureAdmission(rollout_id=rollout_id, model_call_id=call_id, mode="text")
        else:
            admission = CaptureAdmission(
                rollout_id=rollout_id, model_call_id=call_id, parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len, mode="token_in", staging_chain=list(chain),
                parent_chain_hash=parent.chain_hash,
            )
        prompt = sequence + [rng.randrange(3, 1000) for _ in range(tail_len)]
        generated = [rng.randrange(3, 1000) for _ in range(gen_len)]
        logprobs = [-rng.random() * 3 for _ in range(gen_len)]
        started = time.perf_counter()
        call = capture.begin_call(admission, prefix_token_ids=list(sequence) if parent else None)
        coords = capture.complete_call(call, prompt_token_ids=prompt, generated_token_ids=generated,
                                       generated_logprobs=logprobs)
        commit_s = time.perf_counter() - started
        if coords.disposition != "staged":
            raise BenchError(f"synthetic call {rollout_id}/{call_id} was not staged: {coords}")
        reply = {"role": "assistant", "content": f"reply {index} of {rollout_id}"}
        record = CallRecord(
            model_call_id=call_id, parent_call_id=admission.parent_call_id, prev_len=coords.prev_len,
            delta_len=coords.delta_len, cum_len=coords.cum_len, weight_version=coords.weight_version,
            digest=coords.digest, extras_digest=coords.extras_digest, staging_key=coords.staging_key,
            mode=admission.mode, chain_hash=coords.chain_hash, cumulative_hash=coords.cumulative_hash,
            response_id=f"chatcmpl-{rollout_id}-{call_id}", admitted_at=float(index),
            output_fingerprint=assistant_fingerprint([reply]) or None,
            continuation_fingerprint=assistant_fingerprint(conversation + [reply]) or None,
            fingerprint_version=FINGERPRINT_VERSION,
        )
        chain.append(coords.staging_key)  # the gate's child chain: the parent's chain + this call
        started = time.perf_counter()
        await ledger.record(CaptureLedgerCommit(rollout_id=rollout_id, record=record, staging_chain=tuple(chain),
                                                request_items=list(conversation), response_items=[reply]))
        ledger_s = time.perf_counter() - started
        per_call.append({
            "commit_s": commit_s, "stage_s": sink.last_s, "staged_bytes": sink.last_bytes, "ledger_record_s": ledger_s,
            "admission_bytes": len(json.dumps(admission.model_dump(mode="json"))),
        })
        served.append(ServedCall(rollout_id, call_id, admission.parent_call_id, admission.mode, gen_len, True))
        staged_records.append(sink.last_record)
        conversation += [reply, {"role": "tool", "content": f"result {index}"}]
        sequence = prompt + generated
        parent = record
    manifest = RolloutManifest.model_validate(await ledger.manifest(rollout_id))
    return {
        "manifest": manifest, "served": tuple(served), "per_call": per_call, "tokens": len(sequence),
        "staged_records": staged_records,
        # The ledger's documented file layout (gate.ledger: `<rollout>.lineage.jsonl` in its directory).
        "ledger_bytes": (ledger_dir / f"{rollout_id}.lineage.jsonl").stat().st_size,
        "run_result": {"response": {"id": parent.response_id, "output": []}, "reward": 1.0},
    }


def _evidence(staged: Sequence[dict[str, Any]], rollout_ids: Sequence[str]) -> list[Any]:
    from nemo_rl.token_capture.judge import RolloutEvidence

    return [RolloutEvidence(rid, 0, i, s["run_result"], None, s["manifest"], None, s["served"])
            for i, (rid, s) in enumerate(zip(rollout_ids, staged))]


def _judge_in_process(source: Any, items: Sequence[Any], cfg: Any) -> list[tuple[float, float]]:
    """(fetch seconds, judge seconds) per rollout, in this process: the finalizer's work without Ray."""
    from nemo_rl.experience.finalizer_pool import fetch_snapshots
    from nemo_rl.token_capture.judge import judge_rollout
    from nemo_rl.data.rows import KeptRollout

    times = []
    for item in items:
        started = time.perf_counter()
        snapshots, problems = fetch_snapshots(source, item.staging_keys())
        fetched = time.perf_counter()
        verdict = judge_rollout(item, snapshots, problems, cfg)
        judged = time.perf_counter()
        if not isinstance(verdict, KeptRollout):
            raise BenchError(f"synthetic rollout {item.rollout_id} did not verify in process: {verdict}")
        times.append((fetched - started, judged - fetched))
    return times


async def _finalize(
    pool: Any, staged: Sequence[dict[str, Any]], rollout_ids: Sequence[str]
) -> tuple[float, list[float]]:
    """Finalize staged rollouts as one group through the pool; (wall seconds, queue waits ms). All must verify."""
    from nemo_rl.data.rows import KeptRollout

    items = _evidence(staged, rollout_ids)
    started = time.perf_counter()
    outcomes = await pool.finalize_group(items)
    wall = time.perf_counter() - started
    for item, outcome in zip(items, outcomes):
        if not isinstance(outcome.result, KeptRollout):
            raise BenchError(f"synthetic rollout {item.rollout_id} did not verify: {outcome.result}")
    return wall, [o.queue_wait_ms for o in outcomes if o.queue_wait_ms is not None]


def _rows_kept_whole() -> Callable[[Sequence[Any]], list[Any]]:
    return list


async def _synthetic(out: Path, turns: Sequence[int], num_finalizers: int) -> dict[str, Any]:
    from nemo_rl.data_plane import DataPlaneConfig, attach_client, start_data_plane
    from nemo_rl.distributed.ray_cluster import init_local_ray
    from nemo_rl.environments.gate.ledger import BranchingCaptureLedger
    from nemo_rl.token_capture.config import TokenCaptureConfig
    from nemo_rl.experience.finalizer_pool import FinalizerPool, TQSourceFactory
    from nemo_rl.data.calls import record_to_row
    from nemo_rl.data_plane.partitions import TQStagingCleaner, TQTokenSink, TQTokenSource, reported_staged_keys

    capture_cfg = TokenCaptureConfig(enabled=True, num_finalizer_workers=num_finalizers)
    dp_cfg = DataPlaneConfig()
    partition = capture_cfg.staging_partition
    rng = random.Random(1234)
    results: dict[str, Any] = {"num_finalizers": num_finalizers, "tokens_per_call": SYN_TAIL + SYN_GEN}
    handle = init_local_ray(num_cpus=2)
    plane = client = pool = None
    try:
        plane = start_data_plane(dp_cfg)
        client = attach_client(dp_cfg)
        sink = _TimedSink(TQTokenSink(client, partition, timeout_s=capture_cfg.stage_timeout_s))
        # Judging is measured here, not the train-partition write: the pool hands kept rows back whole.
        pool = FinalizerPool.from_config(capture_cfg, TQSourceFactory.from_config(dp_cfg, capture_cfg), _rows_kept_whole)
        await pool.wait_ready(dp_cfg.startup_timeout_s)
        ledger_dir = out / "ledger"
        ledger = BranchingCaptureLedger(ledger_dir)
        print(SYNTHETIC_MARK, file=sys.stderr, flush=True)

        source = TQTokenSource(client, partition, timeout_s=capture_cfg.stage_timeout_s)
        # Warm-up: first TQ writes and the first finalize pay one-time costs (sockets, imports, caches).
        warm_ids = [f"warm-{i}" for i in range(SYN_WARMUP_ROLLOUTS)]
        warm = [await _stage_rollout(sink, ledger, ledger_dir, rid, [(SYN_TAIL, SYN_GEN)] * 4, rng) for rid in warm_ids]
        await _finalize(pool, warm, warm_ids)
        _judge_in_process(source, _evidence(warm, warm_ids), capture_cfg)

        scaling: dict[str, Any] = {}
        for t in turns:
            ids = [f"turns{t}-r{i}" for i in range(SYN_ROLLOUTS_PER_TURNS)]
            calls_of = [(SYN_TAIL, SYN_GEN)] * t
            staged = [await _stage_rollout(sink, ledger, ledger_dir, rid, calls_of, rng) for rid in ids]
            wall, waits = await _finalize(pool, staged, ids)
            in_process = _judge_in_process(source, _evidence(staged, ids), capture_cfg)
            calls = [c for s in staged for c in s["per_call"]]
            tokens = sum(s["tokens"] for s in staged)
            per_rollout_tokens = tokens / len(staged)
            scaling[str(t)] = {
                "rollouts": len(ids),
                "calls": len(calls),
                "ledger_bytes_per_call": sum(s["ledger_bytes"] for s in staged) / len(calls),
                "staged_bytes_per_call": statistics.mean(c["staged_bytes"] for c in calls),
                "admission_bytes_per_call": statistics.mean(c["admission_bytes"] for c in calls),
                "admission_bytes_last_call": staged[0]["per_call"][-1]["admission_bytes"],
                "stage_ms_p50": 1000.0 * percentile([c["stage_s"] for c in calls], 50),
                "commit_ms_p50": 1000.0 * percentile([c["commit_s"] for c in calls], 50),
                "commit_ms_last_call_median": 1000.0 * statistics.median(s["per_call"][-1]["commit_s"] for s in staged),
                "ledger_record_ms_p50": 1000.0 * percentile([c["ledger_record_s"] for c in calls], 50),
                "ledger_record_ms_last_call_median": 1000.0 * statistics.median(
                    s["per_call"][-1]["ledger_record_s"] for s in staged),
                "commit_compute_ms_last_call_median": 1000.0 * statistics.median(
                    s["per_call"][-1]["commit_s"] - s["per_call"][-1]["stage_s"] for s in staged),
                "pool_finalize_s": wall,
                "pool_finalize_us_per_token": 1e6 * wall / tokens,
                "fetch_ms_per_rollout": 1000.0 * statistics.median(f for f, _ in in_process),
                "judge_ms_per_rollout": 1000.0 * statistics.median(j for _, j in in_process),
                "finalize_us_per_token": 1e6 * statistics.median(f + j for f, j in in_process) / per_rollout_tokens,
                "judge_us_per_token": 1e6 * statistics.median(j for _, j in in_process) / per_rollout_tokens,
                "queue_wait_ms_max": max(waits, default=0.0),
            }
            print(f"[synthetic] {t} turns: {scaling[str(t)]}", file=sys.stderr, flush=True)
        results["turn_scaling"] = scaling

        throughput: dict[str, Any] = {}
        for size in ROW_SIZES:
            n = ROWS_PER_SIZE[size]
            ids = [f"rows{size}-r{i}" for i in range(n)]
            quarter = size // 4
            two_calls = [(quarter, quarter), (quarter, quarter)]
            staged = [await _stage_rollout(sink, ledger, ledger_dir, rid, two_calls, rng) for rid in ids]
            wall, waits = await _finalize(pool, staged, ids)
            throughput[str(size)] = {
                "rows": n,
                "rows_per_s_per_actor": n / wall / num_finalizers,
                "ms_per_row": 1000.0 * wall * num_finalizers / n,
                "queue_wait_ms_p50": percentile(waits, 50) if waits else None,
                "queue_wait_ms_max": max(waits, default=0.0),
            }
            print(f"[synthetic] rows of {size} tokens: {throughput[str(size)]}", file=sys.stderr, flush=True)
        results["finalizer_throughput"] = throughput

        # Retention: time to clear one finished group (8 rollouts x 2 keys, one of them an orphan) as the
        # partition fills with other groups' rows (written in bulk: only their number matters here).
        cleaner = TQStagingCleaner(client, partition, capture_cfg.stage_timeout_s)
        filler_row = record_to_row(warm[0]["staged_records"][0])
        retention: dict[str, Any] = {}
        filled = 0
        for background in RETENTION_BACKGROUND_KEYS:
            while filled < background:
                batch = [f"bg{filled + i}/c000" for i in range(min(500, background - filled))]
                client.put_many(partition, batch, [filler_row] * len(batch))
                filled += len(batch)
            clear_ms, orphan_counts = [], []
            for repeat in range(RETENTION_GROUPS_PER_LEVEL):
                ids = [f"ret{background}-{repeat}-r{i}" for i in range(8)]
                staged = [await _stage_rollout(sink, ledger, ledger_dir, rid, [(8, 8), (8, 8)], rng) for rid in ids]
                # The first rollout's last call stands for one whose commit never reached the ledger: the
                # worker staged and reported it, no manifest names it (an orphan).
                orphan = staged[0]["manifest"].records[-1].staging_key
                named = [r.staging_key for st in staged for r in st["manifest"].records if r.staging_key != orphan]
                reported = reported_staged_keys(call for st in staged for call in st["served"])
                started = time.perf_counter()
                orphan_counts.append(cleaner.clear(named, ids, reported))
                clear_ms.append(1000.0 * (time.perf_counter() - started))
            retention[str(background)] = {"clear_ms_median": statistics.median(clear_ms), "clear_ms": clear_ms,
                                          "orphans_per_group": orphan_counts}
            print(f"[synthetic] retention with {background} other keys: {retention[str(background)]}",
                  file=sys.stderr, flush=True)
        results["retention"] = retention
        return results
    finally:
        if pool is not None:
            pool.shutdown()
        if client is not None:
            client.close()
        if plane is not None:
            plane.shutdown()
        handle.shutdown()


def synthetic_main(args: argparse.Namespace) -> int:
    out: Path = args.synthetic_dir
    shutil.rmtree(out / "ledger", ignore_errors=True)
    result = asyncio.run(_synthetic(out, args.turns, args.finalizers))
    (out / "synthetic.json").write_text(json.dumps(result, indent=1))
    return 0


# --- summary, report, plots -----------------------------------------------------------------------


def stage_writer_figures(per_arm: Sequence[Mapping[str, float]]) -> dict[str, float | None]:
    """The write-behind writer's totals over the capture arms: rows per write, ms per write and per report."""
    total = {name: sum(float(a.get(name, 0.0)) for a in per_arm) for name in STAGE_WRITER_COUNTERS}
    batches, flushes = total["stage_write_batches"], total["stage_flushes"]
    return {
        "rows": total["stage_write_rows"],
        "writes": batches,
        "rows_per_write": total["stage_write_rows"] / batches if batches else None,
        "ms_per_write": 1000.0 * total["stage_write_s"] / batches if batches else None,
        "served_reports": flushes,
        "ms_waited_per_served_report": 1000.0 * total["stage_flush_wait_s"] / flushes if flushes else None,
    }


def engine_load_summary(arms: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: spreads over repeats of the engine-load figures; {} when the arms did not record them."""
    if not all(a.get("engine_load") for m in MODES for a in arms[m]):
        return {}
    out: dict[str, Any] = {}
    for m in MODES:
        loads = [a["engine_load"] for a in arms[m]]
        steps = [a["steps_logged"] for a in arms[m]]  # every logged step's calls are sampled
        out[m] = {
            "busy_s_per_step": spread(load["busy_s"] / n for load, n in zip(loads, steps)),
            "tokens_per_busy_s": spread(load["tokens_per_busy_s"] for load in loads),
            "in_flight_mean": spread(load["in_flight_mean"] for load in loads),
            "prompt_tokens_p50": spread(load["prompt_tokens_p50"] for load in loads),
            "generated_tokens_p50": spread(load["generated_tokens_p50"] for load in loads),
            "generate_ms_p50_by_in_flight": {
                k: spread(load["generate_ms_p50_by_in_flight"][k]["ms_p50"] for load in loads
                          if k in load["generate_ms_p50_by_in_flight"])
                for k in sorted({k for load in loads for k in load["generate_ms_p50_by_in_flight"]})},
        }
    return out


def summarize_ab(arms: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: spreads over repeats of each per-arm figure; on/off ratios of the medians."""
    out: dict[str, Any] = {"phases_s": {}, "http": {}, "exactness": {}}
    for phase in PHASES:
        per_mode = {m: spread(a["phases_median_s"][phase] for a in arms[m]) for m in MODES
                    if all(phase in a["phases_median_s"] for a in arms[m])}
        if len(per_mode) == 2:
            per_mode["ratio"] = ratio(per_mode["capture"]["median"], per_mode["legacy"]["median"]) \
                if per_mode["legacy"]["median"] else None
        out["phases_s"][phase] = per_mode
    for mode in MODES:
        out["http"][mode] = {
            "headline_bytes_per_trained_token": spread(a["headline_http_bytes_per_trained_token"] for a in arms[mode]),
            "all_bytes_per_trained_token": spread(a["all_http_bytes_per_trained_token"] for a in arms[mode]),
            "per_link_bytes_per_trained_token": {
                link: spread(a["http_bytes_per_trained_token"][link] for a in arms[mode]) for link in LINKS
            },
            "staged_tq_bytes_per_trained_token": spread(a["staged_bytes_per_trained_token"] for a in arms[mode]),
            "trained_tokens": [a["trained_tokens"] for a in arms[mode]],
            "rows": [a["rows"] for a in arms[mode]],
        }
        driver = [a.get("driver_row_bytes_per_trained_token") for a in arms[mode]]
        if all(v is not None for v in driver):
            out["http"][mode]["driver_row_bytes_per_trained_token"] = spread(driver)
        out["exactness"][mode] = {k: spread(a["exactness"][k] for a in arms[mode]) for k in EXACTNESS_KEYS
                                  if all(k in a["exactness"] for a in arms[mode])}
        rows = sum(a["rows"] for a in arms[mode])
        out["exactness"][mode]["retokenization_mismatch_fraction"] = (
            sum(a["retokenization_mismatch_rows"] for a in arms[mode]) / rows if rows else None)
    out["http"]["headline_ratio"] = ratio(out["http"]["capture"]["headline_bytes_per_trained_token"]["median"],
                                          out["http"]["legacy"]["headline_bytes_per_trained_token"]["median"])
    out["http"]["all_links_ratio"] = ratio(out["http"]["capture"]["all_bytes_per_trained_token"]["median"],
                                           out["http"]["legacy"]["all_bytes_per_trained_token"]["median"])
    out["call_costs"] = {m: call_costs([c for a in arms[m] for c in a["worker_call_samples"]]) for m in MODES}
    out["engine_load"] = engine_load_summary(arms)
    out["stage_writer"] = stage_writer_figures([a.get("stage_writer", {}) for a in arms["capture"]])
    out["route_ms_per_request"] = {
        m: {name: spread(a["route_ms_per_request"][name] for a in arms[m]) for name in ROUTE_TIMES
            if all(name in a["route_ms_per_request"] for a in arms[m])} for m in MODES}
    out["queue_wait_ms"] = spread([w for a in arms["capture"] for w in a["queue_wait_ms"]] or [0.0])
    roles = sorted({role for m in MODES for a in arms[m] for role in a["rss_peak_mib"]})
    out["rss_peak_mib"] = {m: {r: spread(a["rss_peak_mib"].get(r, 0.0) for a in arms[m]) for r in roles} for m in MODES}
    for key in ("rss_per_rollout_in_flight_mib", "rss_growth_in_measured_steps_mib"):
        out[key] = {m: {r: spread(a[key].get(r, 0.0) for a in arms[m]) for r in roles} for m in MODES}
    out["startup_s"] = {m: spread(a["startup_s"] or 0.0 for a in arms[m]) for m in MODES}
    if all(a.get("cpu_s_per_measured_step") for m in MODES for a in arms[m]):
        cpu_roles = sorted({r for m in MODES for a in arms[m] for r in a["cpu_s_per_measured_step"]})
        out["cpu_s_per_step"] = {m: {r: spread(a["cpu_s_per_measured_step"].get(r, 0.0) for a in arms[m])
                                     for r in cpu_roles} for m in MODES}
        out["engine_cpu_ms_per_generated_token"] = {m: spread(
            1000.0 * a["cpu_s_per_measured_step"].get("worker_engine", 0.0) * a["measured_steps"]
            / a["measured_generated_tokens"] for a in arms[m] if a["measured_generated_tokens"]) for m in MODES}
    return out


def top_level(ab: Mapping[str, Any] | None, syn: Mapping[str, Any] | None) -> dict[str, float | None]:
    top: dict[str, float | None] = dict.fromkeys(TOP_LEVEL_KEYS)
    if ab is not None:
        top["step_time_ratio"] = ab["phases_s"]["timing/step_s"]["ratio"]
        top["http_bytes_per_trained_token_ratio"] = ab["http"]["headline_ratio"]
        top["added_call_latency_fraction_p50"] = ab["call_costs"]["capture"]["fraction_p50"]
        top["token_mult_prob_error_capture"] = ab["exactness"]["capture"]["token_mult_prob_error"]["median"]
        top["token_mult_prob_error_legacy"] = ab["exactness"]["legacy"]["token_mult_prob_error"]["median"]
        top["retokenization_mismatch_fraction"] = ab["exactness"]["capture"]["retokenization_mismatch_fraction"]
    if syn is not None:
        top["finalizer_rows_per_s"] = syn["finalizer_throughput"][str(HEADLINE_ROW_SIZE)]["rows_per_s_per_actor"]
        scaling = syn["turn_scaling"]
        top["ledger_bytes_per_call_growth"] = growth({int(t): v["ledger_bytes_per_call"] for t, v in scaling.items()})
        top["finalize_time_per_token_growth"] = growth({int(t): v["judge_us_per_token"] for t, v in scaling.items()})
    return top


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _sp(s: Mapping[str, float], scale: float = 1.0, digits: int = 3) -> str:
    return f"{_fmt(s['median'] * scale, digits)} ({_fmt(s['min'] * scale, digits)}-{_fmt(s['max'] * scale, digits)})"


def _engine_time_lines(ab: Mapping[str, Any]) -> list[str]:
    """Where the engine's part of a call goes: engine time per call, the engine core's CPU per
    generated token, and CPU seconds per step by role (who shares the cores with the engine)."""
    cc = ab["call_costs"]
    lines = ["", "## Where the engine's time goes", "",
             "Per call (p50, ms): the engine's part (`generate_s`, both paths) and the worker's rendering and "
             "parsing (the rest of the call minus it).", "",
             "| | capture | legacy |", "|---|---|---|",
             f"| engine (generate) | {_fmt(cc['capture']['generate_ms_p50'])} | {_fmt(cc['legacy']['generate_ms_p50'])} |",
             f"| render + parse | {_fmt(cc['capture']['render_parse_ms_p50'])} | "
             f"{_fmt(cc['legacy']['render_parse_ms_p50'])} |"]
    load = ab.get("engine_load") or {}
    if load:
        lines += ["", "The engine's load, from each call's generate interval (in flight: generations in the engine "
                  "during a call, itself included, time-averaged). Equal tokens per busy second with a longer "
                  "engine time per call means the calls overlapped more (the engine batched them); fewer "
                  "tokens per busy second means the engine itself ran slower. The two arms train different "
                  "policies, so their calls differ in length and overlap; on identical requests "
                  "(`benchmarks/engine_ab.py`) the engine's part is the same in both paths, and what capture "
                  "adds to a worker call outside the engine is its commit (Gym's digests), admission parsing "
                  "and the request digest (docs/guides/token-capture.md, 'Where the engine's part goes').", "",
                  "| | capture | legacy |", "|---|---|---|"]
        for key, label, scale in (("busy_s_per_step", "engine busy, s per step", 1.0),
                                  ("tokens_per_busy_s", "generated tokens per busy second", 1.0),
                                  ("in_flight_mean", "in flight per call, mean", 1.0),
                                  ("prompt_tokens_p50", "prompt tokens per call, p50", 1.0),
                                  ("generated_tokens_p50", "generated tokens per call, p50", 1.0)):
            lines.append(f"| {label} | {_sp(load['capture'][key], scale)} | {_sp(load['legacy'][key], scale)} |")
        for k in sorted(set(load["capture"]["generate_ms_p50_by_in_flight"]) | set(load["legacy"]["generate_ms_p50_by_in_flight"])):
            cells = [_sp(load[m]["generate_ms_p50_by_in_flight"][k]) if k in load[m]["generate_ms_p50_by_in_flight"]
                     else "-" for m in MODES]
            lines.append(f"| engine ms per call, p50, at {k} in flight | {cells[0]} | {cells[1]} |")
    if "cpu_s_per_step" not in ab:
        return lines + ["", "(CPU per role was not sampled in these arms.)"]
    eng = ab["engine_cpu_ms_per_generated_token"]
    lines += ["", f"Engine-core CPU per generated token (ms): capture {_sp(eng['capture'])}, legacy "
              f"{_sp(eng['legacy'])}. Equal CPU per token with a longer engine time means the engine waited "
              "for a core; the table shows who held the cores.", "",
              "| role | capture CPU s/step | legacy CPU s/step | capture - legacy |", "|---|---|---|---|"]
    for role, by_mode in sorted(ab["cpu_s_per_step"]["capture"].items(),
                                key=lambda kv: -kv[1]["median"]):
        legacy = ab["cpu_s_per_step"]["legacy"][role]
        lines.append(f"| {role} | {_sp(by_mode)} | {_sp(legacy)} | {_fmt(by_mode['median'] - legacy['median'])} |")
    return lines


def write_report(path: Path, results: Mapping[str, Any]) -> None:
    top, ab, syn, cfg = results["top_level"], results.get("ab"), results.get("synthetic"), results["config"]
    lines = [
        "# Capture A/B: what capture costs",
        "",
        f"Command: `{cfg['command']}`  ",
        f"Recipe: `{cfg['config']}`, {cfg['steps']} steps per arm (first {cfg['skip_steps']} left out as warm-up), "
        f"group size {cfg['group_size']}, {cfg['repeats']} repeat(s) per mode, interleaved ABBA.  ",
        f"Machine: {cfg['cpus']} CPUs, load average {cfg['load_before']} before / {cfg['load_after']} after; "
        f"wall time {results['wall_time_s']:.0f} s.",
        "",
        "Figures are median (min-max) over repeats; each repeat's figure is the median over its steps.",
        "",
        "## Headline (results.json top level)",
        "",
        "| key | value | target |",
        "|---|---|---|",
    ]
    lines += [f"| `{k}` | {_fmt(top[k], 4)} | {TARGETS.get(k, '')} |" for k in TOP_LEVEL_KEYS]
    if ab is not None:
        lines += ["", "## Step time and phases (seconds)", "",
                  "`generation_s` includes `finalize_s` (finalize is summed over the step's groups, which run "
                  "concurrently).", "", "| phase | capture | legacy | capture/legacy |", "|---|---|---|---|"]
        for phase, per in ab["phases_s"].items():
            if "capture" in per and "legacy" in per:
                lines.append(f"| {phase} | {_sp(per['capture'])} | {_sp(per['legacy'])} | {_fmt(per.get('ratio'))} |")
        lines += ["", "## HTTP body bytes per trained token", "",
                  "Trained tokens = every token of every row the trainer received. Headline = agent<->gate + "
                  "gate<->worker.", "", "| link | capture | legacy |", "|---|---|---|"]
        for link in LINKS:
            c = ab["http"]["capture"]["per_link_bytes_per_trained_token"][link]
            g = ab["http"]["legacy"]["per_link_bytes_per_trained_token"][link]
            lines.append(f"| {link} | {_sp(c)} | {_sp(g)} |")
        lines += [
            f"| **headline** | {_sp(ab['http']['capture']['headline_bytes_per_trained_token'])} | "
            f"{_sp(ab['http']['legacy']['headline_bytes_per_trained_token'])} |",
            f"| all links | {_sp(ab['http']['capture']['all_bytes_per_trained_token'])} | "
            f"{_sp(ab['http']['legacy']['all_bytes_per_trained_token'])} |",
            f"| (not HTTP) TQ staged bytes | {_sp(ab['http']['capture']['staged_tq_bytes_per_trained_token'])} | - |",
            *([f"| (not HTTP) row bytes through the driver (pickled verdicts + what it sent the policy) | "
               f"{_sp(ab['http']['capture']['driver_row_bytes_per_trained_token'])} | "
               f"{_sp(ab['http']['legacy']['driver_row_bytes_per_trained_token'])} |"]
              if "driver_row_bytes_per_trained_token" in ab["http"]["legacy"]
              and "driver_row_bytes_per_trained_token" in ab["http"]["capture"] else []),
            "", f"Ratio capture/legacy: headline {_fmt(ab['http']['headline_ratio'])}, all links "
            f"{_fmt(ab['http']['all_links_ratio'])}.", "",
            "## Per-call latency added by capture at the worker", "",
            "added = `begin_call` + wait for parents' rows + prefix fetch from TQ + commit (digests + staging "
            "write or its queueing) + prefix cache seed; "
            "fraction = added / (call time - added). A token-in call whose parents this worker staged "
            "resolves them from its prefix cache and fetches nothing.", "",
            "| | p50 | p99 |", "|---|---|---|"]
        cc = ab["call_costs"]["capture"]
        lines += [
            f"| added (ms) | {_fmt(cc['added_ms_p50'])} | {_fmt(cc['added_ms_p99'])} |",
            f"| fraction of the call | {_fmt(cc['fraction_p50'])} | {_fmt(cc['fraction_p99'])} |",
            f"| begin_call (ms) | {_fmt(cc['begin_call_ms_p50'])} | {_fmt(cc['begin_call_ms_p99'])} |",
            f"| token-in call waiting for its parents' rows, calls: {cc['parent_wait_calls']} (ms) | "
            f"{_fmt(cc['parent_wait_ms_p50'])} | {_fmt(cc['parent_wait_ms_p99'])} |",
            f"| prefix fetch, calls that fetched: {cc['prefix_fetch_calls']} (ms) | "
            f"{_fmt(cc['prefix_fetch_ms_p50'])} | {_fmt(cc['prefix_fetch_ms_p99'])} |",
            f"| commit incl. stage (ms) | {_fmt(cc['commit_ms_p50'])} | {_fmt(cc['commit_ms_p99'])} |",
            f"| stage (ms; behind_reply: queueing the row) | {_fmt(cc['stage_ms_p50'])} | {_fmt(cc['stage_ms_p99'])} |",
            f"| prefix cache seed (ms) | {_fmt(cc['prefix_seed_ms_p50'])} | {_fmt(cc['prefix_seed_ms_p99'])} |",
            f"| rest of the call (ms) | {_fmt(cc['rest_ms_p50'])} | |",
            "", f"{cc['calls']} capture calls sampled; legacy calls: {ab['call_costs']['legacy']['calls']} "
            f"(rest p50 {_fmt(ab['call_costs']['legacy']['rest_ms_p50'])} ms).", ""]
        sw = ab.get("stage_writer") or {}
        if sw.get("writes"):
            lines += [
                f"Staging behind the reply (`token_capture.stage_write=behind_reply`): the stage row above is the "
                f"queueing; {sw['rows']:.0f} rows reached TransferQueue in {sw['writes']:.0f} writes "
                f"({_fmt(sw['rows_per_write'])} rows per write, {_fmt(sw['ms_per_write'])} ms per write, off the "
                f"response path); the served-call report waited {_fmt(sw['ms_waited_per_served_report'])} ms on "
                f"average for them ({sw['served_reports']:.0f} reports).", ""]
        lines += [
            "## Server-side time per request (ms, mean over the arm's requests)", "",
            "| server:route | capture | legacy |", "|---|---|---|"]
        for name in ROUTE_TIMES:
            c, g = ab["route_ms_per_request"]["capture"].get(name), ab["route_ms_per_request"]["legacy"].get(name)
            lines.append(f"| {name} | {_sp(c) if c else '-'} | {_sp(g) if g else '-'} |")
        lines += ["", "## Exactness", "", "| | capture | legacy |", "|---|---|---|"]
        for key in EXACTNESS_KEYS:
            if key in ab["exactness"]["capture"] and key in ab["exactness"]["legacy"]:
                lines.append(f"| {key} | {_sp(ab['exactness']['capture'][key], digits=7)} | "
                             f"{_sp(ab['exactness']['legacy'][key], digits=7)} |")
        lines.append(f"| rows whose ids differ from a re-tokenization of their text | "
                     f"{_fmt(ab['exactness']['capture']['retokenization_mismatch_fraction'])} | "
                     f"{_fmt(ab['exactness']['legacy']['retokenization_mismatch_fraction'])} |")
        in_flight = results["arms"]["capture"][0]["rollouts_in_flight"]
        lines += ["", "## Peak RSS (MiB)", "",
                  f"{in_flight} rollouts in flight (one step's groups run concurrently). Per rollout = peak / "
                  f"{in_flight}; growth = peak during the measured steps - RSS when the first of them was "
                  "dispatched (what steady-state steps add; ~0 means no per-step accumulation).", "",
                  "| role | capture peak | legacy peak | capture per rollout | legacy per rollout | "
                  "capture growth | legacy growth |",
                  "|---|---|---|---|---|---|---|"]
        for role in ab["rss_peak_mib"]["capture"]:
            row = [_sp(ab[key][mode][role], digits=4) for key in
                   ("rss_peak_mib", "rss_per_rollout_in_flight_mib", "rss_growth_in_measured_steps_mib")
                   for mode in MODES]
            lines.append(f"| {role} | " + " | ".join(row) + " |")
        lines += ["", f"Finalizer queue wait in the capture arms (mean per step, ms): {_sp(ab['queue_wait_ms'])}."]
        lines += _engine_time_lines(ab)
    if syn is not None:
        lines += ["", "## Scaling with turns (synthetic, real sink + ledger + finalizer + TQ)", "",
                  f"The tiny model makes ~2 calls per rollout, so these rollouts are synthetic: each call is "
                  f"{SYN_TAIL} tail + {SYN_GEN} generated tokens, staged through Gym's capture core into "
                  f"`TQTokenSink`, committed to `BranchingCaptureLedger` as the gate does, finalized by "
                  f"{syn['num_finalizers']} finalizer actor(s) over TQ.", "",
                  "Bytes: ledger = the gate's ledger file per call; staged = one TQ row (ids int64, mask and "
                  "logprobs float64, JSON header); admission = the `ng_capture` JSON the gate sends the worker. "
                  "Times: stage = the TQ write; commit = Gym's capture core (digests, chain and cumulative hash) "
                  "+ stage, and its compute part alone on the rollout's last call; ledger write = the gate's "
                  "`record` (fsync'd append); judge = fetch-free verify + linearize per rollout in one process "
                  "(`finalize_time_per_token_growth` uses it); fetch = one TQ read of the rollout's deltas; pool = "
                  "the whole group through the FinalizerPool (Ray calls, queueing).", "",
                  "| turns | ledger B/call | staged B/call | admission B/call (last) | stage ms p50 | "
                  "commit ms p50 | commit compute ms (last call) | ledger write ms p50 | judge us/token | "
                  "fetch ms/rollout | pool us/token |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for t, v in syn["turn_scaling"].items():
            lines.append(
                f"| {t} | {_fmt(v['ledger_bytes_per_call'], 4)} | {_fmt(v['staged_bytes_per_call'], 4)} | "
                f"{_fmt(v['admission_bytes_per_call'], 4)} ({v['admission_bytes_last_call']}) | "
                f"{_fmt(v['stage_ms_p50'])} | {_fmt(v['commit_ms_p50'])} | "
                f"{_fmt(v['commit_compute_ms_last_call_median'])} | {_fmt(v['ledger_record_ms_p50'])} | "
                f"{_fmt(v['judge_us_per_token'])} | {_fmt(v['fetch_ms_per_rollout'])} | "
                f"{_fmt(v['pool_finalize_us_per_token'])} |")
        lines += ["", "## Finalizer throughput (synthetic rows of 2 calls)", "",
                  "| row tokens | rows | rows/s per actor | ms per row | queue wait ms p50 | queue wait ms max |",
                  "|---|---|---|---|---|---|"]
        for size, v in syn["finalizer_throughput"].items():
            lines.append(f"| {size} | {v['rows']} | {_fmt(v['rows_per_s_per_actor'])} | {_fmt(v['ms_per_row'])} | "
                         f"{_fmt(v['queue_wait_ms_p50'])} | {_fmt(v['queue_wait_ms_max'])} |")
        rss = syn.get("rss_peak_mib", {})
        lines += ["", "Peak RSS in the synthetic part (MiB): "
                  + ", ".join(f"{r} {v:.0f}" for r, v in sorted(rss.items()))]
        lines += ["", "## Retention: clearing one group (8 rollouts x 2 staged keys, 1 orphan)", "",
                  f"Median over {RETENTION_GROUPS_PER_LEVEL} groups per partition size.", "",
                  "| other keys in the partition | clear ms |", "|---|---|"]
        for bg, v in syn["retention"].items():
            lines.append(f"| {bg} | {_fmt(v['clear_ms_median'])} |")
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in results.get("plots", [])), ""]
    path.write_text("\n".join(lines))


def write_plots(out: Path, results: Mapping[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ab, syn = results.get("ab"), results.get("synthetic")
    colors = {"capture": "C0", "legacy": "C1"}
    if ab is not None:
        fig, ax = plt.subplots(figsize=(8, 4))
        phases = [p for p in PHASES if "capture" in ab["phases_s"][p]]
        for i, mode in enumerate(MODES):
            med = [ab["phases_s"][p][mode]["median"] for p in phases]
            lo = [m - ab["phases_s"][p][mode]["min"] for m, p in zip(med, phases)]
            hi = [ab["phases_s"][p][mode]["max"] - m for m, p in zip(med, phases)]
            ax.bar([x + 0.38 * i for x in range(len(phases))], med, 0.38, yerr=[lo, hi], capsize=3,
                   label=mode, color=colors[mode])
        ax.set_xticks([x + 0.19 for x in range(len(phases))], [p.split("/")[1] for p in phases])
        ax.set_ylabel("seconds (median, min-max over repeats)")
        ax.set_title("Step time and phases: capture vs legacy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "step_phases.png", dpi=110)
        plt.close(fig)
        written.append("step_phases.png")

        fig, ax = plt.subplots(figsize=(7, 4))
        for i, mode in enumerate(MODES):
            bottom = 0.0
            for j, link in enumerate(LINKS):
                v = ab["http"][mode]["per_link_bytes_per_trained_token"][link]["median"]
                ax.bar(i, v, 0.6, bottom=bottom, color=f"C{j}", label=link if i == 0 else None)
                bottom += v
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_ylabel("HTTP body bytes per trained token")
        ax.set_title("HTTP bytes per trained token, by link")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "http_bytes.png", dpi=110)
        plt.close(fig)
        written.append("http_bytes.png")

        fig, ax = plt.subplots(figsize=(7, 4))
        parts = ["begin_call_ms", "prefix_fetch_ms", "commit_ms", "stage_ms", "prefix_seed_ms"]
        cc = ab["call_costs"]["capture"]
        ax.bar([p[:-3] for p in parts], [cc[f"{p}_p50"] for p in parts], label="p50")
        ax.bar([p[:-3] for p in parts], [cc[f"{p}_p99"] - cc[f"{p}_p50"] for p in parts],
               bottom=[cc[f"{p}_p50"] for p in parts], alpha=0.4, label="p99")
        ax.set_ylabel("ms per call")
        ax.set_title(f"Capture time per worker call (rest of call p50 {cc['rest_ms_p50']:.0f} ms; "
                     f"added fraction p50 {cc['fraction_p50']:.3f})", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "call_latency.png", dpi=110)
        plt.close(fig)
        written.append("call_latency.png")

        fig, ax = plt.subplots(figsize=(8, 4))
        roles = list(ab["rss_peak_mib"]["capture"])
        for i, mode in enumerate(MODES):
            ax.bar([x + 0.38 * i for x in range(len(roles))],
                   [ab["rss_peak_mib"][mode][r]["median"] for r in roles], 0.38, label=mode, color=colors[mode])
        ax.set_xticks([x + 0.19 for x in range(len(roles))], roles, rotation=30, fontsize=8)
        ax.set_ylabel("peak RSS (MiB)")
        ax.set_title("Peak RSS per component")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "rss.png", dpi=110)
        plt.close(fig)
        written.append("rss.png")
    if syn is not None:
        scaling = syn["turn_scaling"]
        turns = [int(t) for t in scaling]
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for key, label in (("ledger_bytes_per_call", "ledger"), ("staged_bytes_per_call", "staged (TQ)"),
                           ("admission_bytes_per_call", "admission (gate->worker)")):
            axes[0].plot(turns, [scaling[str(t)][key] for t in turns], marker="o", label=label)
        axes[0].set_title("bytes per call")
        for key, label in (("judge_us_per_token", "judge (in process)"), ("finalize_us_per_token", "fetch + judge"),
                           ("pool_finalize_us_per_token", "pool (Ray, queued)")):
            axes[1].plot(turns, [scaling[str(t)][key] for t in turns], marker="o", label=label)
        axes[1].set_title("finalize time per token (us)")
        axes[1].set_yscale("log")
        axes[1].legend(fontsize=8)
        for key, label in (("stage_ms_p50", "stage p50"), ("commit_ms_p50", "commit p50"),
                           ("ledger_record_ms_p50", "ledger write p50")):
            axes[2].plot(turns, [scaling[str(t)][key] for t in turns], marker="o", label=label)
        axes[2].set_title("per-call time (ms)")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("calls per rollout")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        axes[2].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "turn_scaling.png", dpi=110)
        plt.close(fig)
        written.append("turn_scaling.png")

        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = [int(s) for s in syn["finalizer_throughput"]]
        ax.plot(sizes, [syn["finalizer_throughput"][str(s)]["rows_per_s_per_actor"] for s in sizes], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per row")
        ax.set_ylabel("rows/s per finalizer actor")
        ax.set_title("Finalizer throughput (synthetic rows, real TQ)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "finalizer_throughput.png", dpi=110)
        plt.close(fig)
        written.append("finalizer_throughput.png")
    return written


# --- entry point ------------------------------------------------------------------------------------


def _turns(text: str) -> list[int]:
    values = sorted({int(t) for t in text.split(",") if t.strip()})
    if len(values) < 2 or values[0] < 1:
        raise argparse.ArgumentTypeError(f"--turns={text!r}: need at least two positive turn counts")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="output folder (results.json, report.md, *.png, arms/)")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per arm (default 6; the first is warm-up)")
    p.add_argument("--skip-steps", type=int, default=1, help="leading steps left out of the timing (default 1)")
    p.add_argument("--group-size", type=int, default=4, help="grpo.num_generations_per_prompt (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="arms per mode, interleaved ABBA (default 2)")
    p.add_argument("--turns", type=_turns, default=[2, 8, 32, 64],
                   help="calls per synthetic rollout (default 2,8,32,64)")
    p.add_argument("--finalizers", type=int, default=1, help="finalizer actors in the synthetic part (default 1)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="recipe (default grpo_capture_tiny_cpu.yaml)")
    p.add_argument("--arm-timeout-s", type=float, default=900.0, help="deadline per child process (default 900)")
    p.add_argument("--skip-ab", action="store_true", help="only the synthetic part")
    p.add_argument("--skip-synthetic", action="store_true", help="only the A/B arms")
    p.add_argument("--summarize-only", action="store_true",
                   help="rebuild results.json, report.md and the plots from the outputs already in --out "
                        "(give the options of the run that wrote them)")
    p.add_argument("--arm", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--arm-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--synthetic-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra Hydra-style overrides for every arm")
    args = p.parse_args(argv)
    if args.arm is None and args.synthetic_dir is None and args.out is None:
        p.error("--out is required")
    if args.steps <= args.skip_steps:
        p.error(f"--steps={args.steps} must exceed --skip-steps={args.skip_steps}")
    if args.repeats < 1 or args.group_size < 1 or args.finalizers < 1:
        p.error("--repeats, --group-size and --finalizers must be >= 1")
    return args


def _child_args(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--skip-steps", str(args.skip_steps), "--group-size", str(args.group_size),
            "--config", str(args.config), *args.overrides]


def _shown_path(path: Path) -> str:
    """A recipe path for the report: relative to the repo when inside it (no machine paths in reports)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


def _num_prompts(config: Path, overrides: Sequence[str]) -> int:
    from examples.arith.recipe import load_recipe

    recipe = load_recipe(config, [f"logger.log_dir={REPO_ROOT / 'logs' / 'capture_ab_probe'}", *overrides])
    return recipe.config.grpo.num_prompts_per_step


def wire_metrics_env(directory: Path) -> dict[str, str]:
    """The variables that turn the wire metrics on in every process of an arm, writing into `directory`."""
    return {INSTRUMENTATION_ENV: WIRE_METRICS_MODULE, WIRE_METRICS_DIR_ENV: str(directory)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.arm is not None:
        return arm_main(args)
    if args.synthetic_dir is not None:
        return synthetic_main(args)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runs: list[dict[str, Any]] = []

    def child(argv_: list[str], child_dir: Path, env: Mapping[str, str], tag: str, mark: str,
              end_mark: str | None = None) -> dict[str, Any]:
        if args.summarize_only:
            run_ = _load_json(child_dir / "run.json")
        else:
            run_ = _run_child(argv_, child_dir / "child.log", env, args.arm_timeout_s, tag, mark=mark, end_mark=end_mark)
        runs.append(run_)
        return run_

    results: dict[str, Any] = {"config": {
        "command": "uv run python benchmarks/capture_ab.py " + " ".join(
            a for a in (sys.argv[1:] if argv is None else argv) if a != "--summarize-only"),
        "config": _shown_path(args.config),
        "steps": args.steps, "skip_steps": args.skip_steps, "group_size": args.group_size, "repeats": args.repeats,
        "turns": args.turns, "finalizers": args.finalizers, "overrides": list(args.overrides),
        "cpus": os.cpu_count(),
    }}
    ab = syn = None
    if not args.skip_ab:
        in_flight = _num_prompts(args.config, args.overrides) * args.group_size
        arms: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for repeat in range(args.repeats):
            order = MODES if repeat % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                arm_dir = out / "arms" / f"{mode}_r{repeat}"
                if not args.summarize_only:
                    shutil.rmtree(arm_dir, ignore_errors=True)  # the logger appends: never mix two runs
                    arm_dir.mkdir(parents=True)
                    _log(f"arm {mode} repeat {repeat}: starting")
                env = {**os.environ, **wire_metrics_env(arm_dir / "wire")}
                run = child(["--arm", mode, "--arm-dir", str(arm_dir), *_child_args(args)], arm_dir, env,
                            f"{mode} r{repeat}", f"[step {args.skip_steps + 1}] dispatching",
                            f"[step {args.steps}] training")
                arms[mode].append(arm_summary(arm_dir, run, args.skip_steps, in_flight))
                _log(f"arm {mode} repeat {repeat}: done in {run['wall_s']:.0f}s "
                     f"(step_s median {arms[mode][-1]['phases_median_s'].get('timing/step_s', float('nan')):.2f})")
        ab = summarize_ab(arms)
        results["arms"] = {m: [{k: v for k, v in a.items() if k != "worker_call_samples"} for a in arms[m]]
                           for m in MODES}
    if not args.skip_synthetic:
        syn_dir = out / "synthetic"
        syn_dir.mkdir(parents=True, exist_ok=True)
        if not args.summarize_only:
            _log("synthetic part: starting")
        env = {k: v for k, v in os.environ.items() if k not in wire_metrics_env(syn_dir)}
        run = child(["--synthetic-dir", str(syn_dir), "--turns", ",".join(map(str, args.turns)),
                     "--finalizers", str(args.finalizers)], syn_dir, env, "synthetic", SYNTHETIC_MARK)
        syn = _load_json(syn_dir / "synthetic.json")
        syn["rss_peak_mib"] = run["rss_peak_mib"]
        syn["wall_s"] = run["wall_s"]
    results["ab"], results["synthetic"] = ab, syn
    results["top_level"] = top_level(ab, syn)
    results.update(results["top_level"])
    if not runs:
        raise BenchError("nothing to summarise: both --skip-ab and --skip-synthetic were given")
    results["config"]["load_before"] = runs[0]["load_before"]
    results["config"]["load_after"] = runs[-1]["load_after"]
    # The measuring time: this process's when it ran the children, theirs summed when only summarising.
    results["wall_time_s"] = round(sum(r["wall_s"] for r in runs) if args.summarize_only
                                   else time.monotonic() - started, 1)
    results["plots"] = write_plots(out, results)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_report(out / "report.md", results)
    _log(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plots "
         f"in {results['wall_time_s']:.0f}s")
    print(json.dumps(results["top_level"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
