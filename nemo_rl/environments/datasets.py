"""Prompt sources: the rows the GRPO loop dispatches each step (the loop knows no task).

A `PromptSource` has `batch(step, n)`: the agent `/run` bodies of step `step`, deterministic in
(seed, step), each a fresh deep copy. `PromptDataset` walks its rows in seeded epochs (every row
once before any repeats) and sets the recipe's sampling onto each row; `TaskPromptSource` and
`task_pool` draw from a `GymTask`; `make_prompt_source` picks what the `env:` section names.
Refuses a bad dataset line (`GymDatasetError` naming file and line); a row whose prompt plus
`max_output_tokens` exceeds `max_model_len` is dropped and counted, never dispatched to fail,
and all rows dropped is an error naming the fix.
Invariant: the dataloader position is the step, which is what makes resume exact.
See docs/design-docs/gym-environment.md, "Prompt sources".
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from nemo_rl.environments.gym_servers import dataset_path, package_dir
from nemo_rl.environments.nemo_gym_config import GymDatasetError, NemoGymConfig
from nemo_rl.environments.task import GymTask, RowSampling, load_task

PARAMS_FIELD = "responses_create_params"
_TASK_STEP_STRIDE = 100_003
_EPOCH_STRIDE = 1_000_003


class PromptSource(Protocol):
    def batch(self, step: int, n: int) -> list[dict[str, Any]]: ...


def _check_step(step: int, n: int) -> None:
    if step < 1 or n < 1:
        raise ValueError(f"batch(step={step}, n={n}): step is 1-based and n must be >= 1")


def apply_sampling(row: Mapping[str, Any], sampling: RowSampling) -> dict[str, Any]:
    """A deep copy of `row` whose `responses_create_params` carries the recipe's sampling."""
    out = copy.deepcopy(dict(row))
    out[PARAMS_FIELD] = {
        **out[PARAMS_FIELD],
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_output_tokens": sampling.max_output_tokens,
    }
    return out


def parse_row(line: str, where: str) -> dict[str, Any]:
    """One Gym dataset line as a row; `where` (file:line) names it in the error."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise GymDatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(row, dict):
        raise GymDatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    params = row.get(PARAMS_FIELD)
    if not isinstance(params, dict):
        raise GymDatasetError(
            f"{where}: the row has no `{PARAMS_FIELD}` object (keys: {sorted(row)}); Gym rows carry the "
            f"model request there, e.g. {{\"{PARAMS_FIELD}\": {{\"input\": [...]}}, ...verifier fields}}"
        )
    if "input" not in params:
        raise GymDatasetError(f"{where}: `{PARAMS_FIELD}` has no `input` (keys: {sorted(params)})")
    return row


class PromptDataset:
    """Rows from a file, walked epoch by epoch (see the module docstring)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], seed: int, sampling: RowSampling, source: str = "<rows>") -> None:
        if not rows:
            raise GymDatasetError(f"{source}: the dataset has no rows")
        self._rows = tuple(copy.deepcopy(dict(r)) for r in rows)
        self._seed = seed
        self._sampling = sampling
        self.source = source
        self._orders: dict[int, list[int]] = {}

    @classmethod
    def from_jsonl(cls, path: Path | str, seed: int, sampling: RowSampling) -> "PromptDataset":
        path = Path(path)
        rows = [
            parse_row(line, f"{path}:{number}")
            for number, line in enumerate(path.read_text().splitlines(), start=1)
            if line.strip()
        ]
        return cls(rows, seed, sampling, source=str(path))

    def with_rows(self, rows: Sequence[Mapping[str, Any]]) -> "PromptDataset":
        """The same seed, sampling and source over other rows (e.g. after a length filter)."""
        return PromptDataset(rows, self._seed, self._sampling, self.source)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def rows(self) -> tuple[dict[str, Any], ...]:
        return self._rows

    def epoch_order(self, epoch: int) -> list[int]:
        """The row order of one epoch (a permutation of all row indices)."""
        if epoch not in self._orders:
            order = list(range(len(self._rows)))
            random.Random(self._seed * _EPOCH_STRIDE + epoch).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def batch(self, step: int, n: int) -> list[dict[str, Any]]:
        _check_step(step, n)
        size = len(self._rows)
        picks = [self.epoch_order(pos // size)[pos % size] for pos in range((step - 1) * n, step * n)]
        return [apply_sampling(self._rows[i], self._sampling) for i in picks]


class TaskPromptSource:
    """A `GymTask`'s rows, drawn afresh every step."""

    def __init__(self, task: GymTask, seed: int, sampling: RowSampling) -> None:
        self._task = task
        self._seed = seed
        self._sampling = sampling

    def batch(self, step: int, n: int) -> list[dict[str, Any]]:
        _check_step(step, n)
        # Deep copies: the rows are the callers' to mutate, whatever the task shares between calls.
        return copy.deepcopy(self._task.rows(self._seed * _TASK_STEP_STRIDE + step, n, self._sampling))


def task_pool(task: GymTask, seed: int, size: int, sampling: RowSampling) -> PromptDataset:
    """A fixed pool of `size` rows of `task` drawn from `seed`, walked in epochs."""
    rows = task.rows(seed * _TASK_STEP_STRIDE, size, sampling)
    source = f"<{task.resources_server.package} pool of {size}, seed {seed}>"
    return PromptDataset(rows, seed, sampling, source=source)


def chat_messages(params: Mapping[str, Any]) -> list[dict[str, str]]:
    """The Responses `input` as plain chat messages (for measuring; non-message items as JSON text)."""
    items = params["input"]
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages = []
    for item in items:
        content = item.get("content") if isinstance(item, Mapping) else None
        if isinstance(item, Mapping) and "role" in item and isinstance(content, (str, list)):
            text = content if isinstance(content, str) else "".join(
                part.get("text", "") for part in content if isinstance(part, Mapping)
            )
            messages.append({"role": str(item["role"]), "content": text})
        else:
            messages.append({"role": "user", "content": json.dumps(item)})
    return messages


def chat_tools(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Responses-form function tools in chat-completions form."""
    return [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
        for t in params.get("tools") or []
        if isinstance(t, Mapping) and t.get("type", "function") == "function"
    ]


def prompt_tokens(row: Mapping[str, Any], tokenizer: Any) -> int:
    """Tokens of the row's first prompt as the chat template renders it (roles kept as written)."""
    params = row[PARAMS_FIELD]
    text = tokenizer.apply_chat_template(
        chat_messages(params), tools=chat_tools(params) or None, add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def drop_overlong(
    dataset: PromptDataset, count_tokens: Callable[[Mapping[str, Any]], int], max_output_tokens: int, max_model_len: int
) -> tuple[PromptDataset, list[int]]:
    """(dataset of the rows that fit, prompt lengths of the dropped rows)."""
    kept: list[dict[str, Any]] = []
    dropped: list[int] = []
    for row in dataset.rows:
        length = count_tokens(row)
        if length + max_output_tokens <= max_model_len:
            kept.append(row)
        else:
            dropped.append(length)
    if not kept:
        raise GymDatasetError(
            f"{dataset.source}: every row's prompt ({min(dropped)}..{max(dropped)} tokens) plus "
            f"max_output_tokens={max_output_tokens} exceeds generation.vllm.max_model_len={max_model_len}; "
            "raise generation.vllm.max_model_len (and model.tiny.max_position_embeddings for the tiny model)"
        )
    return dataset.with_rows(kept), dropped


def make_prompt_source(
    env_cfg: NemoGymConfig,
    *,
    seed: int,
    sampling: RowSampling,
    model_dir: Path | str,
    max_model_len: int,
    progress: Callable[[str], None] = print,
) -> PromptSource:
    """The prompt source the `env:` section names (see the module docstring)."""
    if env_cfg.gym is None:
        task = load_task(env_cfg.task)
        if env_cfg.arith_problem_pool is None:
            return TaskPromptSource(task, seed, sampling)
        return task_pool(task, seed, env_cfg.arith_problem_pool, sampling)
    path = dataset_path(env_cfg.gym, package_dir(env_cfg.gym.resources_server))
    dataset = PromptDataset.from_jsonl(path, seed, sampling)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dataset, dropped = drop_overlong(
        dataset, lambda row: prompt_tokens(row, tokenizer), sampling.max_output_tokens, max_model_len
    )
    progress(
        f"[prompts] {path}: {len(dataset)} rows"
        + (
            f"; skipped {len(dropped)} rows whose prompt ({min(dropped)}..{max(dropped)} tokens) + "
            f"max_output_tokens={sampling.max_output_tokens} exceeds max_model_len={max_model_len}"
            if dropped
            else ""
        )
    )
    return dataset
