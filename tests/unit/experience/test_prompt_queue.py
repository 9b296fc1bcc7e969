"""The prompt ledger: each transition and its named refusals, snapshots, and a property over any
interleaving of dispatch / finish / drop / train / checkpoint / kill-and-restore: no prompt lost or
consumed twice, ids never reissued, and every step trains exactly the synchronous loop's prompts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nemo_rl.environments.gym_client import PromptDataset
from nemo_rl.environments.task import RowSampling
from nemo_rl.experience.prompt_queue import (
    ConsumedPrompt,
    GroupTicket,
    LedgerSnapshot,
    Outcome,
    PendingState,
    PromptLedger,
    SnapshotMismatchError,
    position_of,
    slot_of,
)
from nemo_rl.experience.errors import AccountingError


def run_step(ledger: PromptLedger) -> tuple[ConsumedPrompt, ...]:
    """Dispatch and finish what the next step needs, then commit it (no drop)."""
    while any(ledger.state_of(p) in (None, PendingState.QUEUED) for p in ledger.waiting_for()):
        ledger.dispatch()  # the lowest queued position, else a new draw: the step's own prompts first
    for position in ledger.waiting_for():
        ledger.finish(live_ticket(ledger, position))
    head = ledger.head()
    assert head is not None
    return ledger.commit_step(ledger.step + 1, head)


def live_ticket(ledger: PromptLedger, position: int) -> GroupTicket:
    (ticket,) = [t for t in ledger.live() if t.position == position]
    return ticket


def test_slots_are_the_synchronous_loops_draw_order():
    assert [slot_of(p, 3) for p in range(7)] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert all(position_of(*slot_of(p, 3), 3) == p for p in range(50))
    with pytest.raises(ValueError, match=r"group must be an int in \[0, 3\), got 3"):
        position_of(1, 3, 3)
    with pytest.raises(ValueError, match="step must be an int >= 1, got 0"):
        position_of(0, 0, 3)


def test_a_ticket_mints_the_groups_rollout_ids_by_the_one_rule():
    ticket = GroupTicket(position=5, generation=2, groups_per_step=2)
    assert (ticket.sync_step, ticket.group_index, ticket.key) == (3, 1, "p5.g2")
    assert ticket.rollout_ids("run7", 2) == ["run7-s3-g1-i0-a2", "run7-s3-g1-i1-a2"]
    with pytest.raises(ValueError, match="generation must be an int >= 0"):
        GroupTicket(0, -1, 2)


def test_the_in_flight_cap_is_at_least_a_step_and_bounds_dispatch():
    with pytest.raises(ValueError, match=r"max_in_flight=1 < groups_per_step=2.*max_in_flight_groups >= grpo\.num_prompts_per_step"):
        PromptLedger(2, 1)
    ledger = PromptLedger(2)  # null: one step's groups
    assert ledger.max_in_flight == 2
    assert [ledger.dispatch().position for _ in range(2)] == [0, 1]
    assert not ledger.can_dispatch()
    with pytest.raises(AccountingError, match="2 groups in flight = max_in_flight 2") as excinfo:
        ledger.dispatch()
    assert excinfo.value.kind == "in_flight_limit"


def test_a_step_commits_exactly_its_prompts_once_all_finished():
    ledger = PromptLedger(2, 4)
    tickets = [ledger.dispatch() for _ in range(4)]
    ledger.finish(tickets[3])
    ledger.finish(tickets[1])
    assert ledger.head() is None and ledger.waiting_for() == (0,)
    ledger.finish(tickets[0])
    assert ledger.head() == (tickets[0], tickets[1])
    with pytest.raises(AccountingError, match=r"commit_step\(2\): the last committed step is 0") as excinfo:
        ledger.commit_step(2, [tickets[0], tickets[1]])
    assert excinfo.value.kind == "group_state"
    with pytest.raises(AccountingError, match=r"got positions \[1, 3\]; step 1 consumes exactly \[0, 1\]") as excinfo:
        ledger.commit_step(1, [tickets[1], tickets[3]])
    assert excinfo.value.kind == "group_state"
    with pytest.raises(AccountingError, match=r"got positions \[0, 0, 1\]") as excinfo:
        ledger.commit_step(1, [tickets[0], tickets[0], tickets[1]])
    assert excinfo.value.kind == "group_state"
    with pytest.raises(AccountingError, match=r"failed groups \['p3.g0'\] are not among the step's tickets") as excinfo:
        ledger.commit_step(1, [tickets[0], tickets[1]], failed=[tickets[3]])
    assert excinfo.value.kind == "unknown_group"
    records = ledger.commit_step(1, [tickets[1], tickets[0]], failed=[tickets[1]])
    assert records == (ConsumedPrompt(1, tickets[0], Outcome.TRAINED), ConsumedPrompt(1, tickets[1], Outcome.FAILED))
    assert (ledger.step, ledger.consumed, ledger.in_flight) == (1, 2, 2)
    with pytest.raises(AccountingError, match=r"prompt 0 \(sync step 1, group 0\) was consumed by step 1 already") as excinfo:
        ledger.commit_step(2, [tickets[0], tickets[1]])
    assert excinfo.value.kind == "trained_twice"
    with pytest.raises(AccountingError, match="prompt 1 was consumed by step 1 already") as excinfo:
        ledger.finish(tickets[1])
    assert excinfo.value.kind == "trained_twice"
    with pytest.raises(AccountingError, match=r"commit_step\(2\): p2.g0 is still running") as excinfo:
        ledger.commit_step(2, [tickets[2], tickets[3]])
    assert excinfo.value.kind == "group_state"


def test_unknown_superseded_and_repeated_transitions_are_refused():
    ledger = PromptLedger(2, 3)
    first = ledger.dispatch()
    with pytest.raises(AccountingError, match=r"finish p7.g0: not a live dispatch of prompt 7 \(it was never drawn\)") as excinfo:
        ledger.finish(GroupTicket(7, 0, 2))
    assert excinfo.value.kind == "unknown_group"
    with pytest.raises(AccountingError, match="not a ticket of this ledger") as excinfo:
        ledger.finish(GroupTicket(0, 0, 3))
    assert excinfo.value.kind == "unknown_group"
    with pytest.raises(AccountingError, match="drop_stale p0.g0: the group is still running") as excinfo:
        ledger.drop_stale(first)
    assert excinfo.value.kind == "group_state"
    ledger.finish(first)
    with pytest.raises(AccountingError, match="finish p0.g0: the group already finished") as excinfo:
        ledger.finish(first)
    assert excinfo.value.kind == "group_state"
    ledger.drop_stale(first)
    with pytest.raises(AccountingError, match=r"finish p0.g0: not a live dispatch of prompt 0 \(it is queued\)") as excinfo:
        ledger.finish(first)
    assert excinfo.value.kind == "unknown_group"
    again = ledger.dispatch()
    assert again == GroupTicket(0, 1, 2)
    with pytest.raises(AccountingError, match=r"drop_stale p0.g0: not a live dispatch of prompt 0 \(live dispatch is p0.g1\)") as excinfo:
        ledger.drop_stale(first)
    assert excinfo.value.kind == "unknown_group"
    assert issubclass(SnapshotMismatchError, AccountingError) and type(excinfo.value) is AccountingError


def test_a_dropped_prompt_goes_back_to_the_front_lowest_position_first():
    ledger = PromptLedger(2, 4)
    tickets = [ledger.dispatch() for _ in range(4)]
    ledger.finish(tickets[2])
    assert ledger.live(PendingState.FINISHED) == (tickets[2],) and ledger.live() == tuple(tickets)
    assert (ledger.running, ledger.in_flight) == (3, 4)
    for ticket in (tickets[0], tickets[1], tickets[3]):
        ledger.finish(ticket)
    ledger.drop_stale(tickets[3])
    ledger.drop_stale(tickets[1])
    assert ledger.queued == (1, 3)
    assert ledger.take_step_metrics() == {"async/in_flight_groups": 2.0, "async/dropped_stale_groups": 2.0}
    assert ledger.take_step_metrics() == {"async/in_flight_groups": 2.0, "async/dropped_stale_groups": 0.0}
    assert [ledger.dispatch() for _ in range(2)] == [GroupTicket(1, 1, 2), GroupTicket(3, 1, 2)]
    assert not ledger.can_dispatch() and ledger.dropped_stale_total == 2


def test_a_snapshot_records_in_flight_groups_and_restore_redispatches_them_under_new_generations():
    ledger = PromptLedger(2, 4)
    for _ in range(2):
        run_step(ledger)  # steps 1-2 consumed positions 0..3
    running, finished = ledger.dispatch(), ledger.dispatch()
    ledger.finish(finished)
    dropped = ledger.dispatch()
    ledger.finish(dropped)
    ledger.drop_stale(dropped)
    snapshot = LedgerSnapshot.model_validate_json(ledger.snapshot().model_dump_json())
    assert (snapshot.step, snapshot.next_draw, snapshot.dropped_stale_total) == (2, 7, 1)
    assert [(p.position, p.generations, p.state) for p in snapshot.pending] == [
        (4, 1, PendingState.IN_FLIGHT), (5, 1, PendingState.FINISHED), (6, 1, PendingState.QUEUED)]
    assert [p.position for p in snapshot.in_flight] == [4, 5]
    restored = PromptLedger.restore(snapshot, 2, 4)
    assert (restored.step, restored.in_flight, restored.queued) == (2, 0, (4, 5, 6))
    redispatched = [restored.dispatch() for _ in range(4)]
    assert [(t.position, t.generation) for t in redispatched] == [(4, 1), (5, 1), (6, 1), (7, 0)]
    assert running.generation == finished.generation == 0
    with pytest.raises(SnapshotMismatchError, match=r"grpo\.num_prompts_per_step=2, this run has 3.*fix") as excinfo:
        PromptLedger.restore(snapshot, 3)
    assert excinfo.value.kind == "snapshot_mismatch"


def test_a_snapshot_that_loses_a_prompt_is_refused():
    good = PromptLedger(2, 2)
    good.dispatch()
    good.dispatch()
    data = good.snapshot().model_dump()
    data["pending"] = data["pending"][1:]
    with pytest.raises(ValidationError, match=r"pending positions \[1\] must be exactly 0..1"):
        LedgerSnapshot.model_validate(data)
    data = good.snapshot().model_dump()
    data["pending"][0]["generations"] = 0
    with pytest.raises(ValidationError, match="prompt 0 is in_flight but has never been dispatched"):
        LedgerSnapshot.model_validate(data)


def test_check_names_a_lost_or_duplicated_prompt():
    ledger = PromptLedger(2, 2)
    ticket = ledger.dispatch()
    ledger._live.clear()  # noqa: SLF001: corrupt the ledger as a bug would
    with pytest.raises(AccountingError, match=r"prompts \[0\] were drawn but are neither queued nor in flight") as excinfo:
        ledger.check()
    assert excinfo.value.kind == "prompt_lost"
    ledger = PromptLedger(2, 2)
    ticket = ledger.dispatch()
    ledger._queue.append(ticket.position)  # noqa: SLF001
    with pytest.raises(AccountingError, match=r"prompts \[0\] are held twice") as excinfo:
        ledger.check()
    assert excinfo.value.kind == "prompt_lost"


def test_the_ledger_order_draws_the_prompt_sources_synchronous_batches():
    rows = [{"responses_create_params": {"input": f"q{i}"}, "i": i} for i in range(5)]
    source = PromptDataset(rows, seed=3, sampling=RowSampling(temperature=1.0, top_p=1.0, max_output_tokens=8))
    per_step = 2
    ledger = PromptLedger(per_step, 3)
    consumed = [record for _ in range(6) for record in run_step(ledger)]
    by_ledger = [source.batch(r.ticket.sync_step, per_step)[r.ticket.group_index] for r in consumed]
    by_sync = [row for step in range(1, 7) for row in source.batch(step, per_step)]
    assert by_ledger == by_sync  # three epochs of 5 rows, every one in the synchronous order


OPS = ("dispatch", "finish", "drop", "train", "checkpoint", "kill")


class Simulation:
    """Drives a ledger through ops; keeps what a run keeps on disk (the last snapshot and the trained
    steps up to it) and checks, after every op, the properties the module promises."""

    def __init__(self, per_step: int, cap: int, n: int = 2) -> None:
        self.per_step, self.cap, self.n = per_step, cap, n
        self.ledger = PromptLedger(per_step, cap)
        self.launch = 0
        self.trained: list[ConsumedPrompt] = []
        self.durable: tuple[str, int, frozenset[str]] | None = None
        self.lineage_keys: set[str] = set()  # tickets issued in the history that survived every kill
        self.rollout_ids: set[str] = set()  # every rollout id ever issued, every launch
        self.kills = self.drops = 0

    def pick(self, state: PendingState, arg: int) -> GroupTicket | None:
        tickets = self.ledger.live(state)
        return tickets[arg % len(tickets)] if tickets else None

    def do(self, op: str, arg: int) -> None:
        ledger = self.ledger
        if op == "dispatch" and ledger.can_dispatch():
            queued = ledger.queued
            expected = queued[0] if queued else ledger.snapshot().next_draw
            ticket = ledger.dispatch()
            assert ticket.position == expected  # re-queued first (lowest), else the next in seeded order
            assert ticket.key not in self.lineage_keys, f"{ticket.key} reissued"
            self.lineage_keys.add(ticket.key)
            ids = ticket.rollout_ids(f"run{self.launch}", self.n)
            assert self.rollout_ids.isdisjoint(ids)
            self.rollout_ids.update(ids)
        elif op == "finish" and (ticket := self.pick(PendingState.IN_FLIGHT, arg)) is not None:
            ledger.finish(ticket)
        elif op == "drop" and (ticket := self.pick(PendingState.FINISHED, arg)) is not None:
            ledger.drop_stale(ticket)
            self.drops += 1
        elif op == "train" and (head := ledger.head()) is not None:
            failed = [t for i, t in enumerate(head) if arg >> i & 1]
            self.trained.extend(ledger.commit_step(ledger.step + 1, head, failed))
        elif op == "checkpoint":
            self.durable = (ledger.snapshot().model_dump_json(), len(self.trained), frozenset(self.lineage_keys))
        elif op == "kill":
            self.kills += 1
            self.launch += 1  # a new process: setup mints a fresh run id
            if self.durable is None:
                self.ledger, self.trained, self.lineage_keys = PromptLedger(self.per_step, self.cap), [], set()
            else:
                snapshot, kept, keys = self.durable
                self.ledger = PromptLedger.restore(LedgerSnapshot.model_validate_json(snapshot), self.per_step, self.cap)
                self.trained, self.lineage_keys = self.trained[:kept], set(keys)
        self.check()

    def check(self) -> None:
        self.ledger.check()
        positions = [r.ticket.position for r in self.trained]
        assert positions == list(range(len(positions)))  # each once, in the synchronous order
        assert [r.step for r in self.trained] == [p // self.per_step + 1 for p in positions]
        assert len(self.trained) == self.ledger.consumed
        snapshot = self.ledger.snapshot()  # every drawn prompt: consumed, or pending exactly once
        assert [p.position for p in snapshot.pending] == list(range(self.ledger.consumed, snapshot.next_draw))

    def drain(self, steps: int) -> None:
        """Run `steps` more steps with no drop or kill: the ledger never wedges."""
        target = self.ledger.step + steps
        for _ in range(100 * steps * self.cap):
            if self.ledger.step >= target:
                return
            for op in ("dispatch", "finish", "train"):
                self.do(op, 0)
        raise AssertionError(f"no progress: step {self.ledger.step}, queued {self.ledger.queued}, "
                             f"in flight {self.ledger.in_flight}")


@settings(max_examples=200, deadline=None)
@given(per_step=st.integers(1, 3), extra=st.integers(0, 3),
       ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 63)), max_size=80))
def test_any_interleaving_loses_no_prompt_trains_none_twice_and_keeps_the_sync_order(per_step, extra, ops):
    sim = Simulation(per_step, per_step + extra)
    for op, arg in ops:
        sim.do(op, arg)
    sim.drain(3)
    trained = [r.ticket.position for r in sim.trained]
    assert trained == list(range(sim.ledger.consumed)) and len(trained) >= 3 * per_step


def test_a_scripted_run_with_drops_and_two_kills_matches_an_uninterrupted_one():
    sim = Simulation(per_step=2, cap=3)
    script = [("dispatch", 0)] * 3 + [("finish", 0)] * 3 + [("drop", 1), ("train", 0), ("dispatch", 0),
              ("checkpoint", 0), ("dispatch", 0), ("finish", 0), ("train", 0), ("kill", 0)] \
        + [("dispatch", 0)] * 3 + [("finish", 0), ("checkpoint", 0), ("kill", 0)]
    for op, arg in script:
        sim.do(op, arg)
    assert (sim.kills, sim.drops) == (2, 1)
    sim.drain(4)
    uninterrupted = Simulation(per_step=2, cap=3)
    uninterrupted.drain(sim.ledger.step)
    assert [r.ticket.position for r in sim.trained] == [r.ticket.position for r in uninterrupted.trained]
    assert [r.step for r in sim.trained] == [r.step for r in uninterrupted.trained]
