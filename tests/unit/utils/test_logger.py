"""MetricsLogger, Timer and progress: JSONL contents, stdout format, TensorBoard on/off."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nemo_rl.utils.logger import (
    LoggerConfig,
    MetricsError,
    MetricsLogger,
    Timer,
    format_line,
    progress,
)

STDOUT_KEYS = ["reward/mean", "finalize/rows", "timing/step_s"]


def make_logger(tmp_path: Path, tensorboard: bool = False) -> MetricsLogger:
    cfg = LoggerConfig(
        log_dir=str(tmp_path / "logs"), tensorboard_enabled=tensorboard, stdout_keys=STDOUT_KEYS
    )
    return MetricsLogger(cfg)


def test_writes_one_sorted_line_per_step(tmp_path: Path) -> None:
    with make_logger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"z/last": step * 0.5, "a/first": step, "reward/mean": 0.25})
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5
    for step, line in enumerate(lines, start=1):
        record = json.loads(line)
        assert list(record) == ["a/first", "reward/mean", "step", "z/last"]
        assert record == {"a/first": step, "reward/mean": 0.25, "step": step, "z/last": step * 0.5}


def test_appends_across_loggers(tmp_path: Path) -> None:
    with make_logger(tmp_path) as logger:
        logger.log(1, {"x": 1})
    with make_logger(tmp_path) as logger:
        logger.log(2, {"x": 2})
    steps = [json.loads(x)["step"] for x in logger.metrics_path.read_text().splitlines()]
    assert steps == [1, 2]


def test_stdout_line_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with make_logger(tmp_path) as logger:
        logger.log(
            1,
            {"timing/step_s": 12.34, "finalize/rows": 8, "reward/mean": 0.25, "unshown": 3.0},
        )
        logger.log(2, {"reward/mean": 0.00001})
    assert capsys.readouterr().out.splitlines() == [
        "step 1 | reward/mean 0.250 | finalize/rows 8 | timing/step_s 12.3",
        "step 2 | reward/mean 1.000e-05",
    ]


def test_format_line_uses_configured_order() -> None:
    assert format_line(3, {"b": 2, "a": 1.5}, ["b", "a", "c"]) == "step 3 | b 2 | a 1.500"


def test_default_stdout_keys_and_required_log_dir() -> None:
    assert LoggerConfig(log_dir="x").stdout_keys[0] == "reward/mean"
    assert LoggerConfig(log_dir="x").tensorboard_enabled is False
    with pytest.raises(ValidationError, match="log_dir"):
        LoggerConfig()  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        LoggerConfig(log_dir="x", tensorbord=True)  # type: ignore[call-arg]


def test_no_tensorboard_dir_when_disabled(tmp_path: Path) -> None:
    with make_logger(tmp_path) as logger:
        logger.log(1, {"x": 1.0})
    assert not (tmp_path / "logs" / "tensorboard").exists()


def test_tensorboard_event_file_when_enabled(tmp_path: Path) -> None:
    with make_logger(tmp_path, tensorboard=True) as logger:
        logger.log(1, {"reward/mean": 0.5})
        logger.log(2, {"reward/mean": 0.75})
    events = list((tmp_path / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(str(events[0]))
    accumulator.Reload()
    scalars = [(e.step, e.value) for e in accumulator.Scalars("reward/mean")]
    assert scalars == [(1, 0.5), (2, 0.75)]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rejected_and_nothing_written(tmp_path: Path, bad: float) -> None:
    with make_logger(tmp_path) as logger:
        with pytest.raises(MetricsError) as e:
            logger.log(4, {"ok": 1.0, "reward/mean": bad})
    assert str(e.value).startswith(f"step 4: metric reward/mean={bad!r} is not finite")
    assert logger.metrics_path.read_text() == ""


@pytest.mark.parametrize(
    ("metrics", "fragment"),
    [
        ({"flag": True}, "metric flag=True has type bool"),
        ({"s": "1"}, "metric s='1' has type str"),
        ({"n": None}, "metric n=None has type NoneType"),
        ({"step": 1}, "'step' is reserved"),
        ({"": 1}, "metric key '' must be a non-empty string"),
    ],
)
def test_bad_metrics_rejected(tmp_path: Path, metrics: dict, fragment: str) -> None:
    with make_logger(tmp_path) as logger:
        with pytest.raises(MetricsError, match=fragment):
            logger.log(1, metrics)


@pytest.mark.parametrize("step", [-1, True, 1.0])
def test_bad_step_rejected(tmp_path: Path, step: object) -> None:
    with make_logger(tmp_path) as logger:
        with pytest.raises(MetricsError, match="must be a non-negative int"):
            logger.log(step, {"x": 1})  # type: ignore[arg-type]


def test_log_after_close_is_an_error(tmp_path: Path) -> None:
    logger = make_logger(tmp_path)
    logger.close()
    logger.close()
    with pytest.raises(MetricsError, match="after close"):
        logger.log(1, {"x": 1})


def test_timer_records_timing_key() -> None:
    metrics: dict[str, float] = {}
    now = [10.0]
    with Timer("step_s", metrics, clock=lambda: now[0]) as t:
        now[0] += 1.5
        assert t.elapsed_s == 1.5  # while running: up to now
        now[0] += 0.75
    now[0] += 100.0  # after exit the reading stays
    assert metrics == {"timing/step_s": 2.25} and t.elapsed_s == 2.25
    with pytest.raises(ValueError, match="without the 'timing/' prefix"):
        Timer("timing/x")


def test_progress_is_rate_limited_per_label() -> None:
    now = [100.0]
    out = io.StringIO()

    def call(label: str, done: int, total: int) -> bool:
        return progress(label, done, total, min_interval_s=5.0, clock=lambda: now[0], out=out)

    assert call("finalize", 0, 4) is True
    now[0] = 102.0
    assert call("finalize", 1, 4) is False
    assert call("rollout", 1, 10) is True  # another label has its own limit
    now[0] = 106.0
    assert call("finalize", 2, 4) is True
    now[0] = 106.5
    assert call("finalize", 4, 4) is True  # the final line is never suppressed
    assert call("finalize", 0, 2) is True  # a completed label starts a fresh phase
    assert out.getvalue().splitlines() == [
        "[progress] finalize: 0/4 (0%) elapsed 0.0s",
        "[progress] rollout: 1/10 (10%) elapsed 0.0s",
        "[progress] finalize: 2/4 (50%) elapsed 6.0s",
        "[progress] finalize: 4/4 (100%) elapsed 6.5s",
        "[progress] finalize: 0/2 (0%) elapsed 0.0s",
    ]
    with pytest.raises(ValueError, match="need 0 <= done <= total"):
        call("x", 3, 2)


def test_run_info_is_replaced_whole_and_jsonl_records_are_appended(tmp_path: Path) -> None:
    from nemo_rl.utils.logger import FIRST_CALL_PROMPTS_FILE, RUN_INFO_FILE, append_jsonl, write_run_info

    log_dir = tmp_path / "new" / "logs"
    assert write_run_info(log_dir, {"b": 1, "a": {"x": [1, 2]}}) == log_dir / RUN_INFO_FILE
    write_run_info(log_dir, {"c": 2})  # replaces, never merges
    assert json.loads((log_dir / RUN_INFO_FILE).read_text()) == {"c": 2}
    assert sorted(p.name for p in log_dir.iterdir()) == [RUN_INFO_FILE]  # no temp file left
    with pytest.raises(ValueError):
        write_run_info(log_dir, {"bad": math.nan})
    assert sorted(p.name for p in log_dir.iterdir()) == [RUN_INFO_FILE]
    assert json.loads((log_dir / RUN_INFO_FILE).read_text()) == {"c": 2}  # the old record survives

    dump = log_dir / FIRST_CALL_PROMPTS_FILE
    append_jsonl(dump, [{"step": 1, "prompt_ids": [3, 4]}, {"step": 1, "prompt_ids": None}])
    append_jsonl(dump, [{"step": 2, "prompt_ids": [5]}])
    with pytest.raises(ValueError):
        append_jsonl(dump, [{"step": 3, "prompt_ids": [6]}, {"step": 3, "loss": math.inf}])
    assert dump.read_text() == ('{"prompt_ids": [3, 4], "step": 1}\n{"prompt_ids": null, "step": 1}\n'
                                '{"prompt_ids": [5], "step": 2}\n')


def test_first_call_prompt_dump_is_off_by_default_and_strictly_boolean() -> None:
    assert LoggerConfig(log_dir="x").dump_first_call_prompt_ids is False
    assert LoggerConfig(log_dir="x", dump_first_call_prompt_ids=True).dump_first_call_prompt_ids is True
    with pytest.raises(ValidationError, match="dump_first_call_prompt_ids"):
        LoggerConfig(log_dir="x", dump_first_call_prompt_ids="yes")
