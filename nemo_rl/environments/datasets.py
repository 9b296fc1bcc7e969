"""Prompt-source set-up: read and check the rows the GRPO loop dispatches (the loop knows no task).

`make_prompt_source` builds what the `env:` section names, once before the first step: a
`TaskPromptSource` or a `task_pool` of a `GymTask`, or a `PromptDataset` read from a Gym JSONL
(`load_jsonl`). Refuses a bad dataset line (a `NemoGymError` of kind `dataset` naming file and
line); a row whose prompt plus `max_output_tokens` exceeds `max_model_len` is dropped and counted,
never dispatched to fail, and all rows dropped is an error naming the fix. What runs each step
(`batch`) is `gym_client`'s. See docs/design-docs/gym-environment.md, "Prompt sources".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nemo_rl.environments.gym_client import (
    PARAMS_FIELD,
    TASK_STEP_STRIDE,
    PromptDataset,
    PromptSource,
    TaskPromptSource,
)
from nemo_rl.environments.gym_servers import dataset_path, package_dir
from nemo_rl.environments.nemo_gym_config import NemoGymConfig, NemoGymError
from nemo_rl.environments.task import GymTask, RowSampling, load_task


def parse_row(line: str, where: str) -> dict[str, Any]:
    """One Gym dataset line as a row; `where` (file:line) names it in the error."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise NemoGymError(f"{where}: not valid JSON ({e.msg} at column {e.colno})", kind="dataset") from e
    if not isinstance(row, dict):
        raise NemoGymError(f"{where}: a row must be a JSON object, got {type(row).__name__}", kind="dataset")
    params = row.get(PARAMS_FIELD)
    if not isinstance(params, dict):
        raise NemoGymError(
            f"{where}: the row has no `{PARAMS_FIELD}` object (keys: {sorted(row)}); Gym rows carry the "
            f"model request there, e.g. {{\"{PARAMS_FIELD}\": {{\"input\": [...]}}, ...verifier fields}}",
            kind="dataset",
        )
    if "input" not in params:
        raise NemoGymError(f"{where}: `{PARAMS_FIELD}` has no `input` (keys: {sorted(params)})", kind="dataset")
    return row


def load_jsonl(path: Path | str, seed: int, sampling: RowSampling) -> PromptDataset:
    """A `PromptDataset` of a Gym JSONL file's rows (each checked by `parse_row`)."""
    path = Path(path)
    rows = [
        parse_row(line, f"{path}:{number}")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if line.strip()
    ]
    return PromptDataset(rows, seed, sampling, source=str(path))


def task_pool(task: GymTask, seed: int, size: int, sampling: RowSampling) -> PromptDataset:
    """A fixed pool of `size` rows of `task` drawn from `seed`, walked in epochs."""
    rows = task.rows(seed * TASK_STEP_STRIDE, size, sampling)
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
        raise NemoGymError(
            f"{dataset.source}: every row's prompt ({min(dropped)}..{max(dropped)} tokens) plus "
            f"max_output_tokens={max_output_tokens} exceeds generation.vllm.max_model_len={max_model_len}; "
            "raise generation.vllm.max_model_len (and model.tiny.max_position_embeddings for the tiny model)",
            kind="dataset",
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
    dataset = load_jsonl(path, seed, sampling)
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
