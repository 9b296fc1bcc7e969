"""RolloutManager: always-N accounting, typed reasons, fresh ids, retention, cancellation.

The manager decides nothing about a rollout's fate: every rollout goes to the finalizer as
`RolloutEvidence`, and the fake finalizer here runs the REAL judge (`judge_from_source`) over records
staged with Gym's `RolloutTokenCapture` (real digests), so the verdicts are the judge's own.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.staging import (
    CallRecord,
    CaptureAdmission,
    RolloutTokenCapture,
    StagedCallBaseSnapshot,
    StageResult,
)
from nemo_gym.token_id_capture.staging.records import ManifestFailure, RolloutManifest
from pydantic import ValidationError

from nemo_rl.data.rows import (
    CallLineage,
    GroupResult,
    KeptRollout,
    Placeholder,
    PlaceholderReason,
    RolloutYield,
    RowOrigin,
    TrainRow,
)
from nemo_rl.data.calls import ServedCall
from nemo_rl.data_plane.partitions import StagedKeysMissingError
from nemo_rl.environments.nemo_gym_config import GymRunError, GymRunTimeoutError, ManifestError
from nemo_rl.experience.errors import AccountingError
from nemo_rl.experience.finalizer_pool import FinalizeOutcome, judge_from_source
from nemo_rl.experience.rollout_manager import (
    RetentionError,
    RolloutManager,
    RolloutManagerConfig,
    account_group,
    enforce_min_valid_fraction,
)
from nemo_rl.models.generation.vllm.errors import WorkerError
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RunFailure

R = PlaceholderReason
# outcome kind -> expected entry (KeptRollout, or the placeholder reason)
EXPECTED = {
    "success": KeptRollout,
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


class _Sink:
    def __init__(self) -> None:
        self.records = {}

    def stage(self, record, *, attachments=None) -> StageResult:
        self.records[record.staging_key] = record
        return StageResult(ok=True, staging_key=record.staging_key)


def _staged_root(rollout_id: str) -> tuple[CallRecord, StagedCallBaseSnapshot]:
    """One text-root call `c0` staged through Gym's worker capture core: prompt (1, 2), sampled (3, 4)."""
    sink = _Sink()
    capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: 0)
    call = capture.begin_call(CaptureAdmission(rollout_id=rollout_id, model_call_id="c0", mode="text"))
    coords = capture.complete_call(call, prompt_token_ids=[1, 2], generated_token_ids=[3, 4],
                                   generated_logprobs=[-0.1, -0.2])
    record = CallRecord(
        model_call_id="c0", prev_len=0, delta_len=coords.delta_len, cum_len=coords.cum_len,
        weight_version=coords.weight_version, digest=coords.digest, extras_digest=coords.extras_digest,
        staging_key=coords.staging_key, mode="text", chain_hash=coords.chain_hash,
        cumulative_hash=coords.cumulative_hash, response_id=f"resp-{rollout_id}",
    )
    staged = sink.records[coords.staging_key]
    return record, StagedCallBaseSnapshot.model_validate(staged.model_dump(exclude={"extras"}))


def _record(rollout_id: str) -> CallRecord:
    return _staged_root(rollout_id)[0]


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
            raise GymRunError(f"rollout {rollout_id!r}: agent /run answered HTTP 500: agent exploded")
        if kind == "bug":
            raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")
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
            raise ManifestError(f"rollout {rollout_id!r}: manifest answered HTTP 500", kind="server")
        if kind == "manifest_timeout":
            await _forever()
        if kind == "empty_manifest":
            return RolloutManifest(rollout_id=rollout_id)
        failures = [ManifestFailure(model_call_id="c1", reason="worker_capture_failed")] if kind == "poisoned" else []
        return RolloutManifest(rollout_id=rollout_id, records=[_record(rollout_id)], failures=failures)

    def retire(self, rollout_ids: list[str]) -> list[str]:
        self.retired.append(list(rollout_ids))
        return []


class ScriptedSource:
    """The staging store: every rollout's staged c0 snapshot; verify_fail rollouts hold a tampered one."""

    def __init__(self, script: list[str]) -> None:
        self.script = script

    def fetch(self, staging_keys):
        out = []
        for key in staging_keys:
            rollout_id = key.split("/")[0]
            snapshot = _staged_root(rollout_id)[1]
            if self.script[_index(rollout_id)] == "verify_fail":
                snapshot = snapshot.model_copy(update={"token_ids_delta": [1, 2, 3, 9]})
            out.append(snapshot)
        return out


class ScriptedFinalizer:
    """Finalizer pool fake: the real judge over ScriptedSource; queue wait = sample index."""

    def __init__(self, script: list[str], cfg: TokenCaptureConfig | None = None) -> None:
        self.source = ScriptedSource(script)
        self.cfg = cfg or TokenCaptureConfig(enabled=True)
        self.items = []

    async def finalize_group(self, items):
        self.items.extend(items)
        return [FinalizeOutcome(judge_from_source(self.source, item, self.cfg), queue_wait_ms=float(item.sample_index))
                for item in items]


class ScriptedServed:
    """The workers' served report: c0 (2 generated tokens, staged) of every rollout whose manifest names it."""

    def __init__(self, script: list[str], error: Exception | None = None) -> None:
        self.script = script
        self.error = error
        self.asked: list[list[str]] = []

    async def take_served_async(self, rollout_ids):
        self.asked.append(list(rollout_ids))
        if self.error is not None:
            raise self.error
        return [ServedCall(rid, "c0", None, "text", 2, True) for rid in rollout_ids
                if self.script[_index(rid)] not in NO_RECORDS] + [ServedCall("someone-else", "c0", None, "text", 7, True)]


class RecordingCleaner:
    """Records what it was asked to clear; reports `orphans` orphaned keys per call."""

    def __init__(self, error: Exception | None = None, delay_s: float = 0.0, orphans: int = 0) -> None:
        self.cleared: list[list[str]] = []
        self.rollout_ids: list[list[str]] = []
        self.reported: list[list[str] | None] = []
        self._error = error
        self._delay_s = delay_s
        self._orphans = orphans

    def clear(self, named_keys: list[str], rollout_ids: list[str], reported_keys: list[str] | None) -> int:
        time.sleep(self._delay_s)
        if self._error is not None:
            raise self._error
        self.cleared.append(list(named_keys))
        self.rollout_ids.append(list(rollout_ids))
        self.reported.append(None if reported_keys is None else list(reported_keys))
        return self._orphans


def _config(*, enabled=True, run_timeout_s=0.05, retire=True, stage_timeout_s=1.0,
            min_valid=0.0) -> RolloutManagerConfig:
    capture = TokenCaptureConfig(enabled=enabled, manifest_timeout_s=0.05, stage_timeout_s=stage_timeout_s,
                                 retire_after_commit=retire, min_valid_fraction_per_group=min_valid)
    return RolloutManagerConfig(run_id="run7", run_timeout_s=run_timeout_s, capture=capture)


def _manager(script, *, cleaner=None, served=None, health=None, **cfg):
    config = _config(**cfg)
    env, finalizer, cleaner = ScriptedEnv(script), ScriptedFinalizer(script, config.capture), cleaner or RecordingCleaner()
    served = served or ScriptedServed(script)
    return RolloutManager(config, env, finalizer, cleaner, served, health), env, finalizer, cleaner


def _kind_of(entry):
    return KeptRollout if isinstance(entry, KeptRollout) else entry.reason


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(sorted(EXPECTED)), min_size=1, max_size=8), st.integers(0, 3), st.integers(0, 5))
def test_always_n_for_any_mix_of_outcomes(script, step, group_index):
    manager, env, finalizer, cleaner = _manager(script)
    group = asyncio.run(manager.run_group(step, group_index, {"prompt": "1+1"}, len(script)))

    ids = [f"run7-s{step}-g{group_index}-i{i}-a0" for i in range(len(script))]
    assert isinstance(group, GroupResult)
    assert group.n == len(script) == len(group.kept) + len(group.placeholders)
    assert len(group.rows) == len(group.kept)  # one chain per rollout here
    assert [entry.rollout_id for entry in group.entries] == ids
    assert [_kind_of(entry) for entry in group.entries] == [EXPECTED[kind] for kind in script]
    assert sorted(env.runs) == sorted(ids)  # each reserved id dispatched exactly once
    assert sorted(env.manifests) == sorted(ids)  # failed runs too, so their staged keys are cleared
    # Every rollout goes to the judge (the manager decides nothing), with the group's served report.
    assert [item.sample_index for item in finalizer.items] == list(range(len(script)))
    assert [item.served for item in finalizer.items] == [
        () if kind in NO_RECORDS else (ServedCall(rid, "c0", None, "text", 2, True),) for rid, kind in zip(ids, script)]
    for entry, kind in zip(group.entries, script):
        if kind == "success":
            assert entry.rows[0].token_ids == (1, 2, 3, 4)
            assert entry.yield_ == RolloutYield(2, 2, (), 1, lineage=CallLineage(0, 0, 0))
    assert env.retired == [ids]
    assert cleaner.cleared == [[f"{rid}/c0" for rid, kind in zip(ids, script) if kind not in NO_RECORDS]]
    assert cleaner.reported == cleaner.cleared  # the served report names the same staged keys, not someone-else's
    counters = manager.take_step_counters()
    assert sorted(counters.queue_waits_ms) == [float(item.sample_index) for item in finalizer.items]
    assert counters.aborted_groups == ()


async def test_placeholders_carry_reason_detail_and_reward():
    script = ["run_error", "gym_run_timeout", "run_timeout", "manifest_error", "poisoned", "empty_manifest"]
    manager, *_ = _manager(script)
    group = await manager.run_group(0, 0, {}, len(script))

    assert [(e.reason, e.detail, e.reward) for e in group.entries] == [
        (R.RUN_FAILED, "GymRunError: rollout 'run7-s0-g0-i0-a0': agent /run answered HTTP 500: agent exploded", None),
        (R.RUN_TIMEOUT,
         "GymRunTimeoutError: rollout 'run7-s0-g0-i1-a0': agent /run did not answer within run_timeout_s=1", None),
        (R.RUN_TIMEOUT, "no /run result within 0.05s", None),
        (R.MANIFEST_UNAVAILABLE, "ManifestError[server]: rollout 'run7-s0-g0-i3-a0': manifest answered HTTP 500", 1.0),
        # c1 was served without custody and the workers' report does not name it: fail closed.
        (R.CAPTURE_POISONED, "served_not_staged_unlocated: calls ['c1'] (['worker_capture_failed'])", 1.0),
        (R.EMPTY_MANIFEST, "no committed call and no failure row", 1.0),
    ]
    assert [e.terminal_selection for e in group.entries] == [None] * 6
    none = CallLineage(0, 0, 0)  # one text root per manifest; no lineage without the manifest
    assert [e.yield_ for e in group.entries] == [
        RolloutYield(2, 0, (("run_failed", 2),), lineage=none), RolloutYield(2, 0, (("run_timeout", 2),), lineage=none),
        RolloutYield(2, 0, (("run_timeout", 2),), lineage=none), RolloutYield(0, 0, ()),
        RolloutYield(2, 0, (("capture_poisoned", 2),), 1, lineage=none), RolloutYield(0, 0, (), lineage=none),
    ]


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

    (aborted,) = manager.take_step_counters().aborted_groups
    # Only the judge gives verdicts, after the whole group's evidence is in: a run that had already
    # failed never reached its verdict either, so every slot is "aborted".
    assert [(e.rollout_id, e.reason, e.detail) for e in aborted.entries] == [
        ("run7-s0-g2-i0-a0", R.RUN_FAILED, "aborted"),
        ("run7-s0-g2-i1-a0", R.RUN_FAILED, "aborted"),
        ("run7-s0-g2-i2-a0", R.RUN_FAILED, "aborted"),
    ]
    assert env.retired == [["run7-s0-g2-i0-a0", "run7-s0-g2-i1-a0", "run7-s0-g2-i2-a0"]]
    assert cleaner.cleared == [["run7-s0-g2-i0-a0/c0", "run7-s0-g2-i2-a0/c0"]]
    assert cleaner.reported == [None]  # cancelled before the served report: the cleaner must look itself
    assert finalizer.items == []


async def test_retention_failure_raises_with_the_accounted_group():
    manager, env, _, _ = _manager(["success"], cleaner=RecordingCleaner(error=ConnectionError("TQ controller gone")))
    with pytest.raises(RetentionError, match="clear staged keys: ConnectionError: TQ controller gone") as caught:
        await manager.run_group(0, 0, {}, 1)

    assert isinstance(caught.value.group.entries[0], KeptRollout)
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
    assert manager.take_step_counters().orphaned_staged_keys == 4
    assert manager.take_step_counters().orphaned_staged_keys == 0


async def test_retention_clears_the_staged_keys_the_served_report_names():
    # The manifest of rollout 1 could not be fetched, but its worker reports staging c0: the cleaner
    # gets that key as reported (an orphan to clear), and no key of another rollout.
    served = ScriptedServed(["success", "success"])
    manager, _, _, cleaner = _manager(["success", "manifest_error"], served=served)
    await manager.run_group(0, 0, {}, 2)
    assert cleaner.cleared == [["run7-s0-g0-i0-a0/c0"]]
    assert cleaner.reported == [["run7-s0-g0-i0-a0/c0", "run7-s0-g0-i1-a0/c0"]]


async def test_without_a_served_report_the_cleaner_gets_no_reported_keys():
    served = ScriptedServed(["success"], error=WorkerError("vLLM worker died during take_served: gone"))
    manager, _, _, cleaner = _manager(["success"], served=served)
    await manager.run_group(0, 0, {}, 1)
    assert (cleaner.cleared, cleaner.reported) == ([["run7-s0-g0-i0-a0/c0"]], [None])


async def test_retention_can_be_turned_off():
    manager, env, _, cleaner = _manager(["success"], retire=False)
    await manager.run_group(0, 0, {}, 1)

    assert (env.retired, cleaner.cleared) == ([], [])


async def test_legacy_mode_builds_rows_from_the_token_echo():
    script = ["legacy_ok", "legacy_missing", "run_error", "run_timeout"]
    env = ScriptedEnv(script)
    manager = RolloutManager(_config(enabled=False), env)
    group = await manager.run_group(0, 0, {}, len(script))

    (row,) = group.entries[0].rows
    assert (row.token_ids, row.token_mask, row.origin) == ((1, 2, 3, 4), (0.0, 0.0, 1.0, 1.0), RowOrigin.LEGACY)
    assert [_kind_of(e) for e in group.entries] == [KeptRollout, R.LEGACY_TOKEN_ECHO_MISSING, R.RUN_FAILED,
                                                    R.RUN_TIMEOUT]
    assert (env.manifests, env.retired) == ([], [])


def test_configuration_is_checked():
    with pytest.raises(ValidationError, match="run_id"):
        RolloutManagerConfig(run_id="bad id", run_timeout_s=1.0, capture=TokenCaptureConfig())
    with pytest.raises(ValueError, match="needs a finalizer"):
        RolloutManager(_config(enabled=True), ScriptedEnv([]))
    with pytest.raises(ValueError, match="served-call reporter"):
        RolloutManager(_config(enabled=True), ScriptedEnv([]), ScriptedFinalizer([]), RecordingCleaner())


async def test_group_size_must_be_positive():
    manager, *_ = _manager([])
    with pytest.raises(ValueError, match="n must be >= 1"):
        await manager.run_group(0, 0, {}, 0)


def test_account_group_rejects_misfiled_outcomes():
    stray = Placeholder("x-i0", 0, 0, R.RUN_FAILED, "boom")
    with pytest.raises(AccountingError, match="unknown sample indexes \\[5\\]") as excinfo:
        account_group(0, ["x-i0"], {5: stray})
    assert excinfo.value.kind == "outcome"
    with pytest.raises(AccountingError, match="outcome for x-i0, reserved y-i0") as excinfo:
        account_group(0, ["y-i0"], {0: stray})
    assert excinfo.value.kind == "outcome"
    filled = account_group(0, ["x-i0", "x-i1"], {0: stray})
    assert filled.entries[1] == Placeholder("x-i1", 0, 1, R.RUN_FAILED, "aborted")


async def test_a_finalizer_that_loses_items_is_an_accounting_error():
    class LosingFinalizer(ScriptedFinalizer):
        async def finalize_group(self, items):
            return (await super().finalize_group(items))[:-1]

    env, cleaner = ScriptedEnv(["success", "success"]), RecordingCleaner()
    manager = RolloutManager(_config(), env, LosingFinalizer(env.script), cleaner, ScriptedServed(env.script))
    with pytest.raises(AccountingError, match="1 outcomes for 2 items") as excinfo:
        await manager.run_group(0, 0, {}, 2)
    assert excinfo.value.kind == "outcome"
    assert env.retired == [["run7-s0-g0-i0-a0", "run7-s0-g0-i1-a0"]]  # retention still ran


# --- served report, min valid fraction, external harnesses ------------------------------------------


async def test_without_the_served_report_nothing_is_read_under_write_behind():
    # The report is the write-behind barrier: without it the group's rows may still be queued on a
    # worker, so no finalizer reads them; each rollout is a placeholder that names the report's error.
    script = ["success", "poisoned", "run_error"]
    served = ScriptedServed(script, error=WorkerError("vLLM worker take_served exceeded its 30s deadline"))
    manager, _, finalizer, cleaner = _manager(script, served=served)
    group = await manager.run_group(0, 0, {}, 3)

    assert finalizer.items == []  # nothing was read
    detail = ("the workers' served-call report is unavailable (WorkerError: vLLM worker take_served exceeded its 30s "
              "deadline), so nothing proves this rollout's staged rows were written "
              "(token_capture.stage_write=behind_reply): none is read")
    assert [(e.reason, e.detail, e.reward) for e in group.entries[:2]] == [
        (R.SERVED_REPORT_UNAVAILABLE, detail, 1.0), (R.SERVED_REPORT_UNAVAILABLE, detail, 1.0)]
    assert group.entries[2].reason == R.RUN_FAILED  # a failed run keeps its own reason
    assert group.entries[0].yield_ == RolloutYield(None, 0, (), 0)
    assert served.asked == [["run7-s0-g0-i0-a0", "run7-s0-g0-i1-a0", "run7-s0-g0-i2-a0"]]
    assert cleaner.reported == [None]  # retention still runs; the cleaner finds the orphans itself
    assert manager.take_step_counters().served_report_failures == 1
    assert manager.take_step_counters().served_report_failures == 0


async def test_without_the_served_report_the_judge_runs_under_before_reply():
    # Under before_reply every row was durable before its reply, so the judge reads and fails closed
    # where it needs the report.
    served = ScriptedServed(["success", "poisoned"], error=WorkerError("vLLM worker died during take_served: gone"))
    config = _config()
    config = config.model_copy(update={"capture": config.capture.model_copy(update={"stage_write": "before_reply"})})
    env, finalizer = ScriptedEnv(["success", "poisoned"]), ScriptedFinalizer(["success", "poisoned"], config.capture)
    manager = RolloutManager(config, env, finalizer, RecordingCleaner(), served)
    group = await manager.run_group(0, 0, {}, 2)

    assert [item.served for item in finalizer.items] == [None, None]
    assert isinstance(group.entries[0], KeptRollout)
    assert group.entries[0].yield_ == RolloutYield(None, 2, (), 1)
    assert (group.entries[1].reason, group.entries[1].detail) == (
        R.CAPTURE_POISONED, "served_not_staged_unlocated: calls ['c1'] (['worker_capture_failed'])")
    assert manager.take_step_counters().served_report_failures == 1


async def test_a_group_below_the_min_valid_fraction_is_dropped_whole_and_counted():
    manager, *_ = _manager(["success", "run_error", "run_error", "success"], min_valid=0.75)
    dropped = await manager.run_group(0, 0, {}, 4)
    manager_ok, *_ = _manager(["success", "run_error", "success", "success"], min_valid=0.75)
    kept = await manager_ok.run_group(0, 0, {}, 4)

    assert [(e.reason, e.reward) for e in dropped.entries] == [
        (R.GROUP_BELOW_MIN_VALID_FRACTION, 1.0), (R.RUN_FAILED, None), (R.RUN_FAILED, None),
        (R.GROUP_BELOW_MIN_VALID_FRACTION, 1.0)]
    assert dropped.entries[0].detail == "2/4 rollouts kept < token_capture.min_valid_fraction_per_group=0.75"
    assert dropped.entries[0].terminal_selection == "response_id"
    assert manager.take_step_counters().dropped_groups == 1 and manager.take_step_counters().dropped_groups == 0
    assert [_kind_of(e) for e in kept.entries] == [KeptRollout, R.RUN_FAILED, KeptRollout, KeptRollout]
    assert manager_ok.take_step_counters().dropped_groups == 0


def test_enforce_min_valid_fraction_keeps_groups_at_the_floor_and_all_placeholder_groups():
    kept = KeptRollout("a", 0, 0, (_kept_row("a"),), 1.0, "response_id")
    hole = Placeholder("b", 0, 1, R.RUN_FAILED, "boom")
    group = GroupResult(0, (kept, hole))
    empty = GroupResult(0, (Placeholder("a", 0, 0, R.RUN_FAILED, "x"), hole))

    assert enforce_min_valid_fraction(group, 0.5) is group
    assert enforce_min_valid_fraction(group, 0.0) is group
    assert enforce_min_valid_fraction(empty, 1.0) is empty  # nothing kept: nothing to drop
    assert enforce_min_valid_fraction(group, 0.51).entries == (
        Placeholder("a", 0, 0, R.GROUP_BELOW_MIN_VALID_FRACTION,
                    "1/2 rollouts kept < token_capture.min_valid_fraction_per_group=0.51", 1.0, "response_id"),
        hole)


def _kept_row(rollout_id):
    return TrainRow(
        rollout_id=rollout_id, group_index=0, sample_index=0, token_ids=(1, 2, 3), token_mask=(0.0, 1.0, 1.0),
        generation_logprobs=(0.0, -0.1, -0.2), reward=1.0, prompt_len=1, model_call_ids=("c0",),
        weight_versions=(0,), token_in_calls=0, text_root_calls=1, terminal_selection="response_id",
        origin=RowOrigin.CAPTURE, call_spans=((0, 3),),
    )


async def test_an_external_harness_reserves_ids_and_collects_its_outcomes():
    script = ["success", "run_error", "verify_fail"]
    manager, env, finalizer, cleaner = _manager(script)
    ids = manager.reserve(2, 1, 3)
    again = manager.reserve(2, 1, 3)
    outcomes = [{"response": {"id": f"resp-{ids[0]}", "output": []}, "reward": 1.0},
                RunFailure(R.RUN_TIMEOUT, "harness gave up after 30s"),
                {"response": {"id": f"resp-{ids[2]}", "output": []}, "reward": 0.0}]
    group = await manager.collect_group(1, ids, outcomes)

    assert ids == ["run7-s2-g1-i0-a0", "run7-s2-g1-i1-a0", "run7-s2-g1-i2-a0"]
    assert again == ["run7-s2-g1-i0-a1", "run7-s2-g1-i1-a1", "run7-s2-g1-i2-a1"]
    assert env.runs == []  # the harness ran them itself
    assert sorted(env.manifests) == ids
    assert [_kind_of(e) for e in group.entries] == [KeptRollout, R.RUN_TIMEOUT, R.VERIFICATION_FAILED]
    assert (group.entries[1].detail, group.entries[2].detail, group.entries[2].reward) == (
        "harness gave up after 30s", "corrupt_digest", 0.0)
    assert [item.rollout_id for item in finalizer.items] == ids
    assert env.retired == [ids]
    assert cleaner.cleared == [[f"{rid}/c0" for rid in ids]]


async def test_collect_group_checks_its_inputs():
    manager, *_ = _manager(["success"])
    with pytest.raises(ValueError, match="1 run outcomes for 2 rollout ids"):
        await manager.collect_group(0, ["a", "b"], [{}])
    legacy = RolloutManager(_config(enabled=False), ScriptedEnv(["success"]))
    with pytest.raises(ValueError, match="collect_group needs token_capture.enabled=true"):
        await legacy.collect_group(0, ["a"], [{}])


async def test_missing_staged_records_are_the_judges_verdict():
    class EmptySource:
        def fetch(self, staging_keys):
            raise StagedKeysMissingError("staging", staging_keys)

    manager, _, finalizer, _ = _manager(["success"])
    finalizer.source = EmptySource()
    group = await manager.run_group(0, 0, {}, 1)

    assert group.entries[0].reason is R.STAGED_RECORD_MISSING
    assert group.entries[0].detail.startswith("run7-s0-g0-i0-a0/c0: staging keys not found")


@pytest.mark.parametrize("enabled", [True, False])
async def test_a_bug_in_a_run_propagates_instead_of_becoming_a_placeholder(enabled: bool):
    # Only the environment's named failures (GymRunError, GymRunTimeoutError) are verdicts; a
    # TypeError is our bug and must abort the step with its traceback, retention still run.
    if enabled:
        manager, env, _, _ = _manager(["success", "bug"])
    else:
        env = ScriptedEnv(["legacy_ok", "bug"])
        manager = RolloutManager(_config(enabled=False), env)
    with pytest.raises(TypeError, match="unsupported operand"):
        await manager.run_group(0, 0, {}, 2)
    assert env.retired == ([["run7-s0-g0-i0-a0", "run7-s0-g0-i1-a0"]] if enabled else [])


async def test_a_failed_worker_aborts_instead_of_degrading_the_served_report():
    from nemo_rl.models.generation.vllm.errors import WorkerFailedError

    served = ScriptedServed(["success"], error=WorkerFailedError("vLLM worker 0 is failed: engine dead"))
    manager, *_ = _manager(["success"], served=served)
    with pytest.raises(WorkerFailedError, match="engine dead"):
        await manager.run_group(0, 0, {}, 1)
    assert manager.take_step_counters().served_report_failures == 0


# --- component deaths (the component watch's view, faked) --------------------------------------


class FakeHealth:
    """The watch as the manager sees it; `found_on_poll` dies when the manager asks for a round."""

    def __init__(self, down: dict[str, str] | None = None, found_on_poll: dict[str, str] | None = None) -> None:
        self._down = dict(down or {})
        self._found_on_poll = dict(found_on_poll or {})
        self.rollout_path_down = asyncio.Event()
        self.polls = 0
        if self._down:
            self.rollout_path_down.set()

    def down(self) -> dict[str, str]:
        return dict(self._down)

    async def poll(self) -> None:
        self.polls += 1
        self._down.update(self._found_on_poll)
        if self._down:
            self.rollout_path_down.set()

    def kill(self, name: str, detail: str) -> None:
        self._down[name] = detail
        self.rollout_path_down.set()


GATE_DEATH = "Gym server policy_model (pid 12) killed by SIGKILL"
# A death ends the runs in flight when the watch's event fires (no polling between): this bound is a
# margin on a loaded machine, two orders below the 600 s run deadline the tests below configure.
DEATH_NOTICE_S = 5.0


async def test_runs_in_flight_end_at_once_when_a_rollout_path_component_dies():
    health = FakeHealth()
    manager, env, finalizer, cleaner = _manager(["hang", "success", "hang"], run_timeout_s=600.0, health=health)
    task = asyncio.create_task(manager.run_group(2, 0, {}, 3))
    while len(env.runs) < 3:
        await asyncio.sleep(0.01)
    health.kill("gate", GATE_DEATH)
    group = await asyncio.wait_for(task, DEATH_NOTICE_S)  # not the 600 s run deadline

    assert [_kind_of(e) for e in group.entries] == [R.COMPONENT_FAILED, KeptRollout, R.COMPONENT_FAILED]
    assert group.entries[0].detail == f"gate died: {GATE_DEATH}"
    assert len(finalizer.items) == 3 and len(cleaner.cleared) == 1  # judged and retired like any group


async def test_a_run_that_starts_while_a_component_is_down_fails_without_dispatch():
    health = FakeHealth(down={"vllm_worker_0": "vLLM worker 0 (Ray actor) is gone: killed", "gate": GATE_DEATH})
    manager, env, _, _ = _manager(["success", "success"], health=health)
    group = await manager.run_group(0, 0, {}, 2)

    assert env.runs == []
    assert [(e.reason, e.detail) for e in group.entries] == [
        (R.COMPONENT_FAILED, f"gate died: {GATE_DEATH}; vllm_worker_0 died: vLLM worker 0 (Ray actor) is gone: killed"),
    ] * 2


async def test_a_failed_run_asks_the_watch_before_blaming_the_rollout():
    health = FakeHealth(found_on_poll={"gate": GATE_DEATH})
    manager, _, _, _ = _manager(["run_error"], health=health)
    (entry,) = (await manager.run_group(0, 0, {}, 1)).entries

    assert health.polls == 1
    assert entry.reason is R.COMPONENT_FAILED
    assert entry.detail.startswith(f"gate died: {GATE_DEATH} (the run reported: GymRunError: rollout ")


async def test_a_failed_run_with_every_component_alive_stays_the_rollouts_failure():
    health = FakeHealth()
    manager, _, _, _ = _manager(["run_error", "success"], health=health)
    group = await manager.run_group(0, 0, {}, 2)

    assert health.polls == 1  # only the failed run asked
    assert [_kind_of(e) for e in group.entries] == [R.RUN_FAILED, KeptRollout]


async def test_retention_failure_while_a_component_is_down_is_counted_not_raised():
    health = FakeHealth()
    cleaner = RecordingCleaner(error=ConnectionError("storage unit gone"))
    manager, env, _, _ = _manager(["hang"], cleaner=cleaner, health=health, run_timeout_s=600.0)
    task = asyncio.create_task(manager.run_group(0, 0, {}, 1))
    while not env.runs:  # the rollout is running when the storage unit dies
        await asyncio.sleep(0.01)
    health.kill("tq_storage_unit_0", "TransferQueue storage_unit_0 (Ray actor) is gone: killed")
    group = await asyncio.wait_for(task, DEATH_NOTICE_S)

    assert group.entries[0].reason is R.COMPONENT_FAILED
    assert (manager.take_step_counters().retention_failures, manager.take_step_counters().retention_failures) == (1, 0)



ENGINE_CORE_DEATH = "vLLM worker 0 engine core EngineCore (pid 77) killed by SIGKILL"


async def test_a_failed_worker_is_a_death_only_when_the_watch_finds_a_worker_or_its_engine_core_dead():
    from nemo_rl.models.generation.vllm.errors import WorkerFailedError

    # A dead gate does not explain a failed worker: still an abort.
    served = ScriptedServed(["success"], error=WorkerFailedError("vLLM worker 0 is failed: a bug"))
    manager, *_ = _manager(["success"], served=served, health=FakeHealth(found_on_poll={"gate": GATE_DEATH}))
    with pytest.raises(WorkerFailedError, match="a bug"):
        await manager.run_group(0, 0, {}, 1)
    assert manager.take_step_counters().served_report_failures == 0

    # Its engine core found dead: that death, the report unavailable (counted), the group accounted.
    health = FakeHealth(found_on_poll={"vllm_worker_0/engine_core": ENGINE_CORE_DEATH})
    served = ScriptedServed(["success"], error=WorkerFailedError("vLLM worker 0 is failed, take_served refused: dead"))
    manager, _, finalizer, _ = _manager(["success"], served=served, health=health)
    group = await manager.run_group(0, 0, {}, 1)

    assert health.polls == 1  # the manager asked for a round before deciding
    assert manager.take_step_counters().served_report_failures == 1
    # Under behind_reply (the default) nothing proves the rows were written: none is read, and the
    # placeholder names the death the watch found.
    assert finalizer.items == []
    assert group.n == 1 and group.entries[0].reason is R.SERVED_REPORT_UNAVAILABLE
    assert ENGINE_CORE_DEATH in group.entries[0].detail


def test_step_counters_are_one_record_with_the_metric_names_of_the_step_line() -> None:
    from nemo_rl.experience.rollout_manager import StepCounters

    counters = StepCounters(queue_waits_ms=(1.0,), orphaned_staged_keys=2, dropped_groups=1,
                            served_report_failures=3, retention_failures=4)
    assert counters.metrics(retention=True) == {
        "finalize/orphaned_staged_keys": 2.0, "finalize/dropped_groups": 1.0,
        "finalize/served_report_failures": 3.0, "retention/failures": 4.0,
    }
    assert "retention/failures" not in counters.metrics(retention=False)
    with pytest.raises(ValueError, match="cannot be negative"):
        StepCounters(dropped_groups=-1)


async def test_run_group_as_runs_under_the_given_ids_with_the_same_accounting():
    manager, env, _, cleaner = _manager(["success", "run_error"])
    ids = ["run7-s2-g1-i0-a3", "run7-s2-g1-i1-a3"]
    group = await manager.run_group_as(1, ids, {})
    assert manager.run_id == "run7"
    assert [e.rollout_id for e in group.entries] == ids
    assert (group.group_index, len(group.kept), len(group.placeholders)) == (1, 1, 1)
    assert sorted(env.runs) == ids
    assert env.retired == [ids]


@pytest.mark.parametrize("ids", [[], ["a-i0", "a-i0"], ["-bad"]])
async def test_run_group_as_refuses_ids_that_could_not_be_accounted(ids):
    manager, env, _, _ = _manager(["success"])
    with pytest.raises(ValueError):
        await manager.run_group_as(0, ids, {})
    assert env.runs == []
