"""The worker's custody core: an admitted (`ng_capture`) call's own steps (render, generate, HTTP are not here).

No callbacks: `serving` drives each call through these steps. `open` (admission check, claim or
replay of the call's id, for token-in the parents' barrier and the exact prefix) -> a
`CallOpening` or a re-send's committed reply; `plan` (Gym's one `begin_call` on the prompt
serving rendered) -> a `CallPlan`; `finish` (staging, prefix-cache seed once durable, served
registry) -> the reply with `ng_commit_coords`; `release` (nothing generated) or `abandon` (cut
mid-generation). `lifecycle.build_custody` builds the core.
Invariants: nothing is generated from an unverified prefix or a parent whose row is not durable;
an admitted call is generated at most once (a byte-identical re-send is replayed); every
generated admitted call leaves one `ServedCall`; a failed custody step after generation is a
`capture_failed` reply; an abandoned call is recorded served, never staged. Failures are
`ApiError`s; no HTTP here. The rules in full: docs/design-docs/vllm-worker-capture.md.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pydantic import ValidationError

from nemo_gym.token_id_capture.staging import (
    ActiveCall,
    CaptureAdmission,
    CaptureError,
    CommitCoords,
    RolloutTokenCapture,
    staging_key,
)
from nemo_rl.data.errors import ApiError, error_name
from nemo_rl.data.calls import (
    ServedCall,
    StagedRecordInvalidError,
    StagingFetchError,
)
from nemo_rl.data_plane.errors import DataPlaneError
from nemo_rl.data_plane.client import ParentRows
from nemo_rl.models.generation.vllm.custody_state import AdmittedCalls, PrefixCache, ServedRegistry, request_digest
from nemo_rl.models.generation.vllm.engine import GenerationResultLike, SamplingRequest
from nemo_rl.models.generation.vllm.errors import PrefixError, PrefixMismatchError
from nemo_rl.utils import instrumentation  # opt-in per-call cost (benchmarks/capture_ab.py)

LOGGER = logging.getLogger(__name__)

DEFAULT_MAX_SERVED_ROLLOUTS = 100_000
# How long a re-send waits for the same call still in flight before it is refused (409). The worker
# passes its own bound (`lifecycle.duplicate_wait_bound_s`); this is the default of a bare core.
DEFAULT_DUPLICATE_WAIT_S = 60.0


class StageBarrier(Protocol):
    """Write-behind staging's barriers (`StageWriter` implements them)."""

    def flush(self, rollout_ids: list[str], timeout_s: float) -> dict[str, str]: ...

    def wait_keys(self, keys: list[str], timeout_s: float) -> ParentRows: ...

    def when_written(self, key: str, fn) -> bool: ...


@dataclass(frozen=True)
class CallOpening:
    """An admitted call before its prompt: the committed reply of a re-send (`replay`), or the call
    claimed under `key` with its admission and its parent's exact ids (`prefix`; None for a ROOT).
    Its opener then `plan`s it, or `release`s it when it cannot be planned."""

    key: tuple[str, str]
    admission: CaptureAdmission | None
    prefix: list[int] | None
    replay: dict | None


@dataclass(frozen=True)
class CallPlan:
    """What an opened call generates from (`prompt_ids`, `sampling`) and what custody needs after;
    its opener ends it with exactly one of `finish`, `release` or `abandon`."""

    key: tuple[str, str]
    admission: CaptureAdmission
    call: ActiveCall  # from the one `begin_call`; its weight version is restamped after generation
    prefix: list[int] | None
    prompt_ids: list[int]
    tail_error: str | None
    sampling: SamplingRequest
    history_has_assistant_turn: bool  # with a text admission: a continuation the gate found no parent for


def _admission_field(e: ValidationError) -> str:
    """`ng_capture.<loc>` of the first error pydantic reports for an admission."""
    loc = e.errors()[0].get("loc", ()) if e.errors() else ()
    return ".".join(["ng_capture", *(str(part) for part in loc)])


def _stamped(call: ActiveCall, weight_version: int) -> ActiveCall:
    """`call` with the weight version its generation ran under (Gym's `begin_call` rule for it).

    A fresh `ActiveCall` (never completed), so the admission is checked once, by `begin_call`."""
    if type(weight_version) is not int or weight_version < 0:
        raise CaptureError(f"weight_version must be a non-negative int, got {weight_version!r}")
    return replace(call, weight_version=weight_version)


def _capture_payload(result: GenerationResultLike) -> dict:
    """What Gym's `VLLMCaptureAdapter` reads the call's ids from: prompt ids at the top level and the
    sampled ids with their logprobs as the message-level token bundle (no chat completion is built)."""
    return {
        "prompt_token_ids": list(result.prompt_token_ids),
        "choices": [
            {"message": {"generation_token_ids": list(result.token_ids), "generation_log_probs": list(result.logprobs)}}
        ],
    }


class CustodyCore:
    """The admitted-call pipeline of one worker (module contract); `lifecycle.build_custody` builds it."""

    def __init__(
        self,
        capture: RolloutTokenCapture,
        prefix_cache: PrefixCache | None,
        *,
        vocab_size: int,
        max_admitted_calls: int,
        worker_index: int = 0,
        max_served_rollouts: int = DEFAULT_MAX_SERVED_ROLLOUTS,
        duplicate_wait_s: float = DEFAULT_DUPLICATE_WAIT_S,
        barrier: StageBarrier | None = None,
        barrier_timeout_s: float = 0.0,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size}: must be >= 1")
        if duplicate_wait_s <= 0:
            raise ValueError(f"duplicate_wait_s={duplicate_wait_s}: must be > 0")
        self.capture = capture
        self.prefix_cache = prefix_cache
        self.worker_index = worker_index
        self._vocab_size = vocab_size
        self._admitted = AdmittedCalls(max_admitted_calls)
        self._duplicate_wait_s = duplicate_wait_s
        self._served = ServedRegistry(max_served_rollouts)
        self._stage_barrier = barrier
        self._stage_flush_timeout_s = barrier_timeout_s
        self.stats: Counter[str] = Counter()
        self.capture_failures: deque[dict] = deque(maxlen=1000)

    # Gym's `install_capture(serving_layer, ...)` seam (also how a timed capture core is swapped in).
    def install_token_capture(self, capture: RolloutTokenCapture) -> None:
        self.capture = capture

    async def open(self, body: Mapping[str, Any], raw_admission: Any) -> CallOpening:
        """A call admitted, its id claimed and (token-in) its parent's exact prefix resolved, before
        its prompt is rendered (any refusal raises here, the id released); or the committed reply
        of a re-send. Whoever opened it then `plan`s it or `release`s it."""
        admission = self._validate_admission(raw_admission)
        instrumentation.set_call_fact("capture", 1.0)  # admitted (the benchmarks split calls by path)
        key = (admission.rollout_id, admission.model_call_id)
        replay = await self._claim_or_replay(key, request_digest(body), admission)
        if replay is not None:
            return CallOpening(key, None, None, replay)
        if admission.mode == "text":
            return CallOpening(key, admission, None, None)
        try:
            prefix = await self._resolve_prefix(admission, body)
        except BaseException:
            self._admitted.release(key)
            raise
        return CallOpening(key, admission, prefix, None)

    def plan(
        self,
        opening: CallOpening,
        *,
        prompt_ids: list[int],
        tail_error: str | None,
        sampling: SamplingRequest,
        weight_version: int,
        history_has_assistant_turn: bool,
    ) -> CallPlan:
        """The opened call's plan over the prompt its opener rendered (the prefix verbatim, then the
        tail; or, `tail_error` set, the re-rendered conversation served but never captured)."""
        assert opening.admission is not None, "a replayed opening has nothing to plan"
        try:
            # The one admission check: Gym validates the admission against the resolved prefix here,
            # before any token is generated. The version is provisional (a refit may land before the
            # generation is admitted); `_stage` restamps the one the generation ran with.
            call = self.capture.begin_call(
                opening.admission, prefix_token_ids=opening.prefix, stream=False, weight_version=weight_version
            )
        except CaptureError as e:
            raise ApiError("invalid_capture_admission", str(e), param="ng_capture") from e
        return CallPlan(
            key=opening.key, admission=opening.admission, call=call, prefix=opening.prefix, prompt_ids=prompt_ids,
            tail_error=tail_error, sampling=sampling, history_has_assistant_turn=history_has_assistant_turn,
        )

    def release(self, opened: CallOpening | CallPlan) -> None:
        """The opened call was not generated (refused, timed out, failed engine): its id is free again."""
        self._admitted.release(opened.key)

    async def finish(self, plan: CallPlan, result: GenerationResultLike, reply: dict) -> dict:
        """Stage the generated call and commit `reply` (its chat completion, no token echo) with its
        coords (replayed to a re-send); returns that reply."""
        try:
            reply = await self._stage(plan, result, reply)
        except BaseException:
            self._admitted.spoil(plan.key)  # generated once: never again, and there is no reply to replay
            raise
        self._admitted.commit(plan.key, reply)
        return reply

    def abandon(self, plan: CallPlan, generated_tokens: int, reason: str) -> None:
        """The call was cut mid-generation (`reason`, e.g. a streamed call's client gone): its id is
        spoiled, Gym's capture fails the call, and it is recorded served and not staged."""
        self._admitted.spoil(plan.key)
        self.capture.fail_call(plan.call, reason=reason)
        self.stats[reason] += 1
        self.stats["served_calls"] += 1
        self._record_served(plan.admission, generated_tokens=generated_tokens, failure=reason,
                            history_has_assistant_turn=plan.history_has_assistant_turn)

    def take_served(self, rollout_ids: list[str]) -> list[ServedCall]:
        """Pop and return the served-call records of `rollout_ids` (unknown ids: nothing).

        Under write-behind staging this blocks until the rollouts' staged rows are written (the
        barrier every finalizer read comes after); a row that did not land turns its call into
        served-not-staged, naming why.
        """
        ids = list(rollout_ids)
        failures = {} if self._stage_barrier is None else self._stage_barrier.flush(ids, self._stage_flush_timeout_s)
        calls = self._served.take(ids)
        self._admitted.retire((call.rollout_id, call.model_call_id) for call in calls)
        return [self._unstaged_if_lost(call, failures) for call in calls] if failures else calls

    def served_rollouts_pending(self) -> int:
        return len(self._served)

    def _unstaged_if_lost(self, call: ServedCall, failures: dict[str, str]) -> ServedCall:
        why = failures.get(staging_key(call.rollout_id, call.model_call_id))
        if why is None or not call.staged:
            return call
        self.stats["capture_failed"] += 1
        self.capture_failures.append({"rollout_id": call.rollout_id, "model_call_id": call.model_call_id, "reason": why})
        LOGGER.error("capture_failed after reply rollout=%s call=%s: %s", call.rollout_id, call.model_call_id, why)
        return replace(call, staged=False, failure=why)

    def _validate_admission(self, raw: Any) -> CaptureAdmission:
        try:
            admission = CaptureAdmission.model_validate(raw)
        except ValidationError as e:
            raise ApiError(
                "invalid_capture_admission", f"ng_capture is not a valid CaptureAdmission: {e}",
                param=_admission_field(e),
            ) from e
        outside = [t for t in admission.required_prefix_token_ids if not 0 <= t < self._vocab_size]
        if outside:
            raise ApiError(
                "invalid_capture_admission",
                f"ng_capture.required_prefix_token_ids holds {len(outside)} id(s) outside this model's vocabulary "
                f"0..{self._vocab_size - 1} (first: {outside[0]})",
                param="ng_capture.required_prefix_token_ids",
            )
        return admission

    async def _claim_or_replay(self, key: tuple[str, str], digest: str, admission: CaptureAdmission) -> dict | None:
        """None once `key` is claimed for this request; the committed reply for a re-send of it.

        A re-send (same id, same request digest) of a committed call gets the committed reply: same
        ids, same commit coordinates, nothing generated, staged or recorded again. One still in flight
        is waited for (bounded by `duplicate_wait_s`), then replayed; if the first was refused or not
        generated it is forgotten and this one is admitted in its place. Anything else under a used id
        (another body, a call generated without a reply, a wait past its bound) is 409.
        """
        started = time.monotonic()
        while (known := self._admitted.claim(key, digest)) is not None:
            if known.digest != digest:
                raise self._duplicate(admission, "was already admitted by this worker with another request body")
            if known.reply_json is not None:
                self.stats["replayed_calls"] += 1
                LOGGER.info("replayed the committed reply of rollout=%s call=%s to a re-send", *key)
                return json.loads(known.reply_json)
            if known.spoiled:
                raise self._duplicate(admission, "was generated by this worker but never answered, so it is not replayed")
            if known.retired:
                raise self._duplicate(admission, "belongs to a rollout already reported to the trainer, so it is not replayed")
            remaining = self._duplicate_wait_s - (time.monotonic() - started)
            try:
                await asyncio.wait_for(known.settled.wait(), max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise self._duplicate(
                    admission, f"is still in flight on this worker after {self._duplicate_wait_s:g}s"
                ) from None
        return None

    def _duplicate(self, admission: CaptureAdmission, why: str) -> ApiError:
        self.stats["duplicate_model_call_id"] += 1
        return ApiError(
            "duplicate_model_call_id",
            f"rollout {admission.rollout_id!r} call {admission.model_call_id!r} {why}; a model_call_id is served "
            "once, and only a byte-identical re-send is replayed (fix: mint a fresh model_call_id per call)",
            param="ng_capture.model_call_id",
        )

    async def _resolve_prefix(self, admission: CaptureAdmission, body: Mapping[str, Any]) -> list[int]:
        """The parent's exact ids; every continuation passes the one parents' check first."""
        if admission.staging_chain:
            where, param = f"staging_chain of call {admission.model_call_id}", "ng_capture.staging_chain"
            if self.prefix_cache is None:
                raise ApiError("staging_unavailable", "no staging source is configured to resolve staging_chain",
                               param=param)
            await self._check_parents(admission, where, param)
            try:
                # Bounded: every staging read carries token_capture.stage_timeout_s (the source's deadline).
                return await asyncio.to_thread(
                    self.prefix_cache.resolve, list(admission.staging_chain), admission.prev_len, admission.parent_chain_hash
                )
            except (PrefixMismatchError, StagedRecordInvalidError) as e:
                raise ApiError("prefix_mismatch", f"{where}: {error_name(e)}: {e}", param=param) from e
            except (PrefixError, StagingFetchError, DataPlaneError) as e:
                raise ApiError("staging_unavailable", f"{where}: {error_name(e)}: {e}", param=param) from e
        inline = list(admission.required_prefix_token_ids)
        top = body.get("required_prefix_token_ids")
        if top not in (None, []) and list(top) != inline:
            raise ApiError(
                "invalid_capture_admission", "top-level required_prefix_token_ids disagree with ng_capture",
                param="required_prefix_token_ids",
            )
        await self._check_parents(admission, f"inline prefix of call {admission.model_call_id}",
                                  "ng_capture.required_prefix_token_ids")
        return inline

    async def _check_parents(self, admission: CaptureAdmission, where: str, param: str) -> None:
        """The one parents' check: no continuation is generated from a parent whose row is not durable.

        Under write-behind (a barrier installed) the parents are the `staging_chain` keys, or the
        parent call's key for an inline prefix. Parents this worker queued must be written (a zero
        deadline first, then a bounded off-thread wait); lost or still pending: 503, nothing generated.
        A parent this writer cannot vouch for (another worker's, or forgotten) must be proven by the
        store: a `staging_chain` resolve reads every key its cache lacks (and the cache holds only
        rows written or read), an inline parent is read here (`_confirm_staged`). Under
        `before_reply` every parent's reply left after its write, so there is nothing to wait for.
        """
        if self._stage_barrier is None:
            return
        parents = list(admission.staging_chain) or [staging_key(admission.rollout_id, admission.parent_call_id)]
        started = time.perf_counter()
        # Non-blocking first (a zero deadline never waits): the parents' writes have usually landed
        # during the agent's tool round trip, and a thread hop would cost more than the check.
        rows = self._stage_barrier.wait_keys(parents, 0.0)
        if rows.lost:
            rows = await asyncio.to_thread(self._stage_barrier.wait_keys, parents, self._stage_flush_timeout_s)
        instrumentation.add_call_cost("parent_wait_s", time.perf_counter() - started)
        if rows.lost:
            self.stats["parents_not_durable"] += 1
            raise ApiError(
                "staging_unavailable",
                f"{where}: parent row(s) this worker staged are not durable, so no child is generated from them: "
                + "; ".join(f"{key}: {why}" for key, why in sorted(rows.lost.items())),
                param=param,
            )
        if not admission.staging_chain:
            for key in rows.unvouched:
                await self._confirm_staged(key, admission, where, param)

    async def _confirm_staged(self, key: str, admission: CaptureAdmission, where: str, param: str) -> None:
        """An inline prefix's parent row, read from the store: it exists and ends where the admission says."""
        if self.prefix_cache is None:
            raise ApiError("staging_unavailable",
                           f"{where}: no staging source is configured to prove parent {key} durable", param=param)
        try:
            cum_len, chain_hash = await asyncio.to_thread(self.prefix_cache.staged_tip, key)
        except StagedRecordInvalidError as e:
            raise ApiError("prefix_mismatch", f"{where}: {error_name(e)}: {e}", param=param) from e
        except (StagingFetchError, DataPlaneError, PrefixError) as e:
            raise ApiError("staging_unavailable", f"{where}: {error_name(e)}: {e}", param=param) from e
        if (cum_len, chain_hash) != (admission.prev_len, admission.parent_chain_hash):
            raise ApiError(
                "prefix_mismatch",
                f"{where}: parent row {key} ends at {cum_len} ids with chain hash {chain_hash}, the admission says "
                f"prev_len {admission.prev_len} and parent_chain_hash {admission.parent_chain_hash}",
                param=param,
            )

    async def _stage(self, plan: CallPlan, result: GenerationResultLike, reply: dict) -> dict:
        """Stage the generated call (or record why not), seed, record it served; `reply` with coords."""
        admission = plan.admission
        call = _stamped(plan.call, result.weight_version)
        if plan.tail_error is not None:
            coords = self.capture.fail_call(call, reason=plan.tail_error)
            reason = plan.tail_error
        else:
            payload = _capture_payload(result)
            if self._stage_barrier is not None:
                # Write-behind: the sink only queues the row, so the commit is Gym's digests (about a
                # millisecond). Inline it: a thread hop waits for the GIL behind vLLM's output
                # processing on this loop, 10 ms p50 under 8 concurrent calls (benchmarks/engine_ab.py).
                coords = self.capture.complete_call_from_response(call, payload)
            else:  # before_reply: the commit includes the blocking data-plane write
                coords = await asyncio.to_thread(self.capture.complete_call_from_response, call, payload)
            reason = None if coords.disposition == "staged" else "staging_failed (see worker log)"
        if reason is None:
            self._seed_when_durable(admission, result, coords)
        self.stats[f"{admission.mode}_calls"] += 1
        self.stats["served_calls"] += 1
        self._record_served(admission, generated_tokens=len(result.token_ids), failure=reason,
                            history_has_assistant_turn=plan.history_has_assistant_turn)
        if reason is not None:
            self.stats["capture_failed"] += 1
            self.capture_failures.append(
                {"rollout_id": admission.rollout_id, "model_call_id": admission.model_call_id, "reason": reason}
            )
            LOGGER.error("capture_failed rollout=%s call=%s: %s", admission.rollout_id, admission.model_call_id, reason)
        # No token echo: the staged record is the source of truth for the ids, and Gym's gate strips
        # prompt_token_ids / token_ids / logprobs from an external-staging reply unread.
        reply["ng_commit_coords"] = coords.model_dump(mode="json")
        return reply

    def _seed_when_durable(self, admission: CaptureAdmission, result: GenerationResultLike, coords: CommitCoords) -> None:
        """Seed the prefix cache with the delta just staged, once its row is durable.

        The cache holds only durable rows (a cache hit skips the store read that would prove a
        parent durable): under write-behind the seed runs when the writer has written the row
        (`StageBarrier.when_written`; a row that is lost never seeds), under `before_reply` at once.
        Only chain members are seeded: a ROOT (`text`) or a `staging_chain` continuation, whose key
        follows `staging_chain[-1]` in the chain Gym names for the next turn.
        """
        if self.prefix_cache is None or coords.staging_key is None:
            return
        if admission.mode == "token_in" and not admission.staging_chain:
            return  # an inline-prefix parent is not a staging_chain member
        seed = functools.partial(self._seed_prefix_cache, admission, result, coords)
        if self._stage_barrier is None:
            seed()
        elif not self._stage_barrier.when_written(coords.staging_key, seed):
            self.stats["prefix_seed_skipped_lost"] += 1

    def _seed_prefix_cache(self, admission: CaptureAdmission, result: GenerationResultLike, coords: CommitCoords) -> None:
        """Cache a durable staged delta, so this rollout's next turn here resolves it without a fetch.

        The cache checks the delta against the staged chain hash (`PrefixCache.seed`).
        """
        assert self.prefix_cache is not None and coords.staging_key is not None  # `_seed_when_durable` checked
        parent_key = admission.staging_chain[-1] if admission.mode == "token_in" else None
        started = time.perf_counter()
        delta = (list(result.prompt_token_ids) + list(result.token_ids))[admission.prev_len :]
        accepted = self.prefix_cache.seed(
            coords.staging_key,
            parent_key=parent_key,
            parent_chain_hash=admission.parent_chain_hash,
            delta=delta,
            cum_len=coords.cum_len,
            chain_hash=coords.chain_hash,
        )
        instrumentation.add_call_cost("prefix_seed_s", time.perf_counter() - started)
        if not accepted:  # the engine's ids do not hash to what Gym staged: a bug, never a silent one
            self.stats["prefix_seed_rejected"] += 1
            LOGGER.error(
                "prefix cache refused the delta staged as %s (it does not hash to the staged chain hash); "
                "the next turn fetches it from the staging store",
                coords.staging_key,
            )

    def _record_served(self, admission: CaptureAdmission, *, generated_tokens: int, failure: str | None,
                       history_has_assistant_turn: bool) -> None:
        served = ServedCall(
            rollout_id=admission.rollout_id,
            model_call_id=admission.model_call_id,
            parent_call_id=admission.parent_call_id,
            mode=admission.mode,
            generated_tokens=generated_tokens,
            staged=failure is None,
            failure=failure,
            worker_index=self.worker_index,
            unresolved_continuation=admission.mode == "text" and history_has_assistant_turn,
        )
        evicted = self._served.record(served)
        if evicted:
            self.stats["served_evicted_rollouts"] += evicted
            LOGGER.warning("served-call registry full: evicted %d rollout(s) never taken", evicted)
