"""The `/run` bodies of a step (`gym_client`): determinism, the epoch walk, the sampling overlay."""

from __future__ import annotations

import pytest

from nemo_rl.environments.gym_client import PromptDataset
from nemo_rl.environments.task import RowSampling

SAMPLING = RowSampling(temperature=0.7, top_p=0.9, max_output_tokens=32)


def _rows(count: int) -> list[dict]:
    return [
        {"id": i, "responses_create_params": {"input": [{"role": "user", "content": f"q{i}"}], "temperature": 0.1}}
        for i in range(count)
    ]


def _ids(rows: list[dict]) -> list[int]:
    return [r["id"] for r in rows]


def test_batch_is_deterministic_in_seed_and_step() -> None:
    a, b = PromptDataset(_rows(7), 3, SAMPLING), PromptDataset(_rows(7), 3, SAMPLING)
    assert [_ids(a.batch(s, 3)) for s in range(1, 6)] == [_ids(b.batch(s, 3)) for s in range(1, 6)]
    assert _ids(a.batch(4, 3)) == _ids(a.batch(4, 3))  # not a stateful iterator
    other = PromptDataset(_rows(7), 4, SAMPLING)
    assert [_ids(a.batch(s, 7)) for s in (1, 2)] != [_ids(other.batch(s, 7)) for s in (1, 2)]


@pytest.mark.parametrize("size,n", [(5, 1), (5, 2), (7, 3), (4, 4), (3, 5)])
def test_each_epoch_walks_every_row_once_before_repeating(size: int, n: int) -> None:
    ds = PromptDataset(_rows(size), 11, SAMPLING)
    walked = [i for step in range(1, 4 * size + 1) for i in _ids(ds.batch(step, n))]
    epochs = [walked[k : k + size] for k in range(0, len(walked) - size + 1, size)]
    assert all(sorted(epoch) == list(range(size)) for epoch in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch


def test_sampling_is_set_on_a_copy_and_the_source_rows_stay_untouched() -> None:
    rows = _rows(2)
    ds = PromptDataset(rows, 0, SAMPLING)
    out = ds.batch(1, 2)
    for row in out:
        params = row["responses_create_params"]
        assert (params["temperature"], params["top_p"], params["max_output_tokens"]) == (0.7, 0.9, 32)
        row["responses_create_params"]["input"].append({"role": "user", "content": "mutated"})
    assert rows == _rows(2)
    assert all(len(r["responses_create_params"]["input"]) == 1 for r in ds.rows)
    assert all(r["responses_create_params"]["temperature"] == 0.1 for r in ds.rows)


def test_batch_rejects_step_zero() -> None:
    with pytest.raises(ValueError, match="1-based"):
        PromptDataset(_rows(2), 0, SAMPLING).batch(0, 1)
