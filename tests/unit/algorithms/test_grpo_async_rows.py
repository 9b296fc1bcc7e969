"""`group_runner`'s prompt rows: built once per synchronous step (not once per group), forgotten once
the step is consumed, and a ticket of a consumed step refused; the rows and the dispatch records are
the prompt source's own."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from nemo_rl.algorithms.grpo_async import AsyncLoopError, RolloutProducer, StepRows, group_runner
from nemo_rl.data.rows import GroupResult, Placeholder, PlaceholderReason
from nemo_rl.experience.prompt_queue import GroupTicket, PromptLedger


class CountingPrompts:
    """A prompt source pure in (step, group) that counts its `batch` calls."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def batch(self, step, n):
        self.calls.append((step, n))
        return [{"prompt": f"s{step}g{g}"} for g in range(n)]


def test_step_rows_builds_each_step_once_and_forgets_consumed_steps():
    prompts = CountingPrompts()
    rows = StepRows(lambda step: prompts.batch(step, 3))
    tickets = [GroupTicket(position, 0, 3) for position in range(9)]  # steps 1, 2, 3
    assert [rows.row(t, 0)["prompt"] for t in tickets[:6]] == ["s1g0", "s1g1", "s1g2", "s2g0", "s2g1", "s2g2"]
    assert prompts.calls == [(1, 3), (2, 3)]
    assert rows.cached_steps == (1, 2)
    assert rows.row(tickets[6], 1)["prompt"] == "s3g0"  # step 1 consumed: forgotten
    assert rows.cached_steps == (2, 3)
    assert rows.row(GroupTicket(4, 1, 3), 1)["prompt"] == "s2g1"  # a re-dispatch (generation 1) reuses step 2's rows
    assert prompts.calls == [(1, 3), (2, 3), (3, 3)]


def test_step_rows_refuse_a_ticket_of_a_consumed_step():
    rows = StepRows(lambda step: [{"prompt": step}])
    with pytest.raises(AsyncLoopError, match="ticket p1.g0 is of step 2, already consumed \\(step 2\\)") as excinfo:
        rows.row(GroupTicket(1, 0, 1), 2)
    assert excinfo.value.kind == "async_loop"


class FakeManager:
    run_id = "run"

    def __init__(self):
        self.runs: list[tuple[int, list[str], dict]] = []

    async def run_group_as(self, group_index, rollout_ids, row):
        self.runs.append((group_index, rollout_ids, row))
        return GroupResult(group_index, (Placeholder(rollout_ids[0], group_index, 0, PlaceholderReason.RUN_FAILED, "x"),))


async def test_group_runner_reads_each_steps_batch_once_and_logs_every_dispatch(tmp_path):
    prompts, manager = CountingPrompts(), FakeManager()
    cfg = SimpleNamespace(grpo=SimpleNamespace(num_prompts_per_step=2, num_generations_per_prompt=1),
                          logger=SimpleNamespace(log_dir=str(tmp_path)))
    ledger = PromptLedger(2, 4)
    producer = RolloutProducer(ledger, group_runner(SimpleNamespace(cfg=cfg, prompts=prompts, manager=manager), ledger),
                               end=8)
    for step in (1, 2, 3, 4):
        head, groups = await producer.wait_head()
        producer.commit(step, head, groups)
    await asyncio.sleep(0)
    assert prompts.calls == [(1, 2), (2, 2), (3, 2), (4, 2)]  # was one call per group: 8
    assert [row["prompt"] for _, _, row in manager.runs] == [f"s{s}g{g}" for s in (1, 2, 3, 4) for g in (0, 1)]
    records = [json.loads(line) for line in (tmp_path / "dispatched_prompts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["group"], r["position"]) for r in records] == [(s, g, 2 * (s - 1) + g)
                                                                         for s in (1, 2, 3, 4) for g in (0, 1)]
