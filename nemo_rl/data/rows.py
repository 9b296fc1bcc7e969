"""Training rows, kept rollouts, masked placeholders and GRPO groups: the judge's output types.

Every dispatched rollout ends as exactly one `KeptRollout` (one `TrainRow` or `RowRef` per
verified chain, sharing the rollout's reward and advantage) or one `Placeholder` (typed
`PlaceholderReason` and a detail); a `GroupResult` holds exactly N entries, entry i with
`sample_index == i`, so kept + placeholders == dispatched by construction.
Invariants, checked at construction (`RecordInvariantError`, kind `row`): within a kept rollout
a generated token is in the loss at most once; a row's tokens, mask and logprobs align, the
prompt is masked and logprobs are 0.0 where the mask is; per-call spans cover the row exactly; a
capture row starts with a prompt token and its sampled logprobs are <= 0 (what `TrainBatch` takes).
Every field's invariant: docs/design-docs/token-capture-receipts.md, "Row types and their
invariants".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union

import numpy as np

from nemo_rl.data.errors import RecordInvariantError

class RowOrigin(str, Enum):
    """Where a row's tokens came from."""

    CAPTURE = "capture"  # worker-staged deltas verified by verify_and_linearize
    LEGACY = "legacy"  # Gym's per-call token echo on the /run result (capture off)


class PlaceholderReason(str, Enum):
    """Why a dispatched rollout was not trained. Values are metric keys: never repurpose one."""

    RUN_FAILED = "run_failed"
    RUN_TIMEOUT = "run_timeout"
    MANIFEST_UNAVAILABLE = "manifest_unavailable"
    EMPTY_MANIFEST = "empty_manifest"
    CAPTURE_POISONED = "capture_poisoned"
    TERMINAL_SELECTION_FAILED = "terminal_selection_failed"
    VERIFICATION_FAILED = "verification_failed"
    STAGED_RECORD_MISSING = "staged_record_missing"
    DATA_PLANE_ERROR = "data_plane_error"
    FINALIZE_TIMEOUT = "finalize_timeout"
    FINALIZER_UNAVAILABLE = "finalizer_unavailable"
    REWARD_MISSING = "reward_missing"
    EMPTY_GENERATION = "empty_generation"
    LEGACY_TOKEN_ECHO_MISSING = "legacy_token_echo_missing"
    LEGACY_INVALID_ECHO = "legacy_invalid_echo"
    LEGACY_NONCONTIGUOUS = "legacy_noncontiguous"
    TERMINAL_DECLARED_UNMATCHED = "terminal_declared_unmatched"
    DECLARED_TERMINAL_UNCAPTURED = "declared_terminal_uncaptured"
    TERMINAL_WITNESS_DISAGREEMENT = "terminal_witness_disagreement"
    TERMINAL_WITNESS_UNMATCHED = "terminal_witness_unmatched"
    SERVED_NOT_STAGED = "served_not_staged"
    MIXED_WEIGHT_VERSION = "mixed_weight_version"
    GROUP_BELOW_MIN_VALID_FRACTION = "group_below_min_valid_fraction"
    COMPONENT_FAILED = "component_failed"
    SERVED_REPORT_UNAVAILABLE = "served_report_unavailable"


def _check_slot(rollout_id: str, group_index: int, sample_index: int) -> None:
    if not isinstance(rollout_id, str) or not rollout_id:
        raise RecordInvariantError(f"rollout_id must be a non-empty str, got {rollout_id!r}", kind="row")
    for name, value in (("group_index", group_index), ("sample_index", sample_index)):
        if type(value) is not int or value < 0:
            raise RecordInvariantError(f"{rollout_id}: {name} must be a non-negative int, got {value!r}", kind="row")


@dataclass(frozen=True, slots=True)
class RouteCoverage:
    """R3 figures of one row: its tokens, loss tokens, loss tokens with a full route, tokens without one."""

    tokens: int
    loss_tokens: int
    covered_loss_tokens: int
    sentinel_tokens: int

    def __post_init__(self) -> None:
        values = (self.tokens, self.loss_tokens, self.covered_loss_tokens, self.sentinel_tokens)
        if any(type(v) is not int or v < 0 for v in values) or not (
            self.covered_loss_tokens <= self.loss_tokens <= self.tokens and self.sentinel_tokens <= self.tokens
        ):
            raise RecordInvariantError(f"RouteCoverage: need ints >= 0, covered <= loss <= tokens, sentinel <= tokens; "
                                       f"got {values}", kind="row")

    @classmethod
    def of(cls, token_mask: Sequence[float], routed_experts: Any) -> "RouteCoverage":
        """A token is covered iff none of its [L, K] entries is the sentinel -1 (no routes: none is)."""
        loss = np.asarray(token_mask) == 1.0
        if routed_experts is None:
            return cls(len(token_mask), int(loss.sum()), 0, len(token_mask))
        covered = ~(routed_experts == -1).any(axis=(1, 2))
        return cls(len(token_mask), int(loss.sum()), int((covered & loss).sum()), int((~covered).sum()))

    @property
    def has_routes(self) -> bool:
        """At least one token of the row (loss or carry) has a full route."""
        return self.sentinel_tokens < self.tokens


@dataclass(frozen=True, slots=True)
class TrainRow:
    """One verified, trainable rollout: the exact sampled tokens with their loss mask."""

    rollout_id: str
    group_index: int
    sample_index: int
    token_ids: tuple[int, ...]
    token_mask: tuple[float, ...]
    generation_logprobs: tuple[float, ...]
    reward: float
    prompt_len: int
    model_call_ids: tuple[str, ...]
    weight_versions: tuple[int | None, ...]
    token_in_calls: int
    text_root_calls: int
    terminal_selection: str | None
    origin: RowOrigin
    call_spans: tuple[tuple[int, int], ...] = ()
    chain_index: int = 0  # 0 is the terminal chain; others follow in manifest order of their leaf
    # R3: int16 [len(token_ids), L, K] expert ids (-1 = no route), or None (see the module contract).
    routed_experts: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_slot(self.rollout_id, self.group_index, self.sample_index)
        where = f"TrainRow {self.rollout_id}#{self.chain_index}"
        n = len(self.token_ids)
        if n == 0 or len(self.token_mask) != n or len(self.generation_logprobs) != n:
            raise RecordInvariantError(
                f"{where}: token_ids/token_mask/generation_logprobs lengths must be equal and "
                f"non-zero, got {n}/{len(self.token_mask)}/{len(self.generation_logprobs)}", kind="row"
            )
        if any(type(t) is not int or t < 0 for t in self.token_ids):
            raise RecordInvariantError(f"{where}: token_ids must be non-negative ints", kind="row")
        if any(m != 0.0 and m != 1.0 for m in self.token_mask):
            raise RecordInvariantError(f"{where}: token_mask values must be 0.0 or 1.0", kind="row")
        if 1.0 not in self.token_mask:
            raise RecordInvariantError(f"{where}: token_mask has no masked-in (generated) token", kind="row")
        for mask, logprob in zip(self.token_mask, self.generation_logprobs):
            if not isinstance(logprob, float) or not math.isfinite(logprob):
                raise RecordInvariantError(f"{where}: generation_logprobs must be finite floats, got {logprob!r}", kind="row")
            if mask == 0.0 and logprob != 0.0:
                raise RecordInvariantError(f"{where}: masked-out tokens must carry logprob 0.0, got {logprob!r}", kind="row")
        if type(self.prompt_len) is not int or not 0 <= self.prompt_len < n:
            raise RecordInvariantError(f"{where}: prompt_len must be in [0, {n}), got {self.prompt_len!r}", kind="row")
        if any(m != 0.0 for m in self.token_mask[: self.prompt_len]):
            raise RecordInvariantError(f"{where}: the first prompt_len={self.prompt_len} tokens must be masked out", kind="row")
        if not isinstance(self.reward, float) or not math.isfinite(self.reward):
            raise RecordInvariantError(f"{where}: reward must be a finite float, got {self.reward!r}", kind="row")
        if not self.model_call_ids or len(self.weight_versions) != len(self.model_call_ids):
            raise RecordInvariantError(
                f"{where}: need >= 1 model_call_ids and one weight version per call, got "
                f"{len(self.model_call_ids)} ids and {len(self.weight_versions)} versions", kind="row"
            )
        self._check_spans(where, n)
        self._check_origin(where)
        self._check_routes(where, n)

    def _check_routes(self, where: str, n: int) -> None:
        routes = self.routed_experts
        if routes is None:
            return
        if not isinstance(routes, np.ndarray) or routes.dtype != np.int16 or routes.ndim != 3:
            described = f"{routes.dtype} ndarray of ndim {routes.ndim}" if isinstance(routes, np.ndarray) \
                else type(routes).__name__
            raise RecordInvariantError(f"{where}: routed_experts must be None or an int16 ndarray [tokens, L, K], "
                                       f"got {described}", kind="row")
        if routes.shape[0] != n or routes.shape[1] < 1 or routes.shape[2] < 1:
            raise RecordInvariantError(
                f"{where}: routed_experts shape {routes.shape} must be ({n}, L >= 1, K >= 1)", kind="row"
            )
        if routes.size and int(routes.min()) < -1:
            raise RecordInvariantError(
                f"{where}: routed_experts holds {int(routes.min())}; ids are >= 0, -1 is the sentinel", kind="row"
            )
        if routes.flags.writeable:
            view = routes.view()
            view.flags.writeable = False
            object.__setattr__(self, "routed_experts", view)

    def _check_spans(self, where: str, n: int) -> None:
        if type(self.chain_index) is not int or self.chain_index < 0:
            raise RecordInvariantError(f"{where}: chain_index must be a non-negative int", kind="row")
        if not self.call_spans:
            if self.origin is RowOrigin.CAPTURE:
                raise RecordInvariantError(f"{where}: capture rows need one call span per call", kind="row")
            return
        _check_call_spans(where, self.call_spans, len(self.model_call_ids), n)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The prompt of the first call of the row's chain."""
        return self.token_ids[: self.prompt_len]

    @property
    def route_coverage(self) -> RouteCoverage:
        return RouteCoverage.of(self.token_mask, self.routed_experts)

    @property
    def token_weight_versions(self) -> tuple[int | None, ...]:
        """The policy version that produced (or carried) each token, expanded from the call spans."""
        if not self.call_spans:
            return (None,) * len(self.token_ids)
        out: list[int | None] = []
        for (start, end), version in zip(self.call_spans, self.weight_versions):
            out += [version] * (end - start)
        return tuple(out)

    def loss_call_ids(self) -> frozenset[str]:
        """Calls that contribute at least one token to the loss in this row."""
        if not self.call_spans:
            return frozenset(self.model_call_ids)
        return frozenset(
            call_id for call_id, (start, end) in zip(self.model_call_ids, self.call_spans)
            if any(m == 1.0 for m in self.token_mask[start:end])
        )

    def _check_origin(self, where: str) -> None:
        if self.origin is RowOrigin.CAPTURE:
            if self.token_in_calls < 0 or self.text_root_calls < 0 or (
                self.token_in_calls + self.text_root_calls != len(self.model_call_ids)
            ):
                raise RecordInvariantError(
                    f"{where}: token_in_calls={self.token_in_calls} + text_root_calls={self.text_root_calls} "
                    f"must equal the {len(self.model_call_ids)} chain calls", kind="row"
                )
            if any(type(v) is not int or v < 0 for v in self.weight_versions):
                raise RecordInvariantError(f"{where}: capture rows need a non-negative int weight version per call", kind="row")
            if self.terminal_selection is None:
                raise RecordInvariantError(f"{where}: capture rows must name their terminal_selection method", kind="row")
            if self.token_mask[0] != 0.0:
                raise RecordInvariantError(f"{where}: capture rows start with a prompt token (token 0 has no prefix, "
                                           "so it is never in the loss)", kind="row")
            if any(m == 1.0 and lp > 0.0 for m, lp in zip(self.token_mask, self.generation_logprobs)):
                raise RecordInvariantError(f"{where}: a sampled token's logprob must be <= 0", kind="row")
        elif self.origin is RowOrigin.LEGACY:
            if self.token_in_calls or self.text_root_calls or self.terminal_selection is not None:
                raise RecordInvariantError(f"{where}: legacy rows carry no call modes and no terminal selection", kind="row")
            if any(v is not None for v in self.weight_versions):
                raise RecordInvariantError(f"{where}: legacy rows carry no weight versions (the echo has none)", kind="row")
        else:
            raise RecordInvariantError(f"{where}: origin must be a RowOrigin, got {self.origin!r}", kind="row")

    @property
    def num_generated_tokens(self) -> int:
        return sum(1 for m in self.token_mask if m == 1.0)


def _check_call_spans(where: str, spans: Sequence[tuple[int, int]], calls: int, n: int) -> None:
    if len(spans) != calls:
        raise RecordInvariantError(f"{where}: {len(spans)} call spans for {calls} calls", kind="row")
    cursor = 0
    for start, end in spans:
        if start != cursor or end <= start:
            raise RecordInvariantError(f"{where}: call spans must be contiguous, non-empty and start at 0", kind="row")
        cursor = end
    if cursor != n:
        raise RecordInvariantError(f"{where}: call spans cover {cursor} tokens of {n}", kind="row")


@dataclass(frozen=True, slots=True)
class RowRef:
    """A capture row whose payload is in the train partition under `key` (see the module contract)."""

    rollout_id: str
    group_index: int
    sample_index: int
    chain_index: int
    key: str
    digest: str  # sha256 hex of the stored payload (`nemo_rl.data.train.payload_digest`)
    num_tokens: int
    prompt_len: int
    num_generated_tokens: int  # loss (mask 1.0) tokens
    reward: float
    model_call_ids: tuple[str, ...]
    weight_versions: tuple[int, ...]
    token_in_calls: int
    text_root_calls: int
    terminal_selection: str
    call_spans: tuple[tuple[int, int], ...]
    loss_calls: frozenset[str]
    route_coverage: RouteCoverage
    prompt_ids: tuple[int, ...] | None = None  # only when logger.dump_first_call_prompt_ids

    origin = RowOrigin.CAPTURE  # class constant: only capture rows go through the train partition

    def __post_init__(self) -> None:
        _check_slot(self.rollout_id, self.group_index, self.sample_index)
        where = f"RowRef {self.rollout_id}#{self.chain_index}"
        n = self.num_tokens
        if type(self.chain_index) is not int or self.chain_index < 0:
            raise RecordInvariantError(f"{where}: chain_index must be a non-negative int", kind="row")
        if not isinstance(self.key, str) or not self.key:
            raise RecordInvariantError(f"{where}: key must be a non-empty str", kind="row")
        if not isinstance(self.digest, str) or len(self.digest) != 64 or any(c not in "0123456789abcdef" for c in self.digest):
            raise RecordInvariantError(f"{where}: digest must be a sha256 hex digest, got {self.digest!r}", kind="row")
        if type(n) is not int or n < 1 or type(self.prompt_len) is not int or not 0 <= self.prompt_len < n:
            raise RecordInvariantError(f"{where}: need num_tokens >= 1 and prompt_len in [0, num_tokens), got "
                                       f"{n!r}/{self.prompt_len!r}", kind="row")
        if type(self.num_generated_tokens) is not int or not 1 <= self.num_generated_tokens <= n - self.prompt_len:
            raise RecordInvariantError(f"{where}: num_generated_tokens must be in [1, {n - self.prompt_len}], got "
                                       f"{self.num_generated_tokens!r}", kind="row")
        if not isinstance(self.reward, float) or not math.isfinite(self.reward):
            raise RecordInvariantError(f"{where}: reward must be a finite float, got {self.reward!r}", kind="row")
        calls = len(self.model_call_ids)
        if not calls or len(self.weight_versions) != calls or any(type(v) is not int or v < 0 for v in self.weight_versions):
            raise RecordInvariantError(f"{where}: need >= 1 calls and a non-negative int weight version per call", kind="row")
        if self.token_in_calls < 0 or self.text_root_calls < 0 or self.token_in_calls + self.text_root_calls != calls:
            raise RecordInvariantError(f"{where}: token_in_calls + text_root_calls must equal the {calls} chain calls", kind="row")
        if not isinstance(self.terminal_selection, str):
            raise RecordInvariantError(f"{where}: capture rows must name their terminal_selection method", kind="row")
        _check_call_spans(where, self.call_spans, calls, n)
        if not self.loss_calls or not self.loss_calls <= set(self.model_call_ids):
            raise RecordInvariantError(f"{where}: loss_calls must be a non-empty subset of model_call_ids", kind="row")
        cov = self.route_coverage
        if not isinstance(cov, RouteCoverage) or (cov.tokens, cov.loss_tokens) != (n, self.num_generated_tokens):
            raise RecordInvariantError(f"{where}: route_coverage must count the row's {n} tokens and "
                                       f"{self.num_generated_tokens} loss tokens, got {cov!r}", kind="row")
        if self.prompt_ids is not None and (
            len(self.prompt_ids) != self.prompt_len or any(type(t) is not int or t < 0 for t in self.prompt_ids)
        ):
            raise RecordInvariantError(f"{where}: prompt_ids must be None or {self.prompt_len} non-negative ints", kind="row")

    @classmethod
    def of(cls, row: TrainRow, key: str, digest: str, carry_prompt_ids: bool) -> "RowRef":
        """The reference the driver keeps for `row` once its payload is stored under `key`."""
        if row.origin is not RowOrigin.CAPTURE:
            raise RecordInvariantError(f"TrainRow {row.rollout_id}#{row.chain_index}: only capture rows have a RowRef", kind="row")
        return cls(
            row.rollout_id, row.group_index, row.sample_index, row.chain_index, key, digest, len(row.token_ids),
            row.prompt_len, row.num_generated_tokens, row.reward, row.model_call_ids, row.weight_versions,
            row.token_in_calls, row.text_root_calls, row.terminal_selection, row.call_spans, row.loss_call_ids(),
            row.route_coverage, row.prompt_ids if carry_prompt_ids else None,
        )

    def loss_call_ids(self) -> frozenset[str]:
        return self.loss_calls


@dataclass(frozen=True, slots=True)
class Placeholder:
    """A dispatched rollout that is masked out of the loss, with the typed reason why.

    `reward` is the environment's reward when the run produced one (else None); it is kept so
    reward metrics can count every dispatched rollout. `terminal_selection` is set when a receipt
    was assembled and named a terminal method before the rollout was rejected.
    """

    rollout_id: str
    group_index: int
    sample_index: int
    reason: PlaceholderReason
    detail: str
    reward: float | None = None
    terminal_selection: str | None = None
    yield_: "RolloutYield | None" = None

    def __post_init__(self) -> None:
        _check_slot(self.rollout_id, self.group_index, self.sample_index)
        if self.yield_ is not None and self.yield_.kept_generated_tokens:
            raise RecordInvariantError(f"Placeholder {self.rollout_id}: a placeholder keeps no generated token", kind="row")
        if not isinstance(self.reason, PlaceholderReason):
            raise RecordInvariantError(
                f"Placeholder {self.rollout_id}: reason must be a PlaceholderReason, got {self.reason!r}", kind="row"
            )
        if not isinstance(self.detail, str):
            raise RecordInvariantError(f"Placeholder {self.rollout_id}: detail must be a str, got {self.detail!r}", kind="row")
        if self.reward is not None and (not isinstance(self.reward, float) or not math.isfinite(self.reward)):
            raise RecordInvariantError(
                f"Placeholder {self.rollout_id}: reward must be a finite float or None, got {self.reward!r}", kind="row"
            )


def _check_counts(where: str, obj: Any, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if type(value) is not int or value < 0:
            raise RecordInvariantError(f"{where}: {name} must be a non-negative int, got {value!r}", kind="row")


@dataclass(frozen=True, slots=True)
class CallLineage:
    """How the gate admitted one rollout's served calls: its capture-health figures.

    From the workers' served report (each served call counted once) and the gate's manifest:
    `token_in_calls` were served from a captured parent's exact ids; `unresolved_continuations`
    were admitted as a new `text` root although their history held assistant turns (the gate
    found no captured parent: the harness re-rendered or edited what the model said), except
    the rollout's first committed call, which had nothing to continue; `branches` are the
    manifest's text roots beyond the first (history rewrites, sub-agents, unresolved calls).
    A continuation call is one of the first two kinds.
    """

    token_in_calls: int
    unresolved_continuations: int
    branches: int

    def __post_init__(self) -> None:
        _check_counts("CallLineage", self, ("token_in_calls", "unresolved_continuations", "branches"))

    @property
    def continuation_calls(self) -> int:
        """Calls that continue a conversation with assistant turns: token-in or unresolved."""
        return self.token_in_calls + self.unresolved_continuations


@dataclass(frozen=True, slots=True)
class RolloutYield:
    """Where one rollout's served generated tokens went (the workers' own counts as denominator).

    `served_generated_tokens` comes from the workers' served-call report (None when no report was
    available); `kept_generated_tokens` are loss tokens of the rollout's rows; `unverifiable`
    lists (reason, generated tokens) for every served call whose tokens are not in the loss and
    should have been. `abandoned_retry_calls` / `abandoned_retry_tokens` are retried replies the
    harness discarded (a sibling no later call continued, off the terminal chain): never in the
    loss, not unverifiable, and outside the yield's denominator (tokens from the served report,
    0 without one). `lineage` holds the capture-health figures (None without a served report or
    a manifest of this rollout).
    """

    served_generated_tokens: int | None
    kept_generated_tokens: int
    unverifiable: tuple[tuple[str, int], ...] = ()
    chains: int = 0
    witness_disagreement: bool = False
    abandoned_retry_calls: int = 0
    abandoned_retry_tokens: int = 0
    lineage: CallLineage | None = None

    def __post_init__(self) -> None:
        _check_counts("RolloutYield", self, ("kept_generated_tokens", "chains", "abandoned_retry_calls",
                                             "abandoned_retry_tokens"))
        if self.served_generated_tokens is not None and (
            type(self.served_generated_tokens) is not int or self.served_generated_tokens < 0
        ):
            raise RecordInvariantError("RolloutYield: served_generated_tokens must be a non-negative int or None", kind="row")
        if any(type(tokens) is not int or tokens < 0 for _, tokens in self.unverifiable):
            raise RecordInvariantError("RolloutYield: unverifiable token counts must be non-negative ints", kind="row")
        if self.served_generated_tokens is None and self.abandoned_retry_tokens:
            raise RecordInvariantError("RolloutYield: abandoned_retry_tokens come from the served report; without "
                                       "one they are 0", kind="row")
        if self.lineage is not None and not isinstance(self.lineage, CallLineage):
            raise RecordInvariantError(f"RolloutYield: lineage must be a CallLineage or None, got {self.lineage!r}", kind="row")


@dataclass(frozen=True, slots=True)
class KeptRollout:
    """A rollout that trains: its verified chains as rows (terminal chain first), one reward."""

    rollout_id: str
    group_index: int
    sample_index: int
    rows: tuple[TrainRow, ...] | tuple[RowRef, ...]
    reward: float
    terminal_selection: str | None
    yield_: RolloutYield | None = None

    def __post_init__(self) -> None:
        _check_slot(self.rollout_id, self.group_index, self.sample_index)
        where = f"KeptRollout {self.rollout_id}"
        if not self.rows:
            raise RecordInvariantError(f"{where}: a kept rollout needs at least one row", kind="row")
        owned: set[str] = set()
        for position, row in enumerate(self.rows):
            if not isinstance(row, (TrainRow, RowRef)) or type(row) is not type(self.rows[0]):
                raise RecordInvariantError(f"{where}: row {position} is {type(row).__name__}; rows are all "
                                           f"TrainRow or all RowRef", kind="row")
            if (row.rollout_id, row.group_index, row.sample_index) != (
                self.rollout_id, self.group_index, self.sample_index
            ):
                raise RecordInvariantError(f"{where}: row {position} belongs to {row.rollout_id} slot "
                                           f"{row.group_index}/{row.sample_index}", kind="row")
            if row.chain_index != position or row.reward != self.reward:
                raise RecordInvariantError(f"{where}: row {position} must have chain_index {position} and the rollout's reward", kind="row")
            shared = owned & row.loss_call_ids()
            if shared:
                raise RecordInvariantError(f"{where}: calls {sorted(shared)} are in the loss of two rows", kind="row")
            owned |= row.loss_call_ids()
        if self.yield_ is not None and self.yield_.kept_generated_tokens != self.num_generated_tokens:
            raise RecordInvariantError(
                f"{where}: yield counts {self.yield_.kept_generated_tokens} kept tokens, rows hold {self.num_generated_tokens}", kind="row"
            )

    @property
    def num_generated_tokens(self) -> int:
        return sum(row.num_generated_tokens for row in self.rows)


GroupEntry = Union[KeptRollout, Placeholder]


@dataclass(frozen=True, slots=True)
class GroupResult:
    """Exactly N outcomes for one GRPO group: entry i is sample i, one per dispatched rollout."""

    group_index: int
    entries: tuple[GroupEntry, ...]

    def __post_init__(self) -> None:
        if type(self.group_index) is not int or self.group_index < 0:
            raise RecordInvariantError(f"GroupResult: group_index must be a non-negative int, got {self.group_index!r}", kind="row")
        if not self.entries:
            raise RecordInvariantError(f"GroupResult {self.group_index}: a group needs at least one entry", kind="row")
        seen: set[str] = set()
        for position, entry in enumerate(self.entries):
            if not isinstance(entry, (KeptRollout, Placeholder)):
                raise RecordInvariantError(f"GroupResult {self.group_index}: entry {position} is {type(entry).__name__}", kind="row")
            if entry.sample_index != position or entry.group_index != self.group_index:
                raise RecordInvariantError(
                    f"GroupResult {self.group_index}: entry {position} is group {entry.group_index} "
                    f"sample {entry.sample_index}; entries must be samples 0..N-1 of this group in order", kind="row"
                )
            if entry.rollout_id in seen:
                raise RecordInvariantError(f"GroupResult {self.group_index}: rollout id {entry.rollout_id} appears twice", kind="row")
            seen.add(entry.rollout_id)

    @property
    def n(self) -> int:
        return len(self.entries)

    @property
    def kept(self) -> tuple[KeptRollout, ...]:
        return tuple(e for e in self.entries if isinstance(e, KeptRollout))

    @property
    def rows(self) -> tuple[TrainRow | RowRef, ...]:
        """Every training row of the group (a kept rollout may contribute several)."""
        return tuple(row for kept in self.kept for row in kept.rows)

    @property
    def placeholders(self) -> tuple[Placeholder, ...]:
        return tuple(e for e in self.entries if isinstance(e, Placeholder))
