"""Dispatch GRPO groups to a rollout environment and account for every rollout (always-N).

Owns `RolloutManager.run_group` / `collect_group` (capture mode: runs, manifests, the workers'
served report, evidence to the finalizer pool; legacy mode: rows from Gym's token echo), group
retention and `take_step_counters()`. It decides nothing about a rollout's fate (the judge does),
except the write-behind barrier: without the served report nothing of the group is read
(`served_report_unavailable`). Every call is bounded (`run_timeout_s`, `manifest_timeout_s`,
`stage_timeout_s`); a component death ends in-flight runs as `component_failed` at once.
Invariants: a result holds exactly N entries, one per reserved id, each a row or a typed
placeholder (nothing lost or counted twice); rollout ids are never reused, across retries too.
See docs/design-docs/token-capture-receipts.md, "Dispatch and accounting".
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nemo_gym.token_id_capture.staging.records import RolloutManifest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_rl.data.errors import FatalError, error_name
from nemo_rl.data.calls import ServedCall, check_rollout_id, rollout_id_for
from nemo_rl.data.rows import GroupEntry, GroupResult, KeptRollout, Placeholder, PlaceholderReason
from nemo_rl.data_plane.partitions import reported_staged_keys
from nemo_rl.distributed.component_watch import ComponentKind, any_down
from nemo_rl.environments.nemo_gym_config import GymRunError, GymRunTimeoutError, ManifestError
from nemo_rl.experience.errors import AccountingError
from nemo_rl.experience.legacy_rows import legacy_row_from_result
from nemo_rl.experience.finalizer_pool import FinalizeOutcome
from nemo_rl.models.generation.vllm.errors import WorkerError, WorkerFailedError
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.judge import RolloutEvidence, RunFailure, all_served_lost, reward_of
from nemo_rl.utils.aio import gather_cancelling

LOGGER = logging.getLogger(__name__)
ABORTED_DETAIL = "aborted"


class RolloutEnvironment(Protocol):
    """What the manager needs from the Gym environment (or a test fake)."""

    async def run(self, rollout_id: str, row: dict[str, Any]) -> dict[str, Any]: ...

    async def manifest(self, rollout_id: str) -> RolloutManifest: ...

    def retire(self, rollout_ids: list[str]) -> object:
        """Delete these rollouts' ledger files (synchronous, local file-system work)."""


class ComponentHealth(Protocol):
    """What the manager needs from the component watch (`distributed.component_watch`)."""

    @property
    def rollout_path_down(self) -> asyncio.Event: ...

    def down(self) -> dict[str, str]: ...

    async def poll(self) -> object:
        """One liveness round now (a failed run asks before blaming the rollout)."""


def component_failure_detail(down: Mapping[str, str]) -> str:
    """The placeholder detail naming every dead rollout-path component."""
    return "; ".join(f"{name} died: {detail}" for name, detail in sorted(down.items()))


def _component_failed(down: Mapping[str, str], suffix: str = "") -> RunFailure:
    return RunFailure(PlaceholderReason.COMPONENT_FAILED, component_failure_detail(down) + suffix)


class GroupFinalizer(Protocol):
    """The finalizer pool: one outcome per item, in order, never raising per item."""

    async def finalize_group(self, items: Sequence[RolloutEvidence]) -> list[FinalizeOutcome]: ...


class ServedReporter(Protocol):
    """The generation workers' served-call report (`WorkerGroup.served`, a `vllm.client.ServedReporter`), bounded.

    A worker that times out or died raises `WorkerError` (recoverable: the judge runs without the
    report and fails closed); `WorkerFailedError` (a worker in its failed state) and any other
    exception propagate and abort the run.
    """

    async def take_served_async(self, rollout_ids: list[str]) -> list[ServedCall]: ...


class StagingCleaner(Protocol):
    """Deletes a group's staged records once it is accounted (synchronous, like a source's fetch):
    the keys its manifests named and the other keys of its rollout ids the workers reported
    staging (orphans, whose commit never reached a ledger; `reported_keys` None = no report, the
    cleaner finds them itself). Returns how many orphans it cleared."""

    def clear(self, named_keys: list[str], rollout_ids: list[str], reported_keys: list[str] | None) -> int: ...


class RolloutManagerConfig(BaseModel):
    """No defaults here: deadlines come from the recipe's `token_capture` and `nemo_gym` sections."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    run_id: str = Field(description="Unique per launch (and per resume); prefixes every rollout id.")
    run_timeout_s: float = Field(
        gt=0, allow_inf_nan=False,
        description="The manager's deadline on one env.run; set it a little above the environment's own "
        "run deadline so the environment's named timeout arrives first.",
    )
    capture: TokenCaptureConfig

    @field_validator("run_id")
    @classmethod
    def _run_id_starts_usable_ids(cls, run_id: str) -> str:
        return check_rollout_id(run_id)  # the rollout-id rule, so a bad prefix fails here, not at dispatch


@dataclass(frozen=True)
class StepCounters:
    """What the manager counted since the last `take_step_counters()`: one step's worth."""

    queue_waits_ms: tuple[float, ...] = ()  # finalizer queue waits (`finalize/queue_wait_ms`)
    orphaned_staged_keys: int = 0  # staged keys cleared that no manifest named (commit never ledgered)
    dropped_groups: int = 0  # groups dropped by `min_valid_fraction_per_group`
    served_report_failures: int = 0  # groups whose served-call report could not be read
    retention_failures: int = 0  # groups whose retention failed while a component was down
    aborted_groups: tuple[GroupResult, ...] = ()  # accounted results of cancelled `run_group`s

    def __post_init__(self) -> None:
        counts = (self.orphaned_staged_keys, self.dropped_groups, self.served_report_failures, self.retention_failures)
        if min(counts) < 0 or any(w < 0 for w in self.queue_waits_ms):
            raise ValueError(f"step counters cannot be negative: {self}")

    def metrics(self, *, retention: bool) -> dict[str, float]:
        """The step's counter metrics; `retention/failures` only when the run clears staged keys."""
        metrics = {
            "finalize/orphaned_staged_keys": float(self.orphaned_staged_keys),
            "finalize/dropped_groups": float(self.dropped_groups),
            "finalize/served_report_failures": float(self.served_report_failures),
        }
        if retention:
            metrics["retention/failures"] = float(self.retention_failures)
        return metrics


class RetentionError(FatalError, RuntimeError):
    """Ledger retirement or staged-key clearing failed; `group` is the accounted result."""

    def __init__(self, group: GroupResult, failures: list[str]) -> None:
        self.group = group
        super().__init__(f"group {group.group_index} retention failed: {'; '.join(failures)}")


def enforce_min_valid_fraction(group: GroupResult, fraction: float) -> GroupResult:
    """The group itself, or, when its kept share is below `fraction`, every entry as a placeholder."""
    kept = len(group.kept)
    if not group.kept or kept >= fraction * group.n:
        return group
    detail = f"{kept}/{group.n} rollouts kept < token_capture.min_valid_fraction_per_group={fraction}"
    entries = []
    for entry in group.entries:
        if isinstance(entry, KeptRollout):
            entry = Placeholder(entry.rollout_id, entry.group_index, entry.sample_index,
                                PlaceholderReason.GROUP_BELOW_MIN_VALID_FRACTION, detail, entry.reward,
                                entry.terminal_selection)
        entries.append(entry)
    return GroupResult(group.group_index, tuple(entries))


def account_group(group_index: int, rollout_ids: Sequence[str], outcomes: Mapping[int, GroupEntry]) -> GroupResult:
    """Exactly one entry per reserved id; unfilled slots become `run_failed`/"aborted" placeholders."""
    stray = set(outcomes) - set(range(len(rollout_ids)))
    if stray:
        raise AccountingError(f"group {group_index}: outcomes filed under unknown sample indexes {sorted(stray)}",
                              kind="outcome")
    entries: list[GroupEntry] = []
    for index, rollout_id in enumerate(rollout_ids):
        entry = outcomes.get(index)
        if entry is None:
            entry = Placeholder(rollout_id, group_index, index, PlaceholderReason.RUN_FAILED, ABORTED_DETAIL)
        elif entry.rollout_id != rollout_id:
            raise AccountingError(
                f"group {group_index} slot {index}: outcome for {entry.rollout_id}, reserved {rollout_id}",
                kind="outcome",
            )
        entries.append(entry)
    return GroupResult(group_index=group_index, entries=tuple(entries))


@dataclass
class _GroupState:
    """Mutable bookkeeping of one in-flight group; outcomes land here as they resolve."""

    group_index: int
    rollout_ids: list[str]
    outcomes: dict[int, GroupEntry] = field(default_factory=dict)
    staged_keys: dict[int, list[str]] = field(default_factory=dict)  # by sample index
    reported_keys: list[str] | None = None  # staged keys the workers' served report names (None: no report)


def _describe(error: BaseException) -> str:
    return f"{error_name(error)}: {error}"


def _report_unavailable(ev: RolloutEvidence, why: str) -> Placeholder:
    """The verdict of a rollout whose rows cannot be read (write-behind, no served report)."""
    reward = None if ev.run_result is None else reward_of(ev.run_result)
    if ev.run_failure is not None:
        reason, detail = ev.run_failure.reason, ev.run_failure.detail
    else:
        reason = PlaceholderReason.SERVED_REPORT_UNAVAILABLE
        detail = (f"the workers' served-call report is unavailable ({why}), so nothing proves this rollout's "
                  "staged rows were written (token_capture.stage_write=behind_reply): none is read")
    return Placeholder(ev.rollout_id, ev.group_index, ev.sample_index, reason, detail, reward,
                       yield_=all_served_lost(ev, reason.value))


class RolloutManager:
    def __init__(
        self,
        cfg: RolloutManagerConfig,
        env: RolloutEnvironment,
        finalizer: GroupFinalizer | None = None,
        cleaner: StagingCleaner | None = None,
        served: ServedReporter | None = None,
        health: ComponentHealth | None = None,
    ) -> None:
        if cfg.capture.enabled and (finalizer is None or cleaner is None or served is None):
            raise ValueError(
                "token_capture.enabled=true needs a finalizer (FinalizerPool), a staging cleaner and the "
                "workers' served-call reporter (WorkerGroup.served)"
            )
        self._cfg = cfg
        self._env = env
        self._finalizer = finalizer
        self._cleaner = cleaner
        self._served = served
        self._health = health
        self._retention_failures = 0
        self._served_report_failures = 0
        self._dropped_groups = 0
        self._attempts: dict[tuple[int, int], int] = {}
        self._queue_waits_ms: list[float] = []
        self._orphaned_staged_keys = 0
        self._aborted: list[GroupResult] = []

    def _reserve(self, step: int, group_index: int, n: int) -> list[str]:
        if n < 1:
            raise ValueError(f"group size n must be >= 1, got {n}")
        # Older steps can never be retried once a newer one started; drop their counters.
        self._attempts = {key: count for key, count in self._attempts.items() if key[0] >= step}
        attempt = self._attempts.get((step, group_index), 0)
        self._attempts[(step, group_index)] = attempt + 1
        return [rollout_id_for(self._cfg.run_id, step, group_index, i, attempt) for i in range(n)]

    def take_step_counters(self) -> StepCounters:
        """Everything counted since the last call, as one record; the counts start again from zero."""
        counters = StepCounters(
            queue_waits_ms=tuple(self._queue_waits_ms),
            orphaned_staged_keys=self._orphaned_staged_keys,
            dropped_groups=self._dropped_groups,
            served_report_failures=self._served_report_failures,
            retention_failures=self._retention_failures,
            aborted_groups=tuple(self._aborted),
        )
        self._queue_waits_ms, self._aborted = [], []
        self._orphaned_staged_keys = self._dropped_groups = self._served_report_failures = self._retention_failures = 0
        return counters

    def reserve(self, step: int, group_index: int, n: int) -> list[str]:
        """Fresh rollout ids for a group an external harness drives itself (see `collect_group`)."""
        return self._reserve(step, group_index, n)

    @property
    def run_id(self) -> str:
        """This launch's id, the prefix of every rollout id it mints (an async loop mints with it too)."""
        return self._cfg.run_id

    async def run_group(self, step: int, group_index: int, row: dict[str, Any], n: int) -> GroupResult:
        return await self.run_group_as(group_index, self._reserve(step, group_index, n), row)

    async def run_group_as(self, group_index: int, rollout_ids: Sequence[str], row: dict[str, Any]) -> GroupResult:
        """`run_group` under ids the caller minted (the async loop's ledger tickets); same accounting.

        The ids must be usable and distinct, and never given before in this launch (the ledger's
        generations guarantee it); N is their count."""
        rollout_ids = [check_rollout_id(rollout_id) for rollout_id in rollout_ids]
        if not rollout_ids or len(set(rollout_ids)) != len(rollout_ids):
            raise ValueError(f"group {group_index}: rollout ids must be distinct and at least one, got {rollout_ids}")
        if not self._cfg.capture.enabled:
            return await self._account(_GroupState(group_index, rollout_ids), self._legacy_group, row)
        runs = [functools.partial(self._run, rollout_id, row) for rollout_id in rollout_ids]
        return await self._account(_GroupState(group_index, rollout_ids), self._capture_group, runs)

    async def collect_group(
        self, group_index: int, rollout_ids: Sequence[str], outcomes: Sequence[dict[str, Any] | RunFailure]
    ) -> GroupResult:
        """Judge and account rollouts an external harness already ran (ids from `reserve`), capture on."""
        if not self._cfg.capture.enabled:
            raise ValueError("collect_group needs token_capture.enabled=true (it judges captured rollouts)")
        if len(outcomes) != len(rollout_ids):
            raise ValueError(f"{len(outcomes)} run outcomes for {len(rollout_ids)} rollout ids")

        async def given(outcome: dict[str, Any] | RunFailure) -> dict[str, Any] | RunFailure:
            return outcome

        runs = [functools.partial(given, outcome) for outcome in outcomes]
        return await self._account(_GroupState(group_index, list(rollout_ids)), self._capture_group, runs)

    async def _account(self, state: _GroupState, body, arg) -> GroupResult:
        group_index = state.group_index
        result: GroupResult | None = None
        try:
            await body(state, arg)
            result = account_group(group_index, state.rollout_ids, state.outcomes)
            floor = self._cfg.capture.min_valid_fraction_per_group
            enforced = enforce_min_valid_fraction(result, floor) if self._cfg.capture.enabled else result
            if enforced is not result:
                self._dropped_groups += 1
                LOGGER.warning("group %d dropped: %d/%d kept < min_valid_fraction_per_group=%s",
                               group_index, len(result.kept), result.n, floor)
            result = enforced
        except asyncio.CancelledError:
            self._aborted.append(account_group(group_index, state.rollout_ids, state.outcomes))
            raise
        finally:
            failures = await self._retain(state)
            if failures and result is not None and self._health is not None and not self._health.down():
                await self._health.poll()  # a unit that died under the clear fails it before the watch's next round
            down = self._health.down() if self._health is not None else {}
            if failures and result is not None and down:
                self._retention_failures += 1
                LOGGER.error("group %d retention failed while %s: %s", group_index,
                             component_failure_detail(down), "; ".join(failures))
            elif failures and result is not None:
                raise RetentionError(result, failures)
            if failures:  # an error or cancellation is already propagating; it stays the primary failure
                LOGGER.error("group %d did not complete and retention failed: %s", group_index, "; ".join(failures))
        return result

    async def _run(self, rollout_id: str, row: dict[str, Any]) -> dict[str, Any] | RunFailure:
        """The run result, or the typed failure of the run (a component death ends it at once)."""
        health = self._health
        if health is None:
            return await self._bounded_run(rollout_id, row)
        if down := health.down():
            return _component_failed(down)
        run = asyncio.ensure_future(self._bounded_run(rollout_id, row))
        death = asyncio.ensure_future(health.rollout_path_down.wait())
        try:
            await asyncio.wait({run, death}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pending = [task for task in (run, death) if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if not run.done() or run.cancelled():
            return _component_failed(health.down())
        result = run.result()
        if not isinstance(result, RunFailure):
            return result
        # A dead gate or worker fails the run (connection refused) before the next watch round:
        # look now, so the placeholder names the component rather than the rollout.
        await health.poll()
        down = health.down()
        return _component_failed(down, f" (the run reported: {result.detail[:300]})") if down else result

    async def _bounded_run(self, rollout_id: str, row: dict[str, Any]) -> dict[str, Any] | RunFailure:
        try:
            return await asyncio.wait_for(self._env.run(rollout_id, row), self._cfg.run_timeout_s)
        except asyncio.TimeoutError:
            return RunFailure(PlaceholderReason.RUN_TIMEOUT, f"no /run result within {self._cfg.run_timeout_s}s")
        except GymRunTimeoutError as error:
            return RunFailure(PlaceholderReason.RUN_TIMEOUT, _describe(error))
        except GymRunError as error:  # the agent failed or answered garbage: this rollout's verdict
            return RunFailure(PlaceholderReason.RUN_FAILED, _describe(error))

    async def _legacy_group(self, state: _GroupState, row: dict[str, Any]) -> None:
        async def one(index: int) -> None:
            rollout_id = state.rollout_ids[index]
            result = await self._run(rollout_id, row)
            if isinstance(result, RunFailure):
                state.outcomes[index] = Placeholder(rollout_id, state.group_index, index, result.reason, result.detail)
            else:
                state.outcomes[index] = legacy_row_from_result(
                    result, rollout_id=rollout_id, group_index=state.group_index, sample_index=index)

        await gather_cancelling(one(i) for i in range(len(state.rollout_ids)))

    async def _evidence(self, state: _GroupState, index: int, run) -> RolloutEvidence:
        """Run (or take the harness's outcome), then fetch the manifest; the served report comes later."""
        rollout_id = state.rollout_ids[index]
        outcome = await run()
        manifest, problem = None, None
        try:
            manifest = await asyncio.wait_for(self._env.manifest(rollout_id), self._cfg.capture.manifest_timeout_s)
        except asyncio.TimeoutError:
            problem = f"no manifest within {self._cfg.capture.manifest_timeout_s}s"
        except ManifestError as error:  # the gate's control route failed: the judge fails closed
            problem = _describe(error)
        if manifest is not None and manifest.rollout_id == rollout_id:
            state.staged_keys[index] = [record.staging_key for record in manifest.records]
        failed = isinstance(outcome, RunFailure)
        return RolloutEvidence(
            rollout_id, state.group_index, index, None if failed else outcome, outcome if failed else None,
            manifest, problem, None,
        )

    async def _served_report(self, rollout_ids: list[str]) -> dict[str, tuple[ServedCall, ...]] | str:
        """The served calls by rollout, or why the report is unavailable."""
        try:
            calls = await self._served.take_served_async(rollout_ids)
        except WorkerFailedError:
            if not await self._worker_found_dead():
                raise  # the worker declared itself failed (a bug, or a death no probe sees): abort loudly
            detail = component_failure_detail(self._health.down())  # its engine core died: the watch names it
        except WorkerError as error:  # a worker timed out or died (see `_capture_group` for what follows)
            detail = _describe(error)
        else:
            return _by_rollout(rollout_ids, calls)
        self._served_report_failures += 1
        LOGGER.error("served-call report for %s.. unavailable: %s", rollout_ids[0], detail)
        return detail

    async def _worker_found_dead(self) -> bool:
        """A liveness round now: is a vLLM worker (or its engine core) among the dead?"""
        if self._health is None:
            return False
        await self._health.poll()
        return any_down(self._health.down(), ComponentKind.VLLM_WORKER)

    async def _capture_group(self, state: _GroupState, runs) -> None:
        evidence = await gather_cancelling(self._evidence(state, i, run) for i, run in enumerate(runs))
        served = await self._served_report(list(state.rollout_ids))
        if isinstance(served, str) and self._cfg.capture.stage_write == "behind_reply":
            # Without the report nothing proves the group's rows were written: read none of them.
            for ev in evidence:
                state.outcomes[ev.sample_index] = _report_unavailable(ev, served)
            return
        if not isinstance(served, str):
            evidence = [dataclasses.replace(ev, served=served[ev.rollout_id]) for ev in evidence]
            state.reported_keys = reported_staged_keys(call for calls in served.values() for call in calls)
        outcomes = await self._finalizer.finalize_group(evidence)
        if len(outcomes) != len(evidence):
            raise AccountingError(f"finalizer answered {len(outcomes)} outcomes for {len(evidence)} items",
                                  kind="outcome")
        for item, outcome in zip(evidence, outcomes):
            state.outcomes[item.sample_index] = outcome.result
            if outcome.queue_wait_ms is not None:
                self._queue_waits_ms.append(outcome.queue_wait_ms)

    async def _retain(self, state: _GroupState) -> list[str]:
        """Retire ledgers and clear staged keys (capture on, retire_after_commit); failures, named."""
        capture = self._cfg.capture
        if not (capture.enabled and capture.retire_after_commit):
            return []
        keys = [key for index in sorted(state.staged_keys) for key in state.staged_keys[index]]
        ids = list(state.rollout_ids)
        jobs = {
            "retire ledger files": functools.partial(self._env.retire, ids),
            "clear staged keys": functools.partial(self._cleaner.clear, keys, ids, state.reported_keys),
        }
        # Both are synchronous file-system / TransferQueue work: off the event loop, each bounded.
        results = await asyncio.gather(
            *(asyncio.wait_for(asyncio.to_thread(job), capture.stage_timeout_s) for job in jobs.values()),
            return_exceptions=True,
        )
        outcomes = dict(zip(jobs, results))
        if isinstance(outcomes["clear staged keys"], int):
            self._orphaned_staged_keys += outcomes["clear staged keys"]
        failures = []
        for name, outcome in outcomes.items():
            if isinstance(outcome, asyncio.TimeoutError):
                failures.append(f"{name}: no answer within token_capture.stage_timeout_s={capture.stage_timeout_s}s")
            elif isinstance(outcome, BaseException):
                failures.append(f"{name}: {_describe(outcome)}")
        return failures


def _by_rollout(rollout_ids: list[str], calls: list[ServedCall]) -> dict[str, tuple[ServedCall, ...]]:
    """The served calls grouped by rollout, every asked rollout present (those with none: empty)."""
    by_rollout: dict[str, list[ServedCall]] = {rollout_id: [] for rollout_id in rollout_ids}
    for call in calls:
        if call.rollout_id in by_rollout:
            by_rollout[call.rollout_id].append(call)
    return {rollout_id: tuple(found) for rollout_id, found in by_rollout.items()}
