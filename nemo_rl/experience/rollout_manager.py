"""Dispatch GRPO groups to a rollout environment and account for every rollout (always-N).

Contract of `RolloutManager.run_group(step, group_index, row, n) -> GroupResult`:
- Reserves N fresh rollout ids `f"{run_id}-s{step}-g{group}-i{index}-a{attempt}"`; `attempt`
  counts calls for the same (step, group), so a retried group never reuses an id (Gym appends
  to an existing ledger when an id is reused). `run_id` must be unique per launch and resume.
- Deadlines: `run_timeout_s` per env.run (RolloutManagerConfig), `token_capture.manifest_timeout_s`
  per manifest; the finalizer pool bounds its own calls (`token_capture.finalize_timeout_s`).
- Capture mode: runs all N through `env.run` concurrently, each bounded by `run_timeout_s`;
  fetches every manifest (bounded by `manifest_timeout_s`; also after a failed run, so that its
  staged keys can be cleared); assembles each receipt; finalizes the unpoisoned ones through
  the `GroupFinalizer` (the finalizer pool) and the rest in-process (no tokens needed).
- Legacy mode (capture off): runs all N and builds rows from Gym's token echo.
- Always-N: the result holds exactly N entries, one per reserved id, each a `TrainRow` or a
  `Placeholder` with its typed reason; an id that never reached an outcome (cancellation) is a
  `run_failed` placeholder with detail "aborted". Nothing is lost or counted twice.
- Retention (capture mode): after the group is accounted, ledger files are retired
  (`env.retire(ids)`) and every staged key of the group's rollout ids is cleared: those named by
  a fetched manifest and orphans no manifest names (`cleaner.clear(keys, ids)`; the orphan
  count is reported by `take_orphaned_staged_keys()`), each bounded by
  `token_capture.stage_timeout_s` (skipped when
  `retire_after_commit` is false); a failure raises `RetentionError` carrying the accounted group.
- Cancellation mid-group: in-flight runs are cancelled, the accounted (aborted) group is kept
  for `take_aborted_groups()`, retention runs, and the `CancelledError` propagates.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from nemo_gym.token_id_capture.staging import RolloutReceipt
from nemo_gym.token_id_capture.staging.records import RolloutManifest
from nemo_gym.token_id_capture.store import validate_rollout_id
from pydantic import BaseModel, ConfigDict, Field

from nemo_rl.environments.nemo_gym_config import GymRunTimeoutError
from nemo_rl.token_capture.config import TokenCaptureConfig
from nemo_rl.token_capture.finalizer import finalize_rollout, legacy_row_from_result
from nemo_rl.token_capture.finalizer_pool import FinalizeItem, FinalizeOutcome
from nemo_rl.token_capture.receipt import assemble_receipt, reward_of
from nemo_rl.token_capture.rows import GroupEntry, GroupResult, Placeholder, PlaceholderReason

LOGGER = logging.getLogger(__name__)
ABORTED_DETAIL = "aborted"


class RolloutEnvironment(Protocol):
    """What the manager needs from the Gym environment (or a test fake)."""

    async def run(self, rollout_id: str, row: dict[str, Any]) -> dict[str, Any]: ...

    async def manifest(self, rollout_id: str) -> RolloutManifest: ...

    def retire(self, rollout_ids: list[str]) -> object:
        """Delete these rollouts' ledger files (synchronous, local file-system work)."""


class GroupFinalizer(Protocol):
    """The finalizer pool: one outcome per item, in order, never raising per item."""

    async def finalize_group(self, items: Sequence[FinalizeItem]) -> list[FinalizeOutcome]: ...


class StagingCleaner(Protocol):
    """Deletes a group's staged records once it is accounted (synchronous, like a source's fetch):
    the keys its manifests named and any other key of its rollout ids (orphans, whose commit
    never reached a ledger). Returns how many orphans it cleared."""

    def clear(self, named_keys: list[str], rollout_ids: list[str]) -> int: ...


class RolloutManagerConfig(BaseModel):
    """No defaults here: deadlines come from the recipe's `token_capture` and `nemo_gym` sections."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    run_id: str = Field(
        pattern=r"^[A-Za-z0-9._-]+$", description="Unique per launch (and per resume); prefixes every rollout id."
    )
    run_timeout_s: float = Field(
        gt=0, allow_inf_nan=False,
        description="The manager's deadline on one env.run; set it a little above the environment's own "
        "run deadline so the environment's named timeout arrives first.",
    )
    capture: TokenCaptureConfig


class AccountingError(RuntimeError):
    """An outcome does not belong to the slot it was filed under (a bug, never data)."""


class RetentionError(RuntimeError):
    """Ledger retirement or staged-key clearing failed; `group` is the accounted result."""

    def __init__(self, group: GroupResult, failures: list[str]) -> None:
        self.group = group
        super().__init__(f"group {group.group_index} retention failed: {'; '.join(failures)}")


def rollout_id_for(run_id: str, step: int, group_index: int, sample_index: int, attempt: int) -> str:
    return validate_rollout_id(f"{run_id}-s{step}-g{group_index}-i{sample_index}-a{attempt}")


def account_group(group_index: int, rollout_ids: Sequence[str], outcomes: Mapping[int, GroupEntry]) -> GroupResult:
    """Exactly one entry per reserved id; unfilled slots become `run_failed`/"aborted" placeholders."""
    stray = set(outcomes) - set(range(len(rollout_ids)))
    if stray:
        raise AccountingError(f"group {group_index}: outcomes filed under unknown sample indexes {sorted(stray)}")
    entries: list[GroupEntry] = []
    for index, rollout_id in enumerate(rollout_ids):
        entry = outcomes.get(index)
        if entry is None:
            entry = Placeholder(rollout_id, group_index, index, PlaceholderReason.RUN_FAILED, ABORTED_DETAIL)
        elif entry.rollout_id != rollout_id:
            raise AccountingError(
                f"group {group_index} slot {index}: outcome for {entry.rollout_id}, reserved {rollout_id}"
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

    def placeholder(
        self, index: int, reason: PlaceholderReason, detail: str, reward: float | None = None
    ) -> Placeholder:
        return Placeholder(self.rollout_ids[index], self.group_index, index, reason, detail, reward)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class RolloutManager:
    def __init__(
        self,
        cfg: RolloutManagerConfig,
        env: RolloutEnvironment,
        finalizer: GroupFinalizer | None = None,
        cleaner: StagingCleaner | None = None,
    ) -> None:
        if cfg.capture.enabled and (finalizer is None or cleaner is None):
            raise ValueError("token_capture.enabled=true needs a finalizer (FinalizerPool) and a staging cleaner")
        self._cfg = cfg
        self._env = env
        self._finalizer = finalizer
        self._cleaner = cleaner
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

    def take_queue_waits_ms(self) -> list[float]:
        """Finalizer queue waits recorded since the last call (for `finalize/queue_wait_ms`)."""
        waits, self._queue_waits_ms = self._queue_waits_ms, []
        return waits

    def take_orphaned_staged_keys(self) -> int:
        """Staged keys cleared since the last call that no manifest named (commit never ledgered)."""
        count, self._orphaned_staged_keys = self._orphaned_staged_keys, 0
        return count

    def take_aborted_groups(self) -> list[GroupResult]:
        """Accounted results of groups whose run_group was cancelled, since the last call."""
        aborted, self._aborted = self._aborted, []
        return aborted

    async def run_group(self, step: int, group_index: int, row: dict[str, Any], n: int) -> GroupResult:
        state = _GroupState(group_index, self._reserve(step, group_index, n))
        result: GroupResult | None = None
        try:
            if self._cfg.capture.enabled:
                await self._capture_group(state, row)
            else:
                await self._legacy_group(state, row)
            result = account_group(group_index, state.rollout_ids, state.outcomes)
        except asyncio.CancelledError:
            self._aborted.append(account_group(group_index, state.rollout_ids, state.outcomes))
            raise
        finally:
            failures = await self._retain(state)
            if failures and result is not None:
                raise RetentionError(result, failures)
            if failures:  # an error or cancellation is already propagating; it stays the primary failure
                LOGGER.error("group %d did not complete and retention failed: %s", group_index, "; ".join(failures))
        return result

    async def _run(self, state: _GroupState, index: int, row: dict[str, Any]) -> dict[str, Any] | None:
        """The run result, or None after filing a run_failed / run_timeout placeholder."""
        try:
            return await asyncio.wait_for(self._env.run(state.rollout_ids[index], row), self._cfg.run_timeout_s)
        except asyncio.TimeoutError:
            state.outcomes[index] = state.placeholder(
                index, PlaceholderReason.RUN_TIMEOUT, f"no /run result within {self._cfg.run_timeout_s}s")
        except GymRunTimeoutError as error:
            state.outcomes[index] = state.placeholder(index, PlaceholderReason.RUN_TIMEOUT, _describe(error))
        except Exception as error:  # the environment is an external boundary; its failure is this rollout's verdict
            state.outcomes[index] = state.placeholder(index, PlaceholderReason.RUN_FAILED, _describe(error))
        return None

    async def _legacy_group(self, state: _GroupState, row: dict[str, Any]) -> None:
        async def one(index: int) -> None:
            result = await self._run(state, index, row)
            if result is not None:
                state.outcomes[index] = legacy_row_from_result(
                    result, rollout_id=state.rollout_ids[index], group_index=state.group_index, sample_index=index)

        await asyncio.gather(*(one(i) for i in range(len(state.rollout_ids))))

    async def _receipt(self, state: _GroupState, index: int, row: dict[str, Any]) -> RolloutReceipt | None:
        """Run, fetch the manifest, assemble the receipt; None once a placeholder is filed."""
        rollout_id = state.rollout_ids[index]
        result = await self._run(state, index, row)
        try:
            manifest = await asyncio.wait_for(self._env.manifest(rollout_id), self._cfg.capture.manifest_timeout_s)
        except asyncio.TimeoutError:
            manifest, problem = None, f"no manifest within {self._cfg.capture.manifest_timeout_s}s"
        except Exception as error:  # the gate's control route is an external boundary
            manifest, problem = None, _describe(error)
        if manifest is not None and manifest.rollout_id == rollout_id:
            state.staged_keys[index] = [record.staging_key for record in manifest.records]
        if result is None:
            return None
        if manifest is None:
            state.outcomes[index] = state.placeholder(
                index, PlaceholderReason.MANIFEST_UNAVAILABLE, problem, reward_of(result))
            return None
        return assemble_receipt(rollout_id, manifest, result)

    async def _capture_group(self, state: _GroupState, row: dict[str, Any]) -> None:
        receipts = await asyncio.gather(*(self._receipt(state, i, row) for i in range(len(state.rollout_ids))))
        items: list[FinalizeItem] = []
        for index, receipt in enumerate(receipts):
            if receipt is None:
                continue
            if receipt.capture_poisoned or receipt.reward is None:
                state.outcomes[index] = finalize_rollout(
                    receipt, (), group_index=state.group_index, sample_index=index)
            else:
                items.append(FinalizeItem(receipt, state.group_index, index))
        outcomes = await self._finalizer.finalize_group(items)
        if len(outcomes) != len(items):
            raise AccountingError(f"finalizer answered {len(outcomes)} outcomes for {len(items)} items")
        for item, outcome in zip(items, outcomes):
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
            "clear staged keys": functools.partial(self._cleaner.clear, keys, ids),
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
