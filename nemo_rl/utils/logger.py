"""Metrics logging: one JSONL line per step, a compact stdout line, optional TensorBoard.

`MetricsLogger(cfg).log(step, metrics)` appends exactly one JSON object to
`<log_dir>/metrics.jsonl`, fsync'd before it returns (append mode: a resumed run keeps its
history). Refuses a value that is not a finite real number, or a metric called `step`, with a
`MetricsError` naming key and step, and writes nothing then. Also: `write_run_info` (atomic),
`append_jsonl` (fsync'd), `Timer` and a rate-limited `progress` line.
See docs/guides/token-capture.md, "The metrics logger and run records".
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel, ConfigDict, Field

from nemo_rl.data.errors import FatalError

METRICS_FILE = "metrics.jsonl"
RUN_INFO_FILE = "run_info.json"
FIRST_CALL_PROMPTS_FILE = "first_call_prompt_ids.jsonl"
TENSORBOARD_DIR = "tensorboard"
TIMING_PREFIX = "timing/"


class MetricsError(FatalError, ValueError):
    """A metrics record is invalid or the logger is used after `close()`."""


class LoggerConfig(BaseModel):
    """The `logger` recipe section."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    log_dir: str = Field(
        min_length=1, description="Directory for metrics.jsonl and the tensorboard/ subfolder."
    )
    tensorboard_enabled: bool = Field(
        default=False, description="Also write every metric as a TensorBoard scalar."
    )
    stdout_keys: list[str] = Field(
        default_factory=lambda: [
            "reward/mean",
            "finalize/rows",
            "finalize/token_in_rate",
            "finalize/invalid_row_rate",
            "finalize/capture_poisoned_rollouts",
            "train/loss",
            "token_mult_prob_error",
            "timing/step_s",
        ],
        description="Metric keys shown, in this order, on the compact per-step stdout line.",
    )
    dump_first_call_prompt_ids: bool = Field(
        default=False,
        description=(
            f"Append the prompt ids of every training row's first model call, per step, to "
            f"<log_dir>/{FIRST_CALL_PROMPTS_FILE} (capture: from the verified rows; legacy: from "
            "Gym's token echo). The L1 test compares them between the two legs."
        ),
    )


def check_metrics(step: int, metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """Validate one step's metrics; return them as plain JSON numbers."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise MetricsError(f"step={step!r} must be a non-negative int")
    clean: dict[str, int | float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise MetricsError(f"step {step}: metric key {key!r} must be a non-empty string")
        if key == "step":
            raise MetricsError(
                f"step {step}: 'step' is reserved for the step number; rename that metric"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise MetricsError(
                f"step {step}: metric {key}={value!r} has type {type(value).__name__}; "
                f"metrics must be int or float (fix: convert it, e.g. float(x) or int(flag))"
            )
        if isinstance(value, numbers.Integral):
            clean[key] = int(value)
        elif not math.isfinite(float(value)):
            raise MetricsError(
                f"step {step}: metric {key}={float(value)!r} is not finite; metrics must be "
                f"finite (fix: find where {key} became nan/inf, or do not log it this step)"
            )
        else:
            clean[key] = float(value)
    return clean


def format_value(key: str, value: int | float) -> str:
    """Compact human form: ints as is, timings to 0.1 s, other floats to 3 decimals."""
    if isinstance(value, int):
        return str(value)
    if key.startswith(TIMING_PREFIX):
        return f"{value:.1f}"
    if value != 0 and not 1e-3 <= abs(value) < 1e6:
        return f"{value:.3e}"
    return f"{value:.3f}"


def format_line(step: int, metrics: Mapping[str, int | float], keys: list[str]) -> str:
    """`step 1 | reward/mean 0.250 | ... | timing/step_s 12.3` with the `keys` present."""
    parts = [f"step {step}"]
    parts += [f"{k} {format_value(k, metrics[k])}" for k in keys if k in metrics]
    return " | ".join(parts)


class MetricsLogger:
    """Writes per-step metrics to JSONL, stdout and (optionally) TensorBoard."""

    def __init__(self, cfg: LoggerConfig, out: TextIO | None = None) -> None:
        self._cfg = cfg
        self._out = out
        log_dir = Path(cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(log_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._writer: Any = None
        if cfg.tensorboard_enabled:
            # Imported only when enabled: torch's import costs seconds that a disabled logger
            # (and every unit test that does not need it) should not pay.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(log_dir / TENSORBOARD_DIR))
        self._closed = False

    @property
    def metrics_path(self) -> Path:
        return Path(self._cfg.log_dir) / METRICS_FILE

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._closed:
            raise MetricsError(f"step {step}: MetricsLogger.log called after close()")
        clean = check_metrics(step, metrics)
        record = {"step": int(step), **clean}
        self._file.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        print(format_line(int(step), clean, self._cfg.stdout_keys), file=self._out or sys.stdout,
              flush=True)
        if self._writer is not None:
            for key, value in clean.items():
                self._writer.add_scalar(key, value, int(step))
            self._writer.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._file.close()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_run_info(log_dir: str | Path, info: Mapping[str, Any]) -> Path:
    """Write `info` as `<log_dir>/run_info.json` (keys sorted), atomically: readers never see half a file."""
    text = json.dumps(dict(info), sort_keys=True, indent=1, allow_nan=False) + "\n"  # fails before any file
    path = Path(log_dir) / RUN_INFO_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def append_jsonl(path: str | Path, records: list[Mapping[str, Any]]) -> None:
    """Append one JSON line per record to `path` (created with its folder if absent), fsync'd."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(dict(record), sort_keys=True, allow_nan=False) + "\n" for record in records)
    with open(path, "a", encoding="utf-8") as f:  # one write: a rejected record appends nothing
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl_objects(path: Path, error: type[Exception]) -> list[dict[str, Any]]:
    """The JSON objects of `path`, one per non-blank line; a bad line raises `error` naming file:line."""
    records: list[dict[str, Any]] = []
    for number, text in enumerate(Path(path).read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise error(f"{path}:{number} is not JSON ({e.msg}); the file may be truncated") from e
        if not isinstance(record, dict):
            raise error(f"{path}:{number} is a JSON {type(record).__name__}, not an object")
        records.append(record)
    return records


def metrics_by_step(lines: Iterable[str], error: type[Exception]) -> list[dict[str, Any]]:
    """metrics.jsonl lines as records in step order; a line without an integer `step`, or a step
    seen twice (a reused log dir mixes runs), raises `error` naming the line."""
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int):
            raise error(f"metrics.jsonl line {number} has no integer 'step': {line[:200]}")
        if step in by_step:
            raise error(f"metrics.jsonl line {number}: step {step} appears twice (a reused log dir mixes runs)")
        by_step[step] = record
    return [by_step[k] for k in sorted(by_step)]


class Timer:
    """`with Timer("step_s", metrics): ...` sets `metrics["timing/step_s"]` to seconds elapsed on `clock`."""

    def __init__(self, name: str, into: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not name or name.startswith(TIMING_PREFIX):
            raise ValueError(
                f"Timer name {name!r} must be non-empty and given without the "
                f"'{TIMING_PREFIX}' prefix (it is added)"
            )
        self.key = TIMING_PREFIX + name
        self._into = into
        self._clock = clock
        self._start: float | None = None
        self._end: float | None = None

    @property
    def elapsed_s(self) -> float:
        """Seconds from enter to exit (or to now, while running)."""
        if self._start is None:
            raise RuntimeError(f"Timer {self.key} was never started")
        end = self._end if self._end is not None else self._clock()
        return end - self._start

    def __enter__(self) -> Timer:
        self._start = self._clock()
        self._end = None
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = self._clock()
        if self._into is not None:
            self._into[self.key] = self.elapsed_s


_progress_lock = threading.Lock()
# label -> (phase start, last print); a label leaves the table when its phase completes.
_progress_state: dict[str, tuple[float, float]] = {}


def progress(
    label: str,
    done: int,
    total: int,
    *,
    min_interval_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    out: TextIO | None = None,
) -> bool:
    """Print a progress line for a long phase, rate-limited per label; return whether printed."""
    if total <= 0 or not 0 <= done <= total:
        raise ValueError(f"progress({label!r}): need 0 <= done <= total and total > 0, "
                         f"got done={done}, total={total}")
    now = clock()
    with _progress_lock:
        start, last = _progress_state.get(label, (now, -math.inf))
        final = done == total
        if not final and now - last < min_interval_s:
            return False
        if final:
            _progress_state.pop(label, None)
        else:
            _progress_state[label] = (start, now)
    pct = 100.0 * done / total
    print(f"[progress] {label}: {done}/{total} ({pct:.0f}%) elapsed {now - start:.1f}s",
          file=out or sys.stdout, flush=True)
    return True
