"""A step whose every rollout failed in the agent harness stops the run with a named, fatal error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import pytest

from nemo_rl.algorithms.errors import GRPOError
from nemo_rl.algorithms.failed_rollouts import (
    AllRolloutsFailedError,
    check_harness_failures,
    distinct_details,
    harness_failure_counts,
)
from nemo_rl.algorithms.grpo_single_controller import train_groups
from nemo_rl.data.errors import FatalError
from nemo_rl.data.rows import GroupResult, KeptRollout, Placeholder, PlaceholderReason, RowOrigin, TrainRow

R = PlaceholderReason
SCHEMA_400 = "agent /run answered HTTP 500: ... required_prefix_token_ids: Extra inputs are not permitted"


def _placeholder(group: int, i: int, reason: PlaceholderReason, detail: str = SCHEMA_400) -> Placeholder:
    return Placeholder(f"r{group}-{i}", group, i, reason, detail)


def _kept(group: int, i: int) -> KeptRollout:
    row = TrainRow(
        rollout_id=f"r{group}-{i}", group_index=group, sample_index=i, token_ids=(1, 2, 3),
        token_mask=(0.0, 1.0, 1.0), generation_logprobs=(0.0, -0.1, -0.2), reward=1.0, prompt_len=1,
        model_call_ids=("c0",), weight_versions=(0,), token_in_calls=0, text_root_calls=1,
        terminal_selection="response_id", origin=RowOrigin.CAPTURE, call_spans=((0, 3),),
    )
    return KeptRollout(f"r{group}-{i}", group, i, (row,), 1.0, "response_id")


def _group(index: int, *entries) -> GroupResult:
    return GroupResult(index, tuple(entries))


def _all_run_failed() -> list[GroupResult]:
    return [
        _group(0, _placeholder(0, 0, R.RUN_FAILED), _placeholder(0, 1, R.RUN_FAILED)),
        _group(1, _placeholder(1, 0, R.RUN_FAILED), _placeholder(1, 1, R.RUN_TIMEOUT, "no answer in 600 s")),
    ]


def test_every_rollout_a_harness_failure_is_counted_by_reason() -> None:
    assert harness_failure_counts(_all_run_failed()) == {"run_failed": 3, "run_timeout": 1}


def test_an_agent_whose_calls_were_never_captured_is_a_harness_failure() -> None:
    groups = [_group(0, *(_placeholder(0, i, R.EMPTY_MANIFEST, "no committed call and no failure row") for i in range(2)))]
    assert harness_failure_counts(groups) == {"empty_manifest": 2}


def test_one_kept_rollout_or_another_reason_is_not_a_harness_failure_step() -> None:
    one_kept = [_group(0, _placeholder(0, 0, R.RUN_FAILED), _kept(0, 1))]
    other_reason = [_group(0, _placeholder(0, 0, R.RUN_FAILED), _placeholder(0, 1, R.CAPTURE_POISONED))]
    assert harness_failure_counts(one_kept) is None
    assert harness_failure_counts(other_reason) is None
    assert harness_failure_counts([]) is None
    check_harness_failures(one_kept, 1)  # does not raise


def test_the_error_is_fatal_and_names_step_reasons_counts_and_distinct_details() -> None:
    with pytest.raises(AllRolloutsFailedError) as info:
        check_harness_failures(_all_run_failed(), 7)
    error = info.value
    assert isinstance(error, FatalError) and isinstance(error, GRPOError) and error.kind == "all_rollouts_failed"
    assert error.step == 7 and error.counts == {"run_failed": 3, "run_timeout": 1}
    assert error.details == [f"run_failed: {SCHEMA_400}", "run_timeout: no answer in 600 s"]
    text = str(error)
    assert "step 7" in text and "run_failed=3, run_timeout=1" in text and "Extra inputs are not permitted" in text


def test_details_are_cut_and_limited() -> None:
    groups = [_group(0, *(_placeholder(0, i, R.RUN_FAILED, f"error {i} " + "x" * 400) for i in range(5)))]
    details = distinct_details(groups, limit=2)
    assert len(details) == 2 and all(d.endswith("...<cut>") for d in details)


class _Logger:
    def __init__(self) -> None:
        self.lines: list[tuple[int, dict]] = []

    def log(self, step: int, metrics: dict) -> None:
        self.lines.append((step, dict(metrics)))


def _run() -> SimpleNamespace:
    cfg = SimpleNamespace(
        grpo=SimpleNamespace(normalize_rewards=True),
        token_capture=SimpleNamespace(enabled=False, train_partition="token_capture_train", max_consecutive_masked_steps=3),
    )
    return SimpleNamespace(cfg=cfg, logger=_Logger(), masked_streak=0, progress=lambda _m: None, watch=None,
                           train_cleaner=None, step_component_deaths={})


def test_the_loop_logs_the_step_then_stops_on_a_harness_failure_step() -> None:
    run = _run()
    metrics = {"rollouts/dispatched": 4.0, "finalize/kept_rollouts": 0.0, "finalize/placeholders": 4.0}
    with pytest.raises(AllRolloutsFailedError):
        asyncio.run(train_groups(run, 2, _all_run_failed(), metrics, clear=lambda _b: {}))
    assert [step for step, _ in run.logger.lines] == [2]
    assert run.logger.lines[0][1]["finalize/placeholders"] == 4.0  # the always-N accounting line is kept


def test_a_step_with_a_component_death_is_left_to_the_component_policy() -> None:
    run = _run()
    run.step_component_deaths = {"gym_policy_model": "exited with -9"}
    trained = asyncio.run(train_groups(run, 2, _all_run_failed(), {}, clear=lambda _b: {}))
    assert trained is False and run.masked_streak == 1


def test_the_loop_skips_a_step_masked_for_another_reason_within_its_streak() -> None:
    run = _run()
    groups = [_group(0, _placeholder(0, 0, R.CAPTURE_POISONED), _placeholder(0, 1, R.RUN_FAILED))]
    trained = asyncio.run(train_groups(run, 1, groups, {}, clear=lambda _b: {}))
    assert trained is False and run.masked_streak == 1 and run.logger.lines == []


def test_an_uncaught_fatal_error_exits_the_process_non_zero() -> None:
    code = (
        "from nemo_rl.algorithms.failed_rollouts import AllRolloutsFailedError\n"
        "raise AllRolloutsFailedError(1, {'run_failed': 4}, ['run_failed: boom'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "AllRolloutsFailedError: step 1: every rollout failed in the agent harness (run_failed=4)" in proc.stderr
