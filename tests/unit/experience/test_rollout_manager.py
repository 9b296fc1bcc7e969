"""RolloutManager: always-N accounting, typed reasons, fresh ids, retention, cancellation."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.staging import CallRecord
from nemo_gym.token_id_capture.staging.records import ManifestFailure, RolloutManifest
from pydantic import ValidationError

from nemo_rl.environments.nemo_gym_config import GymRunTimeoutError, ManifestServerError
from nemo_rl.experience.rollout_manager import (
    AccountingError,
    RetentionError,
    RolloutManager,
    RolloutManagerConfig,
    account_group,
)
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.finalizer_pool import FinalizeOutcome
from nemo_rl.token_capture.rows import GroupResult, Placeholder, PlaceholderReason, RowOrigin, TrainRow

R = PlaceholderReason
# outcome kind -> expected entry (TrainRow, or the placeholder reason)
EXPECTED = {
    "success": TrainRow,
    "run_error": R.RUN_FAILED,
    "run_timeout": R.RUN_TIMEOUT,
    "gym_run_timeout": R.RUN_TIMEOUT,
    "manifest_error": R.MANIFEST_UNAVAILABLE,
    "manifest_timeout": R.MANIFEST_UNAVAILABLE,
    "empty_manifest": R.EMPTY_MANIFEST,
    "poisoned": R.CAPTURE_POISONED,
    "verify_fail": R.VERIFICATION_FAILED,
    "reward_missing": R.REWARD_MISSING,
}
NO_RECORDS = {"manifest_error", "manifest_timeout", "empty_manifest"}
_INDEX = re.compile(r"-i(\d+)-a\d+$")


def _index(rollout_id: str) -> int:
    return int(_INDEX.search(rollout_id).group(1))


async def _forever() -> None:
    await asyncio.Event().wait()


def _record(rollout_id: str) -> CallRecord:
    return CallRecord(
        model_call_id="c0", prev_len=0, delta_len=3, cum_len=3, weight_version=0, digest="0" * 64,
        extras_digest="0" * 64, staging_key=f"{rollout_id}/c0", mode="text", chain_hash="1" * 64,
        cumulative_hash="2" * 64, response_id=f"resp-{rollout_id}",
    )


def _echo_result(prompt: list[int], generated: list[int]) -> dict:
    item = {"id": "msg", "prompt_token_ids": prompt, "generation_token_ids": generated,
            "generation_log_probs": [-0.5] * len(generated)}
    return {"response": {"id": "resp", "output": [item]}, "reward": 1.0}


class ScriptedEnv:
    """A Gym environment whose rollout i behaves as script[i]."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.runs: list[str] = []
        self.manifests: list[str] = []
        self.retired: list[list[str]] = []

    async def run(self, rollout_id: str, row: dict) -> dict:
        self.runs.append(rollout_id)
        kind = self.script[_index(rollout_id)]
        if kind == "run_error":
            raise RuntimeError("agent exploded")
        if kind in ("run_timeout", "hang"):
            await _forever()
        if kind == "gym_run_timeout":
            raise GymRunTimeoutError(f"rollout {rollout_id!r}: agent /run did not answer within run_timeout_s=1")
        if kind == "legacy_ok":
            return _echo_result([1, 2], [3, 4])
        if kind == "legacy_missing":
            return {"response": {"output": []}, "reward": 0.0}
        return {"response": {"id": f"resp-{rollout_id}", "output": []},
                "reward": None if kind == "reward_missing" else 1.0}

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        self.manifests.append(rollout_id)
        kind = self.script[_index(rollout_id)]
        if kind == "manifest_error":
            raise ManifestServerError(f"rollout {rollout_id!r}: manifest answered HTTP 500")
        if kind == "manifest_timeout":
            await _forever()
        if kind == "empty_manifest":
            return RolloutManifest(rollout_id=rollout_id)
        failures = [ManifestFailure(model_call_id="c1", reason="worker_capture_failed")] if kind == "poisoned" else []
        return RolloutManifest(rollout_id=rollout_id, records=[_record(rollout_id)], failures=failures)

    def retire(self, rollout_ids: list[str]) -> list[str]:
        self.retired.append(list(rollout_ids))
        return []


class ScriptedFinalizer:
    """Finalizer pool fake: success -> a capture row, verify_fail -> verification_failed."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.items = []

    async def finalize_group(self, items):
        self.items.extend(items)
        outcomes = []
        for item in items:
            rid = item.receipt.rollout_id
            if self.script[item.sample_index] == "verify_fail":
                result = Placeholder(
                    rid, item.group_index, item.sample_index, R.VERIFICATION_FAILED, "corrupt_digest", 1.0
                )
            else:
                result = TrainRow(
                    rollout_id=rid, group_index=item.group_index, sample_index=item.sample_index,
                    token_ids=(1, 2, 3), token_mask=(0.0, 1.0, 1.0), generation_logprobs=(0.0, -0.1, -0.2),
                    reward=item.receipt.reward, prompt_len=1, model_call_ids=("c0",), weight_versions=(0,),
                    token_in_calls=0, text_root_calls=1, terminal_selection=item.receipt.terminal_selection,
                    origin=RowOrigin.CAPTURE,
                )
            outcomes.append(FinalizeOutcome(result, queue_wait_ms=float(item.sample_index)))
        return outcomes


class RecordingCleaner:
    """Records what it was asked to clear; reports `orphans` orphaned keys per call."""

    def __init__(self, error: Exception | None = None, delay_s: float = 0.0, orphans: int = 0) -> None:
        self.cleared: list[list[str]] = []
        self.rollout_ids: list[list[str]] = []
        self._error = error
        self._delay_s = delay_s
        self._orphans = orphans

    def clear(self, named_keys: list[str], rollout_ids: list[str]) -> int:
        time.sleep(self._delay_s)
        if self._error is not None:
            raise self._error
        self.cleared.append(list(named_keys))
        self.rollout_ids.append(list(rollout_ids))
        return self._orphans


def _config(*, enabled=True, run_timeout_s=0.05, retire=True, stage_timeout_s=1.0) -> RolloutManagerConfig:
    capture = TokenCaptureConfig(enabled=enabled, manifest_timeout_s=0.05, stage_timeout_s=stage_timeout_s,
                                 retire_after_commit=retire)
    return RolloutManagerConfig(run_id="run7", run_timeout_s=run_timeout_s, capture=capture)


def _manager(script, *, cleaner=None, **cfg):
    env, finalizer, cleaner = ScriptedEnv(script), ScriptedFinalizer(script), cleaner or RecordingCleaner()
    return RolloutManager(_config(**cfg), env, finalizer, cleaner), env, finalizer, cleaner


def _kind_of(entry):
    return TrainRow if isinstance(entry, TrainRow) else entry.reason


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(sorted(EXPECTED)), min_size=1, max_size=8), st.integers(0, 3), st.integers(0, 5))
def test_always_n_for_any_mix_of_outcomes(script, step, group_index):
    manager, env, finalizer, cleaner = _manager(script)
    group = asyncio.run(manager.run_group(step, group_index, {"prompt": "1+1"}, len(script)))

    ids = [f"run7-s{step}-g{group_index}-i{i}-a0" for i in range(len(script))]
    assert isinstance(group, GroupResult)
    assert group.n == len(script) == len(group.rows) + len(group.placeholders)
    assert [entry.rollout_id for entry in group.entries] == ids
    assert [_kind_of(entry) for entry in group.entries] == [EXPECTED[kind] for kind in script]
    assert sorted(env.runs) == sorted(ids)  # each reserved id dispatched exactly once
    assert sorted(env.manifests) == sorted(ids)  # failed runs too, so their staged keys are cleared
    assert [item.sample_index for item in finalizer.items] == [
        i for i, kind in enumerate(script) if kind in ("success", "verify_fail")]
    assert env.retired == [ids]
    assert cleaner.cleared == [[f"{rid}/c0" for rid, kind in zip(ids, script) if kind not in NO_RECORDS]]
    assert sorted(manager.take_queue_waits_ms()) == [float(item.sample_index) for item in finalizer.items]
    assert manager.take_aborted_groups() == []


async def test_placeholders_carry_reason_detail_and_reward():
    script = ["run_error", "gym_run_timeout", "run_timeout", "manifest_error", "poisoned", "empty_manifest"]
    manager, *_ = _manager(script)
    group = await manager.run_group(0, 0, {}, len(script))

    assert [(e.reason, e.detail, e.reward) for e in group.entries] == [
        (R.RUN_FAILED, "RuntimeError: agent exploded", None),
        (R.RUN_TIMEOUT,
         "GymRunTimeoutError: rollout 'run7-s0-g0-i1-a0': agent /run did not answer within run_timeout_s=1", None),
        (R.RUN_TIMEOUT, "no /run result within 0.05s", None),
        (R.MANIFEST_UNAVAILABLE, "ManifestServerError: rollout 'run7-s0-g0-i3-a0': manifest answered HTTP 500", 1.0),
        (R.CAPTURE_POISONED, "worker_capture_failed", 1.0),
        (R.EMPTY_MANIFEST, "empty_manifest", 1.0),
    ]
    assert group.entries[4].terminal_selection == "response_id"


async def test_a_retried_group_gets_fresh_ids():
    manager, env, *_ = _manager(["success", "success"])
    first = await manager.run_group(3, 1, {}, 2)
    second = await manager.run_group(3, 1, {}, 2)
    other_step = await manager.run_group(4, 1, {}, 2)

    assert [e.rollout_id for e in first.entries] == ["run7-s3-g1-i0-a0", "run7-s3-g1-i1-a0"]
    assert [e.rollout_id for e in second.entries] == ["run7-s3-g1-i0-a1", "run7-s3-g1-i1-a1"]
    assert [e.rollout_id for e in other_step.entries] == ["run7-s4-g1-i0-a0", "run7-s4-g1-i1-a0"]
    assert len(set(env.runs)) == 6


async def test_cancellation_mid_group_is_accounted_and_cleaned_up():
    manager, env, finalizer, cleaner = _manager(["run_error", "hang", "success"], run_timeout_s=30.0)
    task = asyncio.create_task(manager.run_group(0, 2, {}, 3))
    while len(env.manifests) < 2:  # rollouts 0 and 2 have finished; 1 hangs
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    (aborted,) = manager.take_aborted_groups()
    assert [(e.rollout_id, e.reason, e.detail) for e in aborted.entries] == [
        ("run7-s0-g2-i0-a0", R.RUN_FAILED, "RuntimeError: agent exploded"),
        ("run7-s0-g2-i1-a0", R.RUN_FAILED, "aborted"),
        ("run7-s0-g2-i2-a0", R.RUN_FAILED, "aborted"),
    ]
    assert env.retired == [["run7-s0-g2-i0-a0", "run7-s0-g2-i1-a0", "run7-s0-g2-i2-a0"]]
    assert cleaner.cleared == [["run7-s0-g2-i0-a0/c0", "run7-s0-g2-i2-a0/c0"]]
    assert finalizer.items == []


async def test_retention_failure_raises_with_the_accounted_group():
    manager, env, _, _ = _manager(["success"], cleaner=RecordingCleaner(error=ConnectionError("TQ controller gone")))
    with pytest.raises(RetentionError, match="clear staged keys: ConnectionError: TQ controller gone") as caught:
        await manager.run_group(0, 0, {}, 1)

    assert isinstance(caught.value.group.entries[0], TrainRow)
    assert env.retired == [["run7-s0-g0-i0-a0"]]


async def test_retention_has_a_deadline():
    slow = RecordingCleaner(delay_s=0.5)
    manager, *_ = _manager(["success"], cleaner=slow, stage_timeout_s=0.1)
    with pytest.raises(RetentionError, match=r"clear staged keys: no answer within token_capture.stage_timeout_s=0.1s"):
        await manager.run_group(0, 0, {}, 1)


async def test_orphaned_staged_keys_are_counted_per_take():
    manager, _, _, cleaner = _manager(["success", "run_error"], cleaner=RecordingCleaner(orphans=2))
    await manager.run_group(0, 0, {}, 2)
    await manager.run_group(0, 1, {}, 2)

    assert cleaner.rollout_ids == [
        ["run7-s0-g0-i0-a0", "run7-s0-g0-i1-a0"],
        ["run7-s0-g1-i0-a0", "run7-s0-g1-i1-a0"],
    ]
    assert manager.take_orphaned_staged_keys() == 4
    assert manager.take_orphaned_staged_keys() == 0


async def test_retention_can_be_turned_off():
    manager, env, _, cleaner = _manager(["success"], retire=False)
    await manager.run_group(0, 0, {}, 1)

    assert (env.retired, cleaner.cleared) == ([], [])


async def test_legacy_mode_builds_rows_from_the_token_echo():
    script = ["legacy_ok", "legacy_missing", "run_error", "run_timeout"]
    env = ScriptedEnv(script)
    manager = RolloutManager(_config(enabled=False), env)
    group = await manager.run_group(0, 0, {}, len(script))

    row = group.entries[0]
    assert (row.token_ids, row.token_mask, row.origin) == ((1, 2, 3, 4), (0.0, 0.0, 1.0, 1.0), RowOrigin.LEGACY)
    assert [_kind_of(e) for e in group.entries] == [TrainRow, R.LEGACY_TOKEN_ECHO_MISSING, R.RUN_FAILED, R.RUN_TIMEOUT]
    assert (env.manifests, env.retired) == ([], [])


def test_configuration_is_checked():
    with pytest.raises(ValidationError, match="run_id"):
        RolloutManagerConfig(run_id="bad id", run_timeout_s=1.0, capture=TokenCaptureConfig())
    with pytest.raises(ValueError, match="needs a finalizer"):
        RolloutManager(_config(enabled=True), ScriptedEnv([]))


async def test_group_size_must_be_positive():
    manager, *_ = _manager([])
    with pytest.raises(ValueError, match="n must be >= 1"):
        await manager.run_group(0, 0, {}, 0)


def test_account_group_rejects_misfiled_outcomes():
    stray = Placeholder("x-i0", 0, 0, R.RUN_FAILED, "boom")
    with pytest.raises(AccountingError, match="unknown sample indexes \\[5\\]"):
        account_group(0, ["x-i0"], {5: stray})
    with pytest.raises(AccountingError, match="outcome for x-i0, reserved y-i0"):
        account_group(0, ["y-i0"], {0: stray})
    filled = account_group(0, ["x-i0", "x-i1"], {0: stray})
    assert filled.entries[1] == Placeholder("x-i1", 0, 1, R.RUN_FAILED, "aborted")


async def test_a_finalizer_that_loses_items_is_an_accounting_error():
    class LosingFinalizer(ScriptedFinalizer):
        async def finalize_group(self, items):
            return (await super().finalize_group(items))[:-1]

    env, cleaner = ScriptedEnv(["success", "success"]), RecordingCleaner()
    manager = RolloutManager(_config(), env, LosingFinalizer(env.script), cleaner)
    with pytest.raises(AccountingError, match="1 outcomes for 2 items"):
        await manager.run_group(0, 0, {}, 2)
    assert env.retired == [["run7-s0-g0-i0-a0", "run7-s0-g0-i1-a0"]]  # retention still ran
