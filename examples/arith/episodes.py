"""Behaviour check of a tiny model on the arithmetic tool task with HF `generate`.

It lives beside `tiny_model/` (not in it) so that the model package needs only the task spec.

Contract:
- `run_episode(model, tokenizer, problem, sampling)` plays one two-call rollout the way the
  capture path builds prompts: call 1 gets the rendered prompt (system + tools + user); if its
  reply holds a parseable calculator call, call 2's prompt is call 1's prompt ids + generated
  ids + the newly rendered tail (the `\\n` closing the turn, the tool turn, the generation
  prompt). It returns an `Episode` record; it never raises on model misbehaviour, which is data.
- `summarize(episodes)` counts well-formed tool calls, exact expressions, final answers and
  correct answers.
- Generated tool calls are parsed with `TOOL_CALL_PATTERN` and `json.loads`, as the worker does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from examples.arith import task as arith_task
from examples.arith.tiny_model.chat_template import EOS_TOKEN, TOOL_CALL_PATTERN
from examples.arith.tiny_model.corpus import TASK_TOOLS
from examples.arith.tiny_model.encoding import render

_TOOL_CALL_RE = re.compile(TOOL_CALL_PATTERN, re.DOTALL)


@dataclass(frozen=True)
class Sampling:
    do_sample: bool
    temperature: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0


@dataclass(frozen=True)
class Episode:
    problem: arith_task.Problem
    first_reply: str
    expression: str | None  # None when call 1 held no parseable calculator call
    final_reply: str | None  # None when there was no call 2
    reward: float

    @property
    def tool_call_ok(self) -> bool:
        return self.expression is not None

    @property
    def expression_exact(self) -> bool:
        return self.expression == self.problem.expression

    @property
    def final_answer_ok(self) -> bool:
        return self.final_reply is not None and "<tool_call>" not in self.final_reply and bool(
            re.fullmatch(r"The answer is -?\d+\.", self.final_reply)
        )


def parse_calculator_call(text: str) -> str | None:
    """The expression of the first calculator call in `text`, or None if there is none."""
    match = _TOOL_CALL_RE.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") != arith_task.TOOL_NAME:
        return None
    args = call.get("arguments")
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return None
    return args["expression"]


def _generate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, ids: list[int], sampling: Sampling
) -> list[int]:
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if sampling.do_sample:
        kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_k": 0, "top_p": 1.0}
    else:
        kwargs = {"do_sample": False}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


def _reply_text(tokenizer: PreTrainedTokenizerBase, generated: list[int]) -> str:
    text = tokenizer.decode(generated, skip_special_tokens=False)
    return text[: -len(EOS_TOKEN)] if text.endswith(EOS_TOKEN) else text


def run_episode(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problem: arith_task.Problem, sampling: Sampling
) -> Episode:
    with torch.random.fork_rng():
        torch.manual_seed(sampling.seed)
        return _run_episode(model, tokenizer, problem, sampling)


def _run_episode(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, problem: arith_task.Problem, sampling: Sampling
) -> Episode:
    messages = [
        {"role": "system", "content": arith_task.SYSTEM_PROMPT},
        {"role": "user", "content": arith_task.user_prompt(problem)},
    ]
    prompt = render(tokenizer, messages, TASK_TOOLS, add_generation_prompt=True)
    ids1 = list(tokenizer.encode(prompt, add_special_tokens=False))
    gen1 = _generate(model, tokenizer, ids1, sampling)
    first = _reply_text(tokenizer, gen1)
    finished = bool(gen1) and gen1[-1] == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    expression = parse_calculator_call(first) if finished else None
    if expression is None:
        return Episode(problem, first, None, None, 0.0)
    try:
        result = str(arith_task.calculate(expression))
    except arith_task.CalculatorError as e:
        result = f"error: {e}"
    function = {"name": arith_task.TOOL_NAME, "arguments": json.dumps({"expression": expression})}
    tool_call = {"id": "call_0", "type": "function", "function": function}
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [tool_call]}]
    closed = render(tokenizer, history, TASK_TOOLS, add_generation_prompt=False)
    tool_turn = {"role": "tool", "tool_call_id": "call_0", "content": result}
    full = render(tokenizer, history + [tool_turn], TASK_TOOLS, add_generation_prompt=True)
    tail = full[len(closed) - 1 :]  # from the "\n" that closes the assistant turn
    ids2 = ids1 + gen1 + list(tokenizer.encode(tail, add_special_tokens=False))
    final = _reply_text(tokenizer, _generate(model, tokenizer, ids2, sampling))
    return Episode(problem, first, expression, final, arith_task.verify(final, problem))


@dataclass(frozen=True)
class Summary:
    episodes: int
    tool_call_ok: int
    expression_exact: int
    final_answer_ok: int
    correct: int


def summarize(episodes: list[Episode]) -> Summary:
    return Summary(
        episodes=len(episodes),
        tool_call_ok=sum(e.tool_call_ok for e in episodes),
        expression_exact=sum(e.expression_exact for e in episodes),
        final_answer_ok=sum(e.final_answer_ok for e in episodes),
        correct=sum(e.reward == 1.0 for e in episodes),
    )
