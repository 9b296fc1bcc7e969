"""Synthetic transcripts of Gym's shipped `example_session_state_mgmt` environment (a stateful counter).

Contract:
- The environment (installed with Gym, read only): each row asks `add <a> then add <b> then get
  the count` with the tools `increment_counter(count: int)` and `get_counter_value()`; its
  resources server seeds a per-session counter at the row's `initial_count`, and `verify` rewards
  1.0 when the counter equals `expected_count` (= initial + a + b), else 0.0.
- `env_tools()` are the tools of the package's own `data/example.jsonl` rows (every row carries the
  same two), in the chat form the gate hands the chat template (`{"type": "function", "function":
  {name, description, parameters}}`), keys in the rows' own order: the template prints them as
  JSON, so the transcripts render the very system prompt the env's rollouts see. `env_rows()` are
  those rows as shipped.
- `make_problems(seed, n)`: `n` `CounterProblem`s, a pure function of `seed`, with `a, b` in
  `1..MAX_ADD` and `initial` in `0..MAX_INITIAL`.
- `counter_conversation(p)`: the intended rollout as chat messages, one tool call per assistant
  turn (as simple_agent runs it): increment a, increment b, read the counter, then
  `final_answer_text(total)`. Tool outputs are the server's own response bodies (compact JSON).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from nemo_rl.environments import gym_servers

ENV_NAME = "example_session_state_mgmt"
DATASET = "data/example.jsonl"
INCREMENT = "increment_counter"
READ = "get_counter_value"
MAX_ADD = 20  # the env's example rows add 1..14: cover that range densely (1..60 left most rollouts miscopying)
MAX_INITIAL = 40


class CounterTranscriptError(ValueError):
    """The installed environment's rows are not the shape this generator was written for."""


@dataclass(frozen=True)
class CounterProblem:
    a: int
    b: int
    initial: int

    @property
    def total(self) -> int:
        return self.initial + self.a + self.b


def dataset_path() -> Path:
    return gym_servers.package_dir(ENV_NAME) / DATASET


def env_rows() -> list[dict]:
    path = dataset_path()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def chat_tool(tool: dict) -> dict:
    """A Responses-API function tool as the chat template sees it (Gym's converter drops `strict`)."""
    if tool.get("type") != "function" or "name" not in tool:
        raise CounterTranscriptError(f"{ENV_NAME} tool {tool!r} is not a Responses function tool; expected type=function")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def env_tools() -> list[dict]:
    """The tools every shipped example row carries, in chat form and in the rows' own key order (the
    order the chat template renders them in at run time); an error if rows disagree."""
    rows = env_rows()
    shapes = {json.dumps(r["responses_create_params"].get("tools"), sort_keys=True) for r in rows}
    if len(shapes) != 1:
        raise CounterTranscriptError(f"{dataset_path()} rows carry {len(shapes)} different tool lists; expected one")
    tools = [chat_tool(t) for t in rows[0]["responses_create_params"]["tools"]]
    names = [t["function"]["name"] for t in tools]
    if names != [INCREMENT, READ]:
        raise CounterTranscriptError(f"{dataset_path()} tools are {names}; this generator knows {[INCREMENT, READ]}")
    return tools


def user_prompt(p: CounterProblem) -> str:
    return f"add {p.a} then add {p.b} then get the count"


def final_answer_text(total: int) -> str:
    return f"The count is {total}."


def make_problems(seed: int, n: int) -> list[CounterProblem]:
    rng = random.Random(seed)
    return [
        CounterProblem(a=rng.randint(1, MAX_ADD), b=rng.randint(1, MAX_ADD), initial=rng.randint(0, MAX_INITIAL))
        for _ in range(n)
    ]


def _compact(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _call(call_id: str, name: str, arguments: dict) -> dict:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": function}]}


def counter_conversation(p: CounterProblem) -> list[dict]:
    steps = [
        (INCREMENT, {"count": p.a}, {"success": True}),
        (INCREMENT, {"count": p.b}, {"success": True}),
        (READ, {}, {"count": p.total}),
    ]
    messages: list[dict] = [{"role": "user", "content": user_prompt(p)}]
    for i, (name, arguments, result) in enumerate(steps):
        messages.append(_call(f"call_{i}", name, arguments))
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": _compact(result)})
    messages.append({"role": "assistant", "content": final_answer_text(p.total)})
    return messages
