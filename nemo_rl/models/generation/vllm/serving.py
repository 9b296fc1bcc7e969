"""The worker's chat-completions core: honours `ng_capture` admissions over an exact-id engine.

Contract (the transport, `server.py`, is a thin shell over `ChatService`):
- No admission (capture off: the legacy path): render the whole conversation, generate, and echo
  tokens when asked (`return_token_ids` -> `prompt_token_ids` + choice `token_ids`; `logprobs` ->
  entries named `token_id:N` under `return_tokens_as_token_ids`, else by the token's text), with
  vLLM's reply rules (`chat.assistant_reply`): the reply equals stock vLLM's OpenAI server's in
  every field the identity test compares (tests/integration/test_stock_vllm_identity.py).
- ROOT (`mode="text"`): same prompt, plus custody: the delta `prompt + generated` is staged
  through Gym's `RolloutTokenCapture` before the response is returned with `ng_commit_coords`.
- token-in: the prompt is the parent's exact ids (inline `required_prefix_token_ids`, or the
  `staging_chain` resolved through the bounded `PrefixCache`; an empty inline list never counts
  as "no prefix") followed by the newly rendered tail only.
- One admission check per admitted call: Gym's `begin_call` runs once, after the prefix is
  resolved and the context checked and before anything is generated (its `CaptureError` is the
  400 `invalid_capture_admission`); the `ActiveCall` it returns is restamped with the weight
  version the generation ran under before it is completed.
- An admitted call's reply carries no token echo, whatever the request asked (`logprobs`,
  `return_token_ids`): no `prompt_token_ids`, no choice `token_ids`, choice `logprobs` null. The
  staged record is the source of truth for the ids; Gym's external-staging gate strips those
  fields unread and reads only the message, `finish_reason`, `id` and `ng_commit_coords`. The
  capture core reads the ids from an internal payload (`_capture_payload`), never from the reply.
  Plain calls (no admission: the legacy path) echo exactly as before.
- Prefix seeding: a staged ROOT or `staging_chain` continuation enters the `PrefixCache` as the
  entry a fetch of its key would give (`PrefixCache.seed` checks the delta against the staged
  chain hash), so the next turn of the rollout on this worker resolves its chain without a fetch.
  It enters only once its row is durable (write-behind: `StageBarrier.when_written`, a lost row
  never seeds; before-reply: at once), so the cache holds only durable rows.
- Never a silently uncaptured success: if custody fails after generation (tail cannot be
  rendered exactly, staging fails or times out), the reply carries `capture_failed` coords and
  the reason is counted and kept in `capture_failures`.
- Any chat model: prompts are the tokenizer's own chat template; the end-of-turn text used by
  token-in tails is probed from that template once at construction (`chat.derive_turn_end`; if
  it cannot be found every token-in call is `capture_failed`); replies are parsed with the
  configured `tool_call_parser` (vLLM's names, `chat.TOOL_CALL_PARSERS`).
- Caller errors are `HttpError`s with a status, a named type and the field (`param`): 400 for an
  invalid request (`request_rules.check_chat_request`, the chat template refusing the
  messages, sampling values the engine refuses) or admission (Gym's `CaptureAdmission`, inline
  prefix ids outside the vocabulary), 409 `prefix_mismatch` when staged records do not form the
  chain the admission names, 409 `duplicate_model_call_id` when this worker already admitted
  the same (rollout_id, model_call_id) under another request body (remembered LRU,
  `max_admitted_calls`; a call refused or not generated is forgotten, so its retry is admitted; a
  call generated once, staged or `capture_failed`, is never generated again). Generation never
  starts from an unverified prefix.
- Transport re-sends are idempotent: the registry keeps each admitted call's request digest
  (`request_digest`: sha256 of the whole body's canonical JSON; a re-send is the same bytes, so no
  field may differ) and, once answered, its reply. A re-send of a committed call with the same
  digest gets that reply (same ids, same `ng_commit_coords`; nothing generated, staged or recorded;
  `stats["replayed_calls"]`). A re-send of a call still in flight waits for it (bounded by
  `duplicate_wait_s`, the worker's `duplicate_wait_bound_s`), then is replayed, or, if the first
  was refused or not generated, admitted in its place; past the bound it is 409. A call generated
  without a committed reply (a bug raised after generation) is 409, never replayed. Once the
  driver takes a rollout's served report (`take_served`) its calls are retired: their replies are
  dropped (the registry then holds a key and a digest per call, not a reply), and a re-send is 409,
  since the rollout's evidence is already judged.
- Expected failures of the components are 503s with a named type, and nothing else is: the
  staging source's named errors (`StagingFetchError`: missing key, store unavailable or past its
  deadline) and data-plane errors are `staging_unavailable` (a stored record that is not a valid
  snapshot is 409 `prefix_mismatch`); the engine's `EngineFailedError` is `worker_failed`,
  `GenerationTimeoutError` is `generation_timeout`, `RefitGateTimeoutError` is
  `worker_refitting`. Any other exception is a bug and propagates (the transport answers 500 and
  fails the worker).
- Context overflow (vLLM's rule, checked on the final prompt ids BEFORE `begin_call` and before
  generation, for plain and admitted calls alike): a prompt of `max_model_len` tokens or more, or
  an explicit `max_tokens` that does not fit after the prompt, is a 400 `context_length_exceeded`
  whose message is vLLM's ("This model's maximum context length is N tokens. However, you
  requested M tokens ..."); Gym's gate matches "context length" in a worker 400 and answers a
  synthetic empty completion. Nothing is generated, staged or recorded for such a call. A request
  without `max_tokens` is clipped to the room left (vLLM's default), never rejected for it.
- Served witness: every admitted call that produced a completion leaves one `ServedCall`
  (generated-token count, parent, staged or why not, this worker's index, and whether a `text`
  admission's history held an assistant turn: an unresolved continuation) in a bounded per-rollout
  registry; `take_served(rollout_ids)` pops them. Under write-behind staging (a `StageBarrier`
  installed) it first waits for the rollouts' queued rows and marks a call whose row did not land
  as not staged (`stats["capture_failed"]`, `capture_failures`, an error log line): a row the
  writer withdrew or abandoned at the deadline is lost for good (`stage_writer.py`). Plain calls,
  replayed re-sends and calls that produced no completion (rejected, or the engine raised) leave
  none. Past `max_served_rollouts` rollouts the least recently written one is dropped and counted
  in `stats["served_evicted_rollouts"]`.
- The one parents' check (`_check_parents`), for every continuation, `staging_chain` or inline
  prefix, under write-behind: parents this worker queued must be written (`StageWriter.wait_keys`,
  bounded by the barrier's deadline; lost or still pending: 503 `staging_unavailable` naming the
  keys, nothing generated); a parent it cannot vouch for is proven by the store (the chain's
  resolve reads what the cache lacks, and the cache holds only durable rows; an inline parent is
  read, `PrefixCache.staged_tip`, and must end at `prev_len` with `parent_chain_hash`, else 409
  `prefix_mismatch`). Parents staged by another worker are waited for by the prefix source (a
  missing key is re-read until it appears, bounded).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from jinja2 import TemplateError
from pydantic import ValidationError

from nemo_gym.token_id_capture.staging import (
    ActiveCall,
    CaptureAdmission,
    CaptureError,
    CommitCoords,
    RolloutTokenCapture,
    staging_key,
)
from nemo_rl.data_plane.errors import DataPlaneError
from nemo_rl.models.generation.vllm.chat import (
    ChatTemplateTokenizer,
    InvalidChatRequest,
    SamplingRequest,
    TailRenderError,
    TemplateProbeError,
    assistant_reply,
    build_chat_completion,
    chat_tools,
    derive_turn_end,
    get_tool_call_parser,
    new_request_id,
    normalize_messages,
    parses_tool_calls,
    render_root_prompt,
    render_token_in_tail,
    sampled_turn_close,
    sampling_from_body,
)
from nemo_rl.models.generation.vllm.engine import (
    EngineFailedError,
    GenerationTimeoutError,
    RefitGateTimeoutError,
)
from nemo_rl.models.generation.vllm.prefix_cache import PrefixCache, PrefixError, PrefixMismatchError
from nemo_rl.models.generation.vllm.request_rules import RequestFieldError, check_chat_request
from nemo_rl.utils import instrumentation  # opt-in per-call cost (benchmarks/capture_ab.py)
from nemo_rl.token_capture.served import ServedCall, has_assistant_turn
from nemo_rl.token_capture.stage_writer import ParentRows
from nemo_rl.token_capture.staging import StagedRecordInvalidError, StagingFetchError

LOGGER = logging.getLogger(__name__)

DEFAULT_MAX_SERVED_ROLLOUTS = 100_000
# How long a re-send waits for the same call still in flight before it is refused (409). The worker
# passes its own bound (`duplicate_wait_bound_s`); this is the default of a bare ChatService.
DEFAULT_DUPLICATE_WAIT_S = 60.0


def duplicate_wait_bound_s(generate_timeout_s: float, stage_timeout_s: float) -> float:
    """The longest an admitted call can take here: the parents' wait, a prefix read (which may wait
    for a missing key), the generation and a before-reply write, each under its own deadline."""
    return generate_timeout_s + 3 * stage_timeout_s


class HttpError(Exception):
    """An answer for the caller: status, named type, message and (when one is at fault) the field."""

    def __init__(self, status: int, err_type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.message = message
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def _admission_field(e: ValidationError) -> str:
    """`ng_capture.<loc>` of the first error pydantic reports for an admission."""
    loc = e.errors()[0].get("loc", ()) if e.errors() else ()
    return ".".join(["ng_capture", *(str(part) for part in loc)])


def request_digest(body: Mapping[str, Any]) -> str:
    """sha256 of the request body's canonical JSON (sorted keys, no whitespace): what a re-send must match.

    The whole body, every field: a transport re-send carries the very bytes of the original (Gym's
    client re-sends the same encoded body after a connection error), so no field may differ. Any
    difference (another message, other sampling values, another admission) is another request
    under a used id, answered 409.
    """
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(eq=False)
class AdmittedCall:
    """One admitted (rollout_id, model_call_id): its request digest and, once answered, its reply.

    Mutable bookkeeping owned by `AdmittedCalls` (it flips under the registry's lock)."""

    digest: str
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set once committed, released or spoiled
    reply_json: bytes | None = None  # the committed reply, compact JSON (replayed to a re-send)
    spoiled: bool = False  # generated, but no reply was committed (a bug raised after generation)
    retired: bool = False  # its rollout's served report was taken: the reply is dropped, never replayed


class AdmittedCalls:
    """Bounded LRU of admitted (rollout_id, model_call_id) -> `AdmittedCall`; thread-safe.

    Memory: per remembered call its key, a digest and, until its rollout is reported (`retire`),
    the committed reply as compact JSON (no token echo: message, finish_reason, id and commit
    coordinates). Only rollouts still running hold replies.
    """

    def __init__(self, max_calls: int) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls={max_calls}: must be >= 1")
        self._max_calls = max_calls
        self._calls: OrderedDict[tuple[str, str], AdmittedCall] = OrderedDict()
        self._lock = threading.Lock()

    def claim(self, key: tuple[str, str], digest: str) -> AdmittedCall | None:
        """Remember `key` as admitted with `digest` and return None; if it is remembered, its entry."""
        with self._lock:
            known = self._calls.get(key)
            if known is not None:
                self._calls.move_to_end(key)
                return known
            self._calls[key] = AdmittedCall(digest)
            while len(self._calls) > self._max_calls:
                self._calls.popitem(last=False)
            return None

    def commit(self, key: tuple[str, str], reply: Mapping[str, Any]) -> None:
        """The call was answered with `reply`: a re-send of the same request replays it."""
        encoded = json.dumps(reply, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
        with self._lock:
            call = self._calls.get(key)
            if call is not None:
                call.reply_json = encoded
                call.settled.set()

    def spoil(self, key: tuple[str, str]) -> None:
        """The call was generated but no reply was committed: never generated again, never replayed."""
        with self._lock:
            call = self._calls.get(key)
            if call is not None:
                call.spoiled = True
                call.settled.set()

    def retire(self, keys: Iterable[tuple[str, str]]) -> None:
        """These calls' rollouts were reported: drop their replies; a re-send of one is refused."""
        with self._lock:
            for key in keys:
                call = self._calls.get(key)
                if call is not None:
                    call.reply_json = None
                    call.retired = True
                    call.settled.set()

    def release(self, key: tuple[str, str]) -> None:
        """Forget a call refused or not generated, so its retry is admitted afresh."""
        with self._lock:
            call = self._calls.pop(key, None)
        if call is not None:
            call.settled.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)


class GenerationResultLike(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class Generator(Protocol):
    weight_version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingRequest, request_id: str) -> GenerationResultLike: ...


class StageBarrier(Protocol):
    """Write-behind staging's barriers (`StageWriter` implements them)."""

    def flush(self, rollout_ids: list[str], timeout_s: float) -> dict[str, str]: ...

    def wait_keys(self, keys: list[str], timeout_s: float) -> ParentRows: ...

    def when_written(self, key: str, fn) -> bool: ...


@dataclass(frozen=True)
class _Plan:
    admission: CaptureAdmission
    call: ActiveCall  # from the one `begin_call`; its weight version is restamped after generation
    prefix: list[int] | None
    prompt_ids: list[int]
    tail_error: str | None
    sampling: SamplingRequest
    history_has_assistant_turn: bool  # with a text admission: a continuation the gate found no parent for


def context_overflow_message(prompt_len: int, requested: int | None, max_model_len: int) -> str | None:
    """vLLM's context-length rejection for this request, or None when it fits.

    `requested` is the caller's explicit max_tokens (None: the server default, clipped to the
    room left). The wording is vLLM's, so anything that recognizes a vLLM overflow (Gym's gate
    looks for "context length" in a 400) recognizes ours.
    """
    if prompt_len >= max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len} tokens in the messages, Please reduce the length of the messages."
        )
    if requested is not None and prompt_len + requested > max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return None


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


class ServedRegistry:
    """Bounded rollout_id -> [ServedCall] (call order kept); thread-safe.

    Rollouts are ordered by their latest record; past `max_rollouts` the least recently written
    rollout is dropped whole. `record` returns how many rollouts it evicted.
    """

    def __init__(self, max_rollouts: int) -> None:
        if max_rollouts < 1:
            raise ValueError(f"max_rollouts={max_rollouts}: must be >= 1")
        self._max_rollouts = max_rollouts
        self._by_rollout: OrderedDict[str, list[ServedCall]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, call: ServedCall) -> int:
        with self._lock:
            self._by_rollout.setdefault(call.rollout_id, []).append(call)
            self._by_rollout.move_to_end(call.rollout_id)
            evicted = 0
            while len(self._by_rollout) > self._max_rollouts:
                self._by_rollout.popitem(last=False)
                evicted += 1
        return evicted

    def take(self, rollout_ids: list[str]) -> list[ServedCall]:
        """Pop the records of `rollout_ids` (in the order asked; unknown ids contribute nothing)."""
        out: list[ServedCall] = []
        with self._lock:
            for rid in rollout_ids:
                out.extend(self._by_rollout.pop(rid, ()))
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_rollout)


class ChatService:
    def __init__(
        self,
        engine: Generator,
        tokenizer: ChatTemplateTokenizer,
        *,
        model_name: str,
        default_max_tokens: int,
        max_model_len: int,
        tool_call_parser: str,
        vocab_size: int,
        max_admitted_calls: int,
        worker_index: int = 0,
        max_served_rollouts: int = DEFAULT_MAX_SERVED_ROLLOUTS,
        duplicate_wait_s: float = DEFAULT_DUPLICATE_WAIT_S,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 1")
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size}: must be >= 1")
        self._vocab_size = vocab_size
        if duplicate_wait_s <= 0:
            raise ValueError(f"duplicate_wait_s={duplicate_wait_s}: must be > 0")
        self._admitted = AdmittedCalls(max_admitted_calls)
        self._duplicate_wait_s = duplicate_wait_s
        self._engine = engine
        self._tokenizer = tokenizer
        get_tool_call_parser(tool_call_parser)  # an unknown name fails here, at construction
        self._tool_call_parser = tool_call_parser
        # The template's end-of-turn text, probed once; if the template hides it, every token-in
        # call is capture_failed (plain and ROOT calls are unaffected).
        try:
            self._turn_end: str | None = derive_turn_end(tokenizer)
            self._turn_end_error: str | None = None
        except TemplateProbeError as e:
            self._turn_end, self._turn_end_error = None, str(e)
            LOGGER.error("token-in tails cannot be rendered for this model: %s", e)
        self._model_name = model_name
        self._default_max_tokens = default_max_tokens
        self._max_model_len = max_model_len
        self.worker_index = worker_index
        self.capture: RolloutTokenCapture | None = None
        self.prefix_cache: PrefixCache | None = None
        self.stats: Counter[str] = Counter()
        self.capture_failures: deque[dict] = deque(maxlen=1000)
        self._served = ServedRegistry(max_served_rollouts)
        self._stage_barrier: StageBarrier | None = None
        self._stage_flush_timeout_s = 0.0

    # Gym's `install_capture(serving_layer, ...)` seam.
    def install_token_capture(self, capture: RolloutTokenCapture) -> None:
        self.capture = capture

    def install_prefix_cache(self, cache: PrefixCache) -> None:
        self.prefix_cache = cache

    def install_stage_barrier(self, barrier: StageBarrier, timeout_s: float) -> None:
        """Write-behind staging: `take_served` first waits (up to `timeout_s`) for the rollouts' rows."""
        self._stage_barrier, self._stage_flush_timeout_s = barrier, timeout_s

    async def chat_completions(self, body: Any) -> dict:
        try:
            check_chat_request(body, max_model_len=self._max_model_len)
        except RequestFieldError as e:
            raise HttpError(400, "invalid_request", e.message, param=e.field) from e
        try:
            messages = normalize_messages(body.get("messages"))
            tools = chat_tools(body.get("tools"))
            sampling = sampling_from_body(body, default_max_tokens=self._default_max_tokens)
        except InvalidChatRequest as e:
            raise HttpError(400, "invalid_request", str(e)) from e
        raw_admission = body.get("ng_capture")
        if raw_admission is None:
            return await self._serve_plain(
                messages, tools, sampling, parse_tools=parses_tool_calls(tools, body.get("tool_choice"))
            )
        admission = self._validate_admission(raw_admission)
        key = (admission.rollout_id, admission.model_call_id)
        replay = await self._claim_or_replay(key, request_digest(body), admission)
        if replay is not None:
            return replay
        try:
            plan = await self._plan_admitted(admission, body, messages, tools, sampling)
            result = await self._generate(plan.prompt_ids, plan.sampling)
        except BaseException:
            # Refused or not generated (timeout, failed engine): nothing was staged under this id, so a
            # retry of the same call (Gym's client retries 5xx with the same body) may use it.
            self._admitted.release(key)
            raise
        try:
            reply = await self._serve_admitted(plan, result)
        except BaseException:
            self._admitted.spoil(key)  # generated once: never again, and there is no reply to replay
            raise
        self._admitted.commit(key, reply)
        return reply

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

    def _duplicate(self, admission: CaptureAdmission, why: str) -> HttpError:
        self.stats["duplicate_model_call_id"] += 1
        return HttpError(
            409,
            "duplicate_model_call_id",
            f"rollout {admission.rollout_id!r} call {admission.model_call_id!r} {why}; a model_call_id is served "
            "once, and only a byte-identical re-send is replayed (fix: mint a fresh model_call_id per call)",
            param="ng_capture.model_call_id",
        )

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

    def _unstaged_if_lost(self, call: ServedCall, failures: dict[str, str]) -> ServedCall:
        why = failures.get(staging_key(call.rollout_id, call.model_call_id))
        if why is None or not call.staged:
            return call
        self.stats["capture_failed"] += 1
        self.capture_failures.append({"rollout_id": call.rollout_id, "model_call_id": call.model_call_id, "reason": why})
        LOGGER.error("capture_failed after reply rollout=%s call=%s: %s", call.rollout_id, call.model_call_id, why)
        return replace(call, staged=False, failure=why)

    def served_rollouts_pending(self) -> int:
        return len(self._served)

    def _fit_context(self, prompt_ids: list[int], sampling: SamplingRequest) -> SamplingRequest:
        """400 on context overflow; otherwise the sampling with max_tokens clipped to the room left."""
        requested = sampling.max_tokens if sampling.max_tokens_explicit else None
        message = context_overflow_message(len(prompt_ids), requested, self._max_model_len)
        if message is not None:
            self.stats["context_length_exceeded"] += 1
            field = "messages" if len(prompt_ids) >= self._max_model_len else "max_tokens"
            raise HttpError(400, "context_length_exceeded", message, param=field)
        room = self._max_model_len - len(prompt_ids)
        return sampling if sampling.max_tokens <= room else replace(sampling, max_tokens=room)

    def tokenize(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise HttpError(400, "invalid_request", "request body must be a JSON object", param="body")
        try:
            if "messages" in body:
                check_chat_request({"messages": body["messages"], "tools": body.get("tools")}, max_model_len=self._max_model_len)
                ids = self._render_root(normalize_messages(body["messages"]), chat_tools(body.get("tools")))
            elif isinstance(body.get("prompt"), str):
                ids = self._tokenizer.encode(body["prompt"], add_special_tokens=False)
            else:
                raise RequestFieldError("messages", "tokenize needs `messages` (chat) or `prompt` (a string)")
        except RequestFieldError as e:
            raise HttpError(400, "invalid_request", e.message, param=e.field) from e
        except InvalidChatRequest as e:
            raise HttpError(400, "invalid_request", str(e)) from e
        return {"tokens": ids, "count": len(ids)}

    def _render_root(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The whole conversation through the model's template; a template refusal is the caller's 400."""
        try:
            return render_root_prompt(self._tokenizer, messages, tools)
        except TemplateError as e:  # templates `raise_exception` on conversations they do not accept
            raise HttpError(
                400, "invalid_request", f"the model's chat template cannot render these messages: {e}", param="messages"
            ) from e

    async def _serve_plain(
        self, messages: list[dict], tools: list[dict] | None, sampling: SamplingRequest, *, parse_tools: bool
    ) -> dict:
        prompt_ids = self._render_root(messages, tools)
        sampling = self._fit_context(prompt_ids, sampling)
        result = await self._generate(prompt_ids, sampling)
        self.stats["plain_calls"] += 1
        self.stats["served_calls"] += 1
        return self._response(
            result,
            include_logprobs=sampling.logprobs,
            include_token_ids=sampling.return_token_ids,
            parse_tools=parse_tools,
            tokens_as_ids=sampling.return_tokens_as_token_ids,
        )

    def _validate_admission(self, raw: Any) -> CaptureAdmission:
        if self.capture is None:
            raise HttpError(
                400,
                "capture_not_installed",
                "request carries ng_capture but token capture is not installed on this worker "
                "(set token_capture.enabled=true, or point the gate at a capture-off worker)",
                param="ng_capture",
            )
        try:
            admission = CaptureAdmission.model_validate(raw)
        except ValidationError as e:
            raise HttpError(
                400, "invalid_capture_admission", f"ng_capture is not a valid CaptureAdmission: {e}",
                param=_admission_field(e),
            ) from e
        outside = [t for t in admission.required_prefix_token_ids if not 0 <= t < self._vocab_size]
        if outside:
            raise HttpError(
                400,
                "invalid_capture_admission",
                f"ng_capture.required_prefix_token_ids holds {len(outside)} id(s) outside this model's vocabulary "
                f"0..{self._vocab_size - 1} (first: {outside[0]})",
                param="ng_capture.required_prefix_token_ids",
            )
        return admission

    async def _plan_admitted(
        self,
        admission: CaptureAdmission,
        body: dict,
        messages: list[dict],
        tools: list[dict] | None,
        sampling: SamplingRequest,
    ) -> _Plan:
        assert self.capture is not None  # _validate_admission refused the call otherwise
        if admission.mode == "text":
            prefix = None
            prompt_ids, tail_error = self._render_root(messages, tools), None
        else:
            prefix = await self._resolve_prefix(admission, body)
            try:
                if self._turn_end is None:
                    raise TailRenderError(f"no end-of-turn marker: {self._turn_end_error}")
                tail = render_token_in_tail(
                    self._tokenizer,
                    messages,
                    tools,
                    turn_end=self._turn_end,
                    sampled_close=sampled_turn_close(self._tokenizer, prefix),
                )
                prompt_ids, tail_error = prefix + tail, None
            except TailRenderError as e:
                # Serve the turn from the re-rendered conversation, but never as captured.
                prompt_ids, tail_error = self._render_root(messages, tools), f"tail_render_failed: {e}"
            except TemplateError as e:
                raise HttpError(
                    400, "invalid_request", f"the model's chat template cannot render these messages: {e}",
                    param="messages",
                ) from e
        sampling = self._fit_context(prompt_ids, sampling)  # before any capture lifecycle step
        try:
            # The one admission check: Gym validates the admission against the resolved prefix here,
            # before any token is generated. The version is provisional (a refit may land before the
            # generation is admitted); `_serve_admitted` restamps the one the generation ran with.
            call = self.capture.begin_call(
                admission, prefix_token_ids=prefix, stream=False, weight_version=self._engine.weight_version
            )
        except CaptureError as e:
            raise HttpError(400, "invalid_capture_admission", str(e), param="ng_capture") from e
        return _Plan(
            admission=admission, call=call, prefix=prefix, prompt_ids=prompt_ids, tail_error=tail_error, sampling=sampling,
            history_has_assistant_turn=has_assistant_turn(messages),
        )

    async def _resolve_prefix(self, admission: CaptureAdmission, body: dict) -> list[int]:
        """The parent's exact ids; every continuation passes the one parents' check first."""
        if admission.staging_chain:
            where, param = f"staging_chain of call {admission.model_call_id}", "ng_capture.staging_chain"
            if self.prefix_cache is None:
                raise HttpError(503, "staging_unavailable", "no staging source is configured to resolve staging_chain",
                                param=param)
            await self._check_parents(admission, where, param)
            try:
                # Bounded: every staging read carries token_capture.stage_timeout_s (the source's deadline).
                return await asyncio.to_thread(
                    self.prefix_cache.resolve, list(admission.staging_chain), admission.prev_len, admission.parent_chain_hash
                )
            except (PrefixMismatchError, StagedRecordInvalidError) as e:
                raise HttpError(409, "prefix_mismatch", f"{where}: {type(e).__name__}: {e}", param=param) from e
            except (PrefixError, StagingFetchError, DataPlaneError) as e:
                raise HttpError(503, "staging_unavailable", f"{where}: {type(e).__name__}: {e}", param=param) from e
        inline = list(admission.required_prefix_token_ids)
        top = body.get("required_prefix_token_ids")
        if top not in (None, []) and list(top) != inline:
            raise HttpError(
                400, "invalid_capture_admission", "top-level required_prefix_token_ids disagree with ng_capture",
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
            raise HttpError(
                503, "staging_unavailable",
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
            raise HttpError(503, "staging_unavailable",
                            f"{where}: no staging source is configured to prove parent {key} durable", param=param)
        try:
            cum_len, chain_hash = await asyncio.to_thread(self.prefix_cache.staged_tip, key)
        except StagedRecordInvalidError as e:
            raise HttpError(409, "prefix_mismatch", f"{where}: {type(e).__name__}: {e}", param=param) from e
        except (StagingFetchError, DataPlaneError, PrefixError) as e:
            raise HttpError(503, "staging_unavailable", f"{where}: {type(e).__name__}: {e}", param=param) from e
        if (cum_len, chain_hash) != (admission.prev_len, admission.parent_chain_hash):
            raise HttpError(
                409, "prefix_mismatch",
                f"{where}: parent row {key} ends at {cum_len} ids with chain hash {chain_hash}, the admission says "
                f"prev_len {admission.prev_len} and parent_chain_hash {admission.parent_chain_hash}",
                param=param,
            )

    async def _serve_admitted(self, plan: _Plan, result: GenerationResultLike) -> dict:
        assert self.capture is not None
        admission = plan.admission
        call = _stamped(plan.call, result.weight_version)
        if plan.tail_error is not None:
            coords = self.capture.fail_call(call, reason=plan.tail_error)
            reason = plan.tail_error
        else:
            coords = await asyncio.to_thread(self.capture.complete_call_from_response, call, _capture_payload(result))
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
        reply = self._response(result, include_logprobs=False, include_token_ids=False)
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

    async def _generate(self, prompt_ids: list[int], sampling: SamplingRequest) -> GenerationResultLike:
        started = time.perf_counter()
        try:
            result = await self._engine.generate(prompt_ids, sampling, new_request_id())
            instrumentation.add_call_cost("generate_s", time.perf_counter() - started)  # the engine's part, both paths
            return result
        except InvalidChatRequest as e:
            raise HttpError(400, "invalid_request", str(e)) from e
        except EngineFailedError as e:
            raise HttpError(503, "worker_failed", str(e)) from e
        except GenerationTimeoutError as e:
            self.stats["generation_timeout"] += 1
            raise HttpError(503, "generation_timeout", str(e)) from e
        except RefitGateTimeoutError as e:
            raise HttpError(503, "worker_refitting", str(e)) from e

    def _response(
        self,
        result: GenerationResultLike,
        *,
        include_logprobs: bool,
        include_token_ids: bool,
        parse_tools: bool = True,
        tokens_as_ids: bool = True,
    ) -> dict:
        parsed = assistant_reply(
            self._tokenizer, result.token_ids, parser=self._tool_call_parser, parse_tools=parse_tools
        )
        return build_chat_completion(
            request_id=result.request_id,
            model=self._model_name,
            parsed=parsed,
            finish_reason=result.finish_reason,
            prompt_token_ids=result.prompt_token_ids,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            include_logprobs=include_logprobs,
            include_token_ids=include_token_ids,
            # vLLM names a logprob entry by the token's own text unless asked for `token_id:N`.
            logprob_tokens=None if tokens_as_ids or not include_logprobs else [
                self._tokenizer.decode([t], skip_special_tokens=False) for t in result.token_ids
            ],
        )
