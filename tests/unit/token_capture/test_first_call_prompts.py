"""first_call_prompt_records: one record per row (its chain's first-call prompt) and per placeholder."""

from __future__ import annotations

from nemo_rl.data.rows import (
    GroupResult,
    KeptRollout,
    Placeholder,
    PlaceholderReason,
    RowOrigin,
    TrainRow,
)
from nemo_rl.token_capture.metrics import first_call_prompt_records


def _capture_row(rid: str, group: int, sample: int, token_ids: tuple[int, ...], prompt_len: int,
                 chain_index: int = 0, call: str = "c") -> TrainRow:
    n = len(token_ids)
    mask = (0.0,) * prompt_len + (1.0,) * (n - prompt_len)
    return TrainRow(
        rollout_id=rid, group_index=group, sample_index=sample, token_ids=token_ids, token_mask=mask,
        generation_logprobs=tuple(-0.5 if m else 0.0 for m in mask), reward=1.0, prompt_len=prompt_len,
        model_call_ids=(call,), weight_versions=(0,), token_in_calls=0, text_root_calls=1,
        terminal_selection="response_id", origin=RowOrigin.CAPTURE, call_spans=((0, n),), chain_index=chain_index,
    )


def _legacy_row(rid: str, group: int, sample: int, token_ids: tuple[int, ...], prompt_len: int) -> TrainRow:
    n = len(token_ids)
    mask = (0.0,) * prompt_len + (1.0,) * (n - prompt_len)
    return TrainRow(
        rollout_id=rid, group_index=group, sample_index=sample, token_ids=token_ids, token_mask=mask,
        generation_logprobs=tuple(-0.5 if m else 0.0 for m in mask), reward=0.0, prompt_len=prompt_len,
        model_call_ids=("x",), weight_versions=(None,), token_in_calls=0, text_root_calls=0,
        terminal_selection=None, origin=RowOrigin.LEGACY,
    )


def test_records_hold_each_rows_first_call_prompt_and_each_placeholder_reason():
    branched = KeptRollout("b", 0, 1, (
        _capture_row("b", 0, 1, (5, 6, 7, 8), 2, chain_index=0, call="t"),
        _capture_row("b", 0, 1, (5, 9, 10), 1, chain_index=1, call="u"),
    ), 1.0, "response_id")
    groups = [
        GroupResult(0, (
            KeptRollout("a", 0, 0, (_capture_row("a", 0, 0, (1, 2, 3, 4, 5), 3),), 1.0, "response_id"),
            branched,
            Placeholder("c", 0, 2, PlaceholderReason.RUN_TIMEOUT, "slow"),
        )),
        GroupResult(1, (KeptRollout("d", 1, 0, (_legacy_row("d", 1, 0, (7, 7, 8), 2),), 0.0, None),)),
    ]
    assert first_call_prompt_records(3, groups) == [
        {"step": 3, "group": 0, "rollout": 0, "chain": 0, "origin": "capture", "prompt_ids": [1, 2, 3], "placeholder": None},
        {"step": 3, "group": 0, "rollout": 1, "chain": 0, "origin": "capture", "prompt_ids": [5, 6], "placeholder": None},
        {"step": 3, "group": 0, "rollout": 1, "chain": 1, "origin": "capture", "prompt_ids": [5], "placeholder": None},
        {"step": 3, "group": 0, "rollout": 2, "chain": None, "origin": None, "prompt_ids": None, "placeholder": "run_timeout"},
        {"step": 3, "group": 1, "rollout": 0, "chain": 0, "origin": "legacy", "prompt_ids": [7, 7], "placeholder": None},
    ]
