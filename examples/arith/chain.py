"""The chained arithmetic task: the long-tail workload (one prompt needs k calculator calls).

Contract:
- A `Chain` is a start digit and k links `(op, digit)` applied left to right; every running value
  stays in [0, 99] (the calculator has no negative literals). Call i's intended expression is
  `f"{value_(i-1)} {op_i} {digit_i}"` (value_0 = start); the answer is the last value.
- k is drawn per prompt from `ChainSpec`: `min_calls..max_calls` (default 1..12) with weight
  `decay ** (k - min_calls)` (default 0.75: most chains short, a few long: the long tail).
  `make_chains(seed, count, spec)` is a pure function of its arguments.
- The tool is the same calculator, made stateful per rollout: after a successful call it answers
  `"<value> (next: <op> <digit>)"` while links remain, then `"<value> (done)"`; a bad expression
  is `error: <reason>` and does not advance (`chain_tool_output`).
- The reward is the default task's `task.verify` of the final text against the chain's answer.
- `build_chain_row` is the agent /run body; `chain_from_fields` refuses a corrupt row.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from examples.arith.rows import calculator_run_params
from examples.arith.task import CalculatorError, Problem, calculate
from examples.arith.task import verify as verify_answer
from nemo_rl.environments.task import RowSampling

CHAIN_SYSTEM_PROMPT = "You are a careful assistant. Use the calculator for every step, then state the answer."
VALUE_MIN, VALUE_MAX = 0, 99
_OPS = ("+", "-", "*")
# Extra /run fields that carry the ground truth to /seed_session and /verify.
START_FIELD, LINKS_FIELD, ANSWER_FIELD = "chain_start", "chain_links", "answer"


class InvalidChainError(ValueError):
    """A chain (or a dataset row's chain fields) breaks the contract above."""


@dataclass(frozen=True)
class ChainSpec:
    """How many calculator calls a prompt needs: k in min_calls..max_calls, weight decay**(k - min_calls)."""

    min_calls: int = 1
    max_calls: int = 12
    decay: float = 0.75

    def __post_init__(self) -> None:
        if not 1 <= self.min_calls <= self.max_calls:
            raise ValueError(
                f"ChainSpec min_calls={self.min_calls}, max_calls={self.max_calls}: need 1 <= min_calls <= max_calls"
            )
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"ChainSpec decay={self.decay}: need 0 < decay <= 1 (1 is uniform)")

    def k_values(self) -> list[int]:
        return list(range(self.min_calls, self.max_calls + 1))

    def k_weights(self) -> list[float]:
        return [self.decay ** (k - self.min_calls) for k in self.k_values()]


def apply_link(value: int, op: str, digit: int) -> int:
    return calculate(f"{value} {op} {digit}")


@dataclass(frozen=True)
class Chain:
    start: int
    links: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if not self.links:
            raise InvalidChainError("a chain needs at least one link (one calculator call)")
        if not 1 <= self.start <= 9 or any(op not in _OPS or not 1 <= d <= 9 for op, d in self.links):
            raise InvalidChainError(f"chain start={self.start} links={self.links}: need digits 1..9 and ops + - *")
        values = self.values
        if any(not VALUE_MIN <= v <= VALUE_MAX for v in values):
            raise InvalidChainError(f"chain {self.links} from {self.start} leaves [0, 99]: values {values}")

    @property
    def calls(self) -> int:
        return len(self.links)

    @property
    def values(self) -> list[int]:
        """value_1 .. value_k (value after each call)."""
        out, value = [], self.start
        for op, digit in self.links:
            value = apply_link(value, op, digit)
            out.append(value)
        return out

    @property
    def answer(self) -> int:
        return self.values[-1]

    def expressions(self) -> list[str]:
        """The intended expression of each calculator call."""
        before = [self.start] + self.values[:-1]
        return [f"{v} {op} {d}" for v, (op, d) in zip(before, self.links)]


def draw_k(rng: random.Random, spec: ChainSpec) -> int:
    return rng.choices(spec.k_values(), weights=spec.k_weights())[0]


def _valid_links(value: int) -> list[tuple[str, int]]:
    return [(op, d) for op in _OPS for d in range(1, 10) if VALUE_MIN <= apply_link(value, op, d) <= VALUE_MAX]


def make_chain(rng: random.Random, calls: int) -> Chain:
    value = start = rng.randint(1, 9)
    links = []
    for _ in range(calls):
        op, digit = rng.choice(_valid_links(value))
        links.append((op, digit))
        value = apply_link(value, op, digit)
    return Chain(start=start, links=tuple(links))


def make_chains(seed: int, count: int, spec: ChainSpec = ChainSpec()) -> list[Chain]:
    rng = random.Random(seed)
    return [make_chain(rng, draw_k(rng, spec)) for _ in range(count)]


def link_text(op: str, digit: int) -> str:
    return f"{op} {digit}"


def chain_prompt(chain: Chain) -> str:
    steps = ", ".join(link_text(op, d) for op, d in chain.links)
    return f"Start at {chain.start}. Apply in order: {steps}. What is the result?"


def chain_tool_output(expression: str, chain: Chain, calls_done: int) -> tuple[str, int]:
    """(tool text, calls_done after this call) for a calculator call made after `calls_done` good calls."""
    try:
        value = calculate(expression)
    except CalculatorError as e:
        return f"error: {e}", calls_done
    done = calls_done + 1
    if done < chain.calls:
        return f"{value} (next: {link_text(*chain.links[done])})", done
    return f"{value} (done)", done


def verify_chain(final_text: str, chain: Chain) -> float:
    """`task.verify` against the chain's answer (1.0 exact, partial credit for a near miss, 0.0 no integer)."""
    return verify_answer(final_text, Problem(expression=str(chain.answer), answer=chain.answer))


def build_chain_row(chain: Chain, sampling: RowSampling) -> dict[str, Any]:
    """The agent /run body: system + user input, the calculator tool, sampling, the chain as ground truth."""
    return {
        "responses_create_params": calculator_run_params(CHAIN_SYSTEM_PROMPT, chain_prompt(chain), sampling),
        START_FIELD: chain.start,
        LINKS_FIELD: [[op, d] for op, d in chain.links],
        ANSWER_FIELD: chain.answer,
    }


def chain_from_fields(start: int, links: Sequence[Sequence[Any]], answer: int) -> Chain:
    """The row's chain; a row whose links are malformed or whose answer disagrees is refused."""
    try:
        chain = Chain(start=start, links=tuple((str(op), int(d)) for op, d in links))
    except (ValueError, TypeError, CalculatorError) as e:
        raise InvalidChainError(
            f"dataset row has {START_FIELD}={start!r}, {LINKS_FIELD}={list(links)!r}: not a valid chain ({e}); "
            "rebuild the row with build_chain_row(chain, sampling)"
        ) from e
    if chain.answer != answer:
        raise InvalidChainError(
            f"dataset row has {ANSWER_FIELD}={answer!r} but its chain evaluates to {chain.answer}; "
            "rebuild the row with build_chain_row(chain, sampling)"
        )
    return chain
