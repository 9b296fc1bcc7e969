"""The chained arithmetic task (the long-tail workload): k distribution, chains, tool, verifier, rows, task."""

from __future__ import annotations

import collections
import random

import pytest

from examples.arith import chain as ch
from examples.arith.gym_task import CHAINED_TASK, TASK, ChainedArithGymTask
from examples.arith.task import calculate
from nemo_rl.environments.task import GymTask, RowSampling, load_task

SAMPLING = RowSampling(temperature=1.0, top_p=1.0, max_output_tokens=48)


def test_k_distribution_of_a_seed_is_skewed_with_a_long_tail() -> None:
    counts = collections.Counter(c.calls for c in ch.make_chains(0, 2000))
    assert sorted(counts.items()) == [
        (1, 527), (2, 398), (3, 298), (4, 221), (5, 142), (6, 136),
        (7, 89), (8, 62), (9, 47), (10, 41), (11, 23), (12, 16),
    ]


def test_the_default_spec_weights_decay_geometrically() -> None:
    spec = ch.ChainSpec()
    assert spec.k_values() == list(range(1, 13))
    assert spec.k_weights() == [0.75**i for i in range(12)]
    assert ch.ChainSpec(min_calls=3, max_calls=5, decay=1.0).k_weights() == [1.0, 1.0, 1.0]


def test_the_recipe_pool_of_seed_42_has_its_tail() -> None:
    # grpo_longtail_cpu.yaml: env.arith_problem_pool 16 drawn from grpo.seed 42 (task_pool's seed stride).
    assert sorted(c.calls for c in ch.make_chains(42 * 100_003, 16)) == [1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 5, 6, 6, 7, 9]


def test_chains_are_a_pure_function_of_seed_and_spec() -> None:
    assert ch.make_chains(7, 50) == ch.make_chains(7, 50)
    assert ch.make_chains(7, 50) != ch.make_chains(8, 50)
    narrow = ch.make_chains(7, 50, ch.ChainSpec(min_calls=2, max_calls=3))
    assert {c.calls for c in narrow} == {2, 3}


def test_every_call_is_the_previous_value_and_the_next_link() -> None:
    for chain in ch.make_chains(3, 300):
        assert all(ch.VALUE_MIN <= v <= ch.VALUE_MAX for v in chain.values)
        exprs = chain.expressions()
        assert len(exprs) == chain.calls and exprs[0].startswith(f"{chain.start} ")
        assert [calculate(e) for e in exprs] == chain.values
        assert all(e.startswith(f"{v} ") for e, v in zip(exprs[1:], chain.values))


def test_a_chain_reads_as_one_prompt() -> None:
    chain = ch.Chain(start=7, links=(("+", 2), ("*", 3), ("-", 9)))
    assert ch.chain_prompt(chain) == "Start at 7. Apply in order: + 2, * 3, - 9. What is the result?"
    assert chain.expressions() == ["7 + 2", "9 * 3", "27 - 9"] and chain.answer == 18


@pytest.mark.parametrize(
    ("start", "links", "match"),
    [(3, (), "at least one link"), (0, (("+", 1),), "digits 1..9"), (3, (("/", 1),), "ops"),
     (3, (("-", 5),), r"leaves \[0, 99\]"), (9, (("*", 9), ("*", 2)), r"leaves \[0, 99\]")],
)
def test_invalid_chains_are_refused(start: int, links: tuple, match: str) -> None:
    with pytest.raises(ch.InvalidChainError, match=match):
        ch.Chain(start=start, links=links)


def test_a_bad_spec_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"min_calls=0, max_calls=12"):
        ch.ChainSpec(min_calls=0)
    with pytest.raises(ValueError, match=r"min_calls=5, max_calls=4"):
        ch.ChainSpec(min_calls=5, max_calls=4)
    with pytest.raises(ValueError, match=r"decay=0.0"):
        ch.ChainSpec(decay=0.0)


def test_the_tool_reveals_the_next_link_until_done_and_errors_do_not_advance() -> None:
    chain = ch.Chain(start=7, links=(("+", 2), ("*", 3), ("-", 9)))
    assert ch.chain_tool_output("7 + 2", chain, 0) == ("9 (next: * 3)", 1)
    assert ch.chain_tool_output("9 * 3", chain, 1) == ("27 (next: - 9)", 2)
    assert ch.chain_tool_output("27 - 9", chain, 2) == ("18 (done)", 3)
    assert ch.chain_tool_output("18 + 1", chain, 3) == ("19 (done)", 4)
    text, done = ch.chain_tool_output("9 ** 3", chain, 1)
    assert text.startswith("error: calculator:") and done == 1


def test_the_verifier_scores_the_final_answer() -> None:
    chain = ch.Chain(start=7, links=(("+", 2), ("*", 3), ("-", 9)))
    assert ch.verify_chain("The answer is 18.", chain) == 1.0
    assert ch.verify_chain("The answer is 20.", chain) == 0.5 / 3
    assert ch.verify_chain("I do not know.", chain) == 0.0
    assert ch.verify_chain("27 - 9 is 18, so the answer is 17.", chain) == 0.25


def test_a_row_carries_the_chain_and_a_corrupt_row_is_refused() -> None:
    chain = ch.Chain(start=7, links=(("+", 2), ("*", 3)))
    row = ch.build_chain_row(chain, SAMPLING)
    assert row["responses_create_params"]["input"][1]["content"] == ch.chain_prompt(chain)
    assert (row["chain_start"], row["chain_links"], row["answer"]) == (7, [["+", 2], ["*", 3]], 27)
    assert ch.chain_from_fields(row["chain_start"], row["chain_links"], row["answer"]) == chain
    with pytest.raises(ch.InvalidChainError, match=r"answer=28 but its chain evaluates to 27"):
        ch.chain_from_fields(7, [["+", 2], ["*", 3]], 28)
    with pytest.raises(ch.InvalidChainError, match=r"chain_links=\[\['\+', 'x'\]\]: not a valid chain"):
        ch.chain_from_fields(7, [["+", "x"]], 9)


def test_the_chained_task_is_a_second_task_beside_the_default() -> None:
    assert load_task("examples.arith.gym_task:CHAINED_TASK") is CHAINED_TASK
    assert isinstance(CHAINED_TASK, GymTask) and load_task("examples.arith.gym_task:TASK") is TASK
    assert CHAINED_TASK.resources_server.module == "examples.arith.chain_resources"
    names = {CHAINED_TASK.resources_server.name, CHAINED_TASK.resources_server.agent_name}
    assert names.isdisjoint({TASK.resources_server.name, TASK.resources_server.agent_name})
    rows = CHAINED_TASK.rows(5, 6, SAMPLING)
    assert rows == [ch.build_chain_row(c, SAMPLING) for c in ch.make_chains(5, 6)]
    short = ChainedArithGymTask(spec=ch.ChainSpec(min_calls=1, max_calls=1)).rows(5, 6, SAMPLING)
    assert all(len(r["chain_links"]) == 1 for r in short)


def test_draw_k_follows_the_weights() -> None:
    rng = random.Random(0)
    counts = collections.Counter(ch.draw_k(rng, ch.ChainSpec(min_calls=1, max_calls=2, decay=0.5)) for _ in range(3000))
    assert counts == {1: 1988, 2: 1012}  # weights 1 : 0.5
