"""Prompt-source set-up: bad rows, the length filter, the `env:` section's source (`datasets`)."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from examples.arith.gym_task import TASK as ARITH_TASK
from examples.arith.rows import build_row
from examples.arith.task import make_problems
from nemo_rl.environments.datasets import (
    chat_messages,
    chat_tools,
    drop_overlong,
    load_jsonl,
    make_prompt_source,
)
from nemo_rl.environments.gym_client import PromptDataset, TaskPromptSource
from nemo_rl.environments.gym_servers import dataset_path, package_dir
from nemo_rl.environments.nemo_gym_config import GymEnvironmentConfig, NemoGymConfig, NemoGymError
from nemo_rl.environments.task import RowSampling

SAMPLING = RowSampling(temperature=0.7, top_p=0.9, max_output_tokens=32)


def _rows(count: int) -> list[dict]:
    return [
        {"id": i, "responses_create_params": {"input": [{"role": "user", "content": f"q{i}"}], "temperature": 0.1}}
        for i in range(count)
    ]


def _ids(rows: list[dict]) -> list[int]:
    return [r["id"] for r in rows]


def test_load_jsonl_names_the_file_and_line_of_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_rows(1)[0]) + "\n\n" + json.dumps({"prompt": "no params"}) + "\n")
    with pytest.raises(NemoGymError, match=rf"{path}:3: the row has no `responses_create_params`") as raised:
        load_jsonl(path, 0, SAMPLING)
    assert raised.value.kind == "dataset"
    path.write_text("{not json\n")
    with pytest.raises(NemoGymError, match=rf"{path}:1: not valid JSON") as raised:
        load_jsonl(path, 0, SAMPLING)
    assert raised.value.kind == "dataset"
    path.write_text(json.dumps({"responses_create_params": {"tools": []}}) + "\n")
    with pytest.raises(NemoGymError, match=rf"{path}:1: `responses_create_params` has no `input`") as raised:
        load_jsonl(path, 0, SAMPLING)
    assert raised.value.kind == "dataset"
    path.write_text("\n")
    with pytest.raises(NemoGymError, match="no rows") as raised:
        load_jsonl(path, 0, SAMPLING)
    assert raised.value.kind == "dataset"


def test_arith_source_is_todays_rows() -> None:
    source = TaskPromptSource(ARITH_TASK, 42, SAMPLING)
    expected = [build_row(p, SAMPLING) for p in make_problems(42 * 100_003 + 3, 2)]
    assert source.batch(3, 2) == expected
    assert make_prompt_source(NemoGymConfig(), seed=42, sampling=SAMPLING, model_dir="/nonexistent",
                              max_model_len=10).batch(3, 2) == expected


def test_drop_overlong_counts_skips_and_fails_when_nothing_fits() -> None:
    ds = PromptDataset(_rows(4), 0, SAMPLING)
    kept, dropped = drop_overlong(ds, lambda row: 100 * (row["id"] + 1), max_output_tokens=32, max_model_len=250)
    assert _ids(list(kept.rows)) == [0, 1] and dropped == [300, 400]
    with pytest.raises(NemoGymError, match=r"\(100\.\.400 tokens\).*raise generation\.vllm\.max_model_len") as raised:
        drop_overlong(ds, lambda row: 100 * (row["id"] + 1), max_output_tokens=32, max_model_len=100)
    assert raised.value.kind == "dataset"


def test_shipped_example_rows_parse_and_render_as_chat() -> None:
    cfg = GymEnvironmentConfig(resources_server="example_single_tool_call")
    ds = load_jsonl(dataset_path(cfg, package_dir(cfg.resources_server)), 0, SAMPLING)
    assert len(ds) == 5
    params = ds.rows[0]["responses_create_params"]
    assert [m["role"] for m in chat_messages(params)] == ["developer", "user"]
    assert chat_tools(params)[0]["function"]["name"] == "get_weather"


def test_arith_pool_walks_a_fixed_pool_in_epochs() -> None:
    cfg = NemoGymConfig(arith_problem_pool=6)
    source = make_prompt_source(cfg, seed=7, sampling=SAMPLING, model_dir="/nonexistent", max_model_len=10)
    pool = [build_row(p, SAMPLING) for p in make_problems(7 * 100_003, 6)]
    first_epoch = source.batch(1, 3) + source.batch(2, 3)
    assert sorted(map(json.dumps, first_epoch)) == sorted(map(json.dumps, pool))
    second_epoch = source.batch(3, 3) + source.batch(4, 3)
    assert sorted(map(json.dumps, second_epoch)) == sorted(map(json.dumps, pool))
    assert first_epoch != second_epoch  # each epoch is its own shuffle
    assert source.batch(3, 3) == make_prompt_source(cfg, seed=7, sampling=SAMPLING, model_dir="/x", max_model_len=10).batch(3, 3)


def test_arith_pool_refused_with_a_gym_environment() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"env\.arith_problem_pool=4 applies to the built-in arithmetic"):
        NemoGymConfig(arith_problem_pool=4, gym=GymEnvironmentConfig(resources_server="example_multi_step"))
    with pytest.raises(pydantic.ValidationError, match="arith_problem_pool"):
        NemoGymConfig(arith_problem_pool=0)
