"""The async producer's prompt ledger: every prompt queued, in flight, finished or consumed, once.

A prompt is a position in the seeded order of the `PromptSource`: position p is group `p % P` of
the synchronous loop's step `p // P + 1` (`slot_of`; P = grpo.num_prompts_per_step), so its row is
`prompts.batch(step, P)[group]`. States: queued -> in flight (`dispatch`: a `GroupTicket`, position
+ generation) -> finished (`finish`) -> consumed by a step (`commit_step`: trained, or failed =
every rollout a placeholder, accounted as today), or dropped stale (`drop_stale`: queued again, at
the front). The trainer consumes in position order: step s commits exactly positions (s-1)P..sP-1,
so each step trains the synchronous loop's prompts whatever finished first or was dropped.
`snapshot()` records the consumed cursor and every drawn, unconsumed prompt with its generation
counter; `restore` queues them all again, so those in flight are re-dispatched under a generation
(and rollout ids) never issued before. Every transition re-checks the invariants: nothing drawn is
lost, none consumed twice, no unknown or superseded ticket (an `AccountingError`; its `kind` says which).
See docs/design-docs/async-grpo.md, "The prompt ledger".
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_rl.data.calls import rollout_id_for
from nemo_rl.experience.errors import AccountingError

IN_FLIGHT_METRIC = "async/in_flight_groups"
DROPPED_STALE_METRIC = "async/dropped_stale_groups"


class SnapshotMismatchError(AccountingError):
    """A snapshot restored under another grpo.num_prompts_per_step (positions would name other prompts)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="snapshot_mismatch")


def _check_int(name: str, value: object, low: int) -> int:
    if type(value) is not int or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def slot_of(position: int, groups_per_step: int) -> tuple[int, int]:
    """(step, group) of the synchronous loop that draws `position` (steps 1-based, groups 0-based)."""
    _check_int("position", position, 0)
    _check_int("groups_per_step", groups_per_step, 1)
    return position // groups_per_step + 1, position % groups_per_step


def position_of(step: int, group: int, groups_per_step: int) -> int:
    """The inverse of `slot_of`."""
    _check_int("step", step, 1)
    _check_int("groups_per_step", groups_per_step, 1)
    if type(group) is not int or not 0 <= group < groups_per_step:
        raise ValueError(f"group must be an int in [0, {groups_per_step}), got {group!r}")
    return (step - 1) * groups_per_step + group


@dataclass(frozen=True, slots=True)
class GroupTicket:
    """One dispatch of one prompt: `generation` counts the prompt's earlier dispatches (0 first)."""

    position: int
    generation: int
    groups_per_step: int

    def __post_init__(self) -> None:
        _check_int("position", self.position, 0)
        _check_int("generation", self.generation, 0)
        _check_int("groups_per_step", self.groups_per_step, 1)

    @property
    def sync_step(self) -> int:
        return slot_of(self.position, self.groups_per_step)[0]

    @property
    def group_index(self) -> int:
        return slot_of(self.position, self.groups_per_step)[1]

    @property
    def key(self) -> str:
        return f"p{self.position}.g{self.generation}"

    def rollout_ids(self, run_id: str, n: int) -> list[str]:
        """The group's N rollout ids: the one rule, with the prompt's sync slot and the generation as attempt.

        Distinct tickets of one ledger give distinct ids; across launches the run id (fresh per
        launch, see `setup`) keeps them apart."""
        _check_int("n", n, 1)
        step, group = slot_of(self.position, self.groups_per_step)
        return [rollout_id_for(run_id, step, group, i, self.generation) for i in range(n)]


class Outcome(str, Enum):
    """What a step did with a prompt it consumed."""

    TRAINED = "trained"  # in the step's batch with at least one kept rollout
    FAILED = "failed"  # every rollout a placeholder: accounted and consumed as today, never re-queued


@dataclass(frozen=True, slots=True)
class ConsumedPrompt:
    """What a step did with one prompt."""

    step: int
    ticket: GroupTicket
    outcome: Outcome


class PendingState(str, Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    FINISHED = "finished"


class PendingPrompt(BaseModel):
    """A drawn, unconsumed prompt in a snapshot; `generations` = dispatches issued so far."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    position: int = Field(ge=0)
    generations: int = Field(ge=0)
    state: PendingState

    @model_validator(mode="after")
    def _dispatched_has_generation(self) -> "PendingPrompt":
        if self.state is not PendingState.QUEUED and self.generations < 1:
            raise ValueError(f"prompt {self.position} is {self.state.value} but has never been dispatched")
        return self


class LedgerSnapshot(BaseModel):
    """The ledger in a checkpoint: positions below `step * groups_per_step` are consumed; `pending`
    holds every position in [that, next_draw) exactly once (so nothing drawn is lost in it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = Field(1, ge=1, le=1)
    groups_per_step: int = Field(ge=1)
    step: int = Field(ge=0, description="The last committed step (0: none).")
    next_draw: int = Field(ge=0)
    pending: tuple[PendingPrompt, ...]
    dropped_stale_total: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _covers_the_drawn(self) -> "LedgerSnapshot":
        consumed = self.step * self.groups_per_step
        if self.next_draw < consumed:
            raise ValueError(
                f"next_draw={self.next_draw} < {consumed} (= step {self.step} x groups_per_step "
                f"{self.groups_per_step}): steps 1..{self.step} consumed prompts that were never drawn"
            )
        positions = [p.position for p in self.pending]
        if positions != list(range(consumed, self.next_draw)):
            raise ValueError(
                f"pending positions {positions} must be exactly {consumed}..{self.next_draw - 1} in order (positions "
                f"below {consumed} are consumed by steps 1..{self.step}, those from {self.next_draw} not yet drawn)"
            )
        return self

    @property
    def in_flight(self) -> tuple[PendingPrompt, ...]:
        """The prompts that were dispatched and not consumed at snapshot time (re-dispatched on restore)."""
        return tuple(p for p in self.pending if p.state is not PendingState.QUEUED)


@dataclass
class _Live:
    generation: int
    state: PendingState  # IN_FLIGHT or FINISHED


class PromptLedger:
    """See the module docstring. Not thread-safe: one event loop owns it."""

    def __init__(self, groups_per_step: int, max_in_flight: int | None = None) -> None:
        self._p = _check_int("groups_per_step", groups_per_step, 1)
        cap = groups_per_step if max_in_flight is None else _check_int("max_in_flight", max_in_flight, 1)
        if cap < groups_per_step:
            raise ValueError(
                f"max_in_flight={cap} < groups_per_step={groups_per_step}: a step consumes {groups_per_step} groups, so "
                f"the trainer could never gather one (fix: grpo.async_rollouts.max_in_flight_groups >= "
                f"grpo.num_prompts_per_step, or null)"
            )
        self._cap = cap
        self._step = 0
        self._next_draw = 0
        self._queue: list[int] = []  # heap: re-queued positions, all below _next_draw
        self._live: dict[int, _Live] = {}
        self._generations: dict[int, int] = {}  # dispatches issued per drawn, unconsumed position
        self._dropped_total = 0
        self._dropped_since_take = 0

    # -- views ---------------------------------------------------------------------------------

    @property
    def groups_per_step(self) -> int:
        return self._p

    @property
    def max_in_flight(self) -> int:
        return self._cap

    @property
    def step(self) -> int:
        """The last committed step (0 before the first)."""
        return self._step

    @property
    def consumed(self) -> int:
        """Positions below this are consumed (= step * groups_per_step)."""
        return self._step * self._p

    @property
    def in_flight(self) -> int:
        """Groups dispatched and neither consumed nor dropped (running, or finished and waiting)."""
        return len(self._live)

    @property
    def running(self) -> int:
        return sum(1 for live in self._live.values() if live.state is PendingState.IN_FLIGHT)

    @property
    def queued(self) -> tuple[int, ...]:
        """Positions waiting for a (re-)dispatch ahead of any new draw, in dispatch order."""
        return tuple(sorted(self._queue))

    @property
    def dropped_stale_total(self) -> int:
        return self._dropped_total

    @property
    def next_position(self) -> int:
        """The position `dispatch()` would hand out next: the lowest re-queued one, else the next draw."""
        return min(self._queue) if self._queue else self._next_draw

    def can_dispatch(self) -> bool:
        return len(self._live) < self._cap

    def live(self, state: PendingState | None = None) -> tuple[GroupTicket, ...]:
        """The live tickets (running and finished, or only those in `state`), by position."""
        return tuple(
            GroupTicket(p, live.generation, self._p) for p, live in sorted(self._live.items())
            if state is None or live.state is state
        )

    def state_of(self, position: int) -> PendingState | None:
        """QUEUED/IN_FLIGHT/FINISHED for a drawn, unconsumed position; None for a consumed or undrawn one."""
        if position in self._live:
            return self._live[position].state
        if self.consumed <= position < self._next_draw:
            return PendingState.QUEUED
        return None

    def head(self) -> tuple[GroupTicket, ...] | None:
        """The next step's tickets (positions consumed..consumed+P-1) once all are finished, else None."""
        positions = range(self.consumed, self.consumed + self._p)
        lives = [self._live.get(p) for p in positions]
        if any(live is None or live.state is not PendingState.FINISHED for live in lives):
            return None
        return tuple(GroupTicket(p, live.generation, self._p) for p, live in zip(positions, lives))  # type: ignore[union-attr]

    def waiting_for(self) -> tuple[int, ...]:
        """Positions of the next step that are not finished yet (queued or running)."""
        return tuple(
            p for p in range(self.consumed, self.consumed + self._p)
            if p not in self._live or self._live[p].state is not PendingState.FINISHED
        )

    def take_step_metrics(self) -> dict[str, float]:
        """`async/in_flight_groups` now and `async/dropped_stale_groups` since the last call."""
        metrics = {IN_FLIGHT_METRIC: float(len(self._live)), DROPPED_STALE_METRIC: float(self._dropped_since_take)}
        self._dropped_since_take = 0
        return metrics

    # -- transitions ---------------------------------------------------------------------------

    def dispatch(self) -> GroupTicket:
        """The next prompt to run: the lowest re-queued position, else a new draw."""
        if not self.can_dispatch():
            raise AccountingError(
                f"dispatch with {len(self._live)} groups in flight = max_in_flight {self._cap}; wait for the trainer to "
                "consume or drop one (can_dispatch)",
                kind="in_flight_limit",
            )
        if self._queue:
            position = heapq.heappop(self._queue)
        else:
            position = self._next_draw
            self._next_draw += 1
        generation = self._generations.get(position, 0)
        self._generations[position] = generation + 1
        self._live[position] = _Live(generation, PendingState.IN_FLIGHT)
        self.check()
        return GroupTicket(position, generation, self._p)

    def finish(self, ticket: GroupTicket) -> None:
        """The group of `ticket` came back (accounted: always-N); it waits for the trainer."""
        live = self._live_of(ticket, "finish")
        if live.state is not PendingState.IN_FLIGHT:
            raise AccountingError(f"finish {ticket.key}: the group already finished (it waits for the trainer)",
                                  kind="group_state")
        live.state = PendingState.FINISHED
        self.check()

    def drop_stale(self, ticket: GroupTicket) -> None:
        """Drop a finished group whose tokens are too old; its prompt is re-queued at the front."""
        live = self._live_of(ticket, "drop_stale")
        if live.state is not PendingState.FINISHED:
            raise AccountingError(
                f"drop_stale {ticket.key}: the group is still running; staleness is read from its rows, so only a "
                "finished group can be dropped",
                kind="group_state",
            )
        del self._live[ticket.position]
        heapq.heappush(self._queue, ticket.position)
        self._dropped_total += 1
        self._dropped_since_take += 1
        self.check()

    def commit_step(
        self, step: int, tickets: Sequence[GroupTicket], failed: Collection[GroupTicket] = ()
    ) -> tuple[ConsumedPrompt, ...]:
        """Step `step` consumed `tickets` (exactly the head: positions consumed..consumed+P-1), in position order.

        `failed` (a subset) are groups with every rollout a placeholder: consumed all the same."""
        if step != self._step + 1:
            raise AccountingError(f"commit_step({step}): the last committed step is {self._step}; steps commit in order",
                                  kind="group_state")
        for ticket in tickets:
            if ticket.groups_per_step != self._p:
                raise AccountingError(f"commit_step({step}): {ticket.key} was issued for groups_per_step="
                                      f"{ticket.groups_per_step}, this ledger has {self._p}", kind="unknown_group")
            if ticket.position < self.consumed:
                raise AccountingError(
                    f"commit_step({step}): prompt {ticket.position} (sync step {ticket.sync_step}, group "
                    f"{ticket.group_index}) was consumed by step {ticket.sync_step} already",
                    kind="trained_twice",
                )
        positions = sorted(t.position for t in tickets)
        expected = list(range(self.consumed, self.consumed + self._p))
        if positions != expected:
            raise AccountingError(
                f"commit_step({step}): got positions {positions}; step {step} consumes exactly {expected} (position "
                "order keeps each step's prompts the synchronous loop's)",
                kind="group_state",
            )
        for ticket in tickets:
            if self._live_of(ticket, f"commit_step({step})").state is not PendingState.FINISHED:
                raise AccountingError(f"commit_step({step}): {ticket.key} is still running", kind="group_state")
        failed_keys = {t.key for t in failed}
        unknown = failed_keys - {t.key for t in tickets}
        if unknown:
            raise AccountingError(f"commit_step({step}): failed groups {sorted(unknown)} are not among the step's tickets",
                                  kind="unknown_group")
        records = tuple(
            ConsumedPrompt(step, t, Outcome.FAILED if t.key in failed_keys else Outcome.TRAINED)
            for t in sorted(tickets, key=lambda t: t.position)
        )
        for ticket in tickets:
            del self._live[ticket.position]
            del self._generations[ticket.position]
        self._step = step
        self.check()
        return records

    def _live_of(self, ticket: GroupTicket, action: str) -> _Live:
        if not isinstance(ticket, GroupTicket) or ticket.groups_per_step != self._p:
            raise AccountingError(f"{action}: {ticket!r} is not a ticket of this ledger (groups_per_step={self._p})",
                                  kind="unknown_group")
        position = ticket.position
        if position < self.consumed:
            raise AccountingError(
                f"{action} {ticket.key}: prompt {position} was consumed by step {ticket.sync_step} already",
                kind="trained_twice",
            )
        live = self._live.get(position)
        if live is None or live.generation != ticket.generation:
            now = (f"live dispatch is {GroupTicket(position, live.generation, self._p).key}" if live is not None
                   else "it is queued" if self.consumed <= position < self._next_draw else "it was never drawn")
            raise AccountingError(f"{action} {ticket.key}: not a live dispatch of prompt {position} ({now})",
                                  kind="unknown_group")
        return live

    # -- invariants and checkpoints ------------------------------------------------------------

    def check(self) -> None:
        """Every drawn, unconsumed position is queued or live exactly once; nothing else is held."""
        drawn = range(self.consumed, self._next_draw)
        held = list(self._queue) + list(self._live)
        if len(held) != len(set(held)):
            twice = sorted({p for p in held if held.count(p) > 1})
            raise AccountingError(f"prompts {twice} are held twice (queued and dispatched): they would run twice",
                                  kind="prompt_lost")
        missing = sorted(set(drawn) - set(held))
        if missing:
            raise AccountingError(f"prompts {missing} were drawn but are neither queued nor in flight: they are lost",
                                  kind="prompt_lost")
        stray = sorted(set(held) - set(drawn))
        if stray:
            raise AccountingError(f"prompts {stray} are held but outside the drawn, unconsumed range "
                                  f"{self.consumed}..{self._next_draw - 1}", kind="prompt_lost")
        if set(self._generations) - set(drawn):
            raise AccountingError(f"generation counters kept for positions outside {self.consumed}..{self._next_draw - 1}",
                                  kind="prompt_lost")
        if len(self._live) > self._cap:
            raise AccountingError(f"{len(self._live)} groups in flight > max_in_flight {self._cap}",
                                  kind="in_flight_limit")

    def snapshot(self) -> LedgerSnapshot:
        """Everything a resume needs (JSON via `model_dump_json`); positions ascending."""
        pending = tuple(
            PendingPrompt(position=p, generations=self._generations.get(p, 0),
                          state=self._live[p].state if p in self._live else PendingState.QUEUED)
            for p in range(self.consumed, self._next_draw)
        )
        return LedgerSnapshot(groups_per_step=self._p, step=self._step, next_draw=self._next_draw, pending=pending,
                              dropped_stale_total=self._dropped_total)

    @classmethod
    def restore(cls, snapshot: LedgerSnapshot, groups_per_step: int, max_in_flight: int | None = None) -> "PromptLedger":
        """The ledger of `snapshot` with every pending prompt queued (dispatched ones get a new generation)."""
        if snapshot.groups_per_step != groups_per_step:
            raise SnapshotMismatchError(
                f"the snapshot was taken with grpo.num_prompts_per_step={snapshot.groups_per_step}, this run has "
                f"{groups_per_step}: its positions would name other prompts (fix: set grpo.num_prompts_per_step="
                f"{snapshot.groups_per_step})"
            )
        ledger = cls(groups_per_step, max_in_flight)
        ledger._step = snapshot.step
        ledger._next_draw = snapshot.next_draw
        ledger._queue = [p.position for p in snapshot.pending]  # ascending: already a heap
        ledger._generations = {p.position: p.generations for p in snapshot.pending if p.generations}
        ledger._dropped_total = snapshot.dropped_stale_total
        ledger.check()
        return ledger
