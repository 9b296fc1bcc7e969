"""The legacy token-echo row builder (capture off): `legacy_row_from_result` -> a one-row KeptRollout.

(The capture path, formerly `finalize_rollout`, is the judge: see test_judge.py; `fetch_snapshots` is
tested there too.)
"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from nemo_rl.data.rows import KeptRollout, Placeholder, PlaceholderReason, RowOrigin
from nemo_rl.experience.legacy_rows import legacy_row_from_result

RID = "run-s1-g2-i3-a0"
SLOT = {"group_index": 2, "sample_index": 3}


# --- legacy path (capture off) ------------------------------------------------------------------


def _echo(prompt, generated, logprobs, item_id="msg_1"):
    return {"id": item_id, "type": "message", "prompt_token_ids": prompt, "generation_token_ids": generated,
            "generation_log_probs": logprobs}


def _legacy(output, reward=1.0):
    result = {"response": {"output": output}, "reward": reward}
    return legacy_row_from_result(result, rollout_id=RID, **SLOT)


def test_legacy_contiguous_calls_become_carry_plus_generation():
    kept = _legacy([
        _echo([1, 2], [3], [-0.1], "fc_1"),
        {"type": "function_call_output", "call_id": "fc_1", "output": "42"},
        _echo([1, 2, 3, 4, 5], [6, 7], [-0.2, -0.3], "msg_2"),
    ])

    assert isinstance(kept, KeptRollout)
    assert (kept.rollout_id, kept.group_index, kept.sample_index) == (RID, 2, 3)
    assert (kept.reward, kept.terminal_selection, kept.yield_, len(kept.rows)) == (1.0, None, None, 1)
    row = kept.rows[0]
    assert row.token_ids == (1, 2, 3, 4, 5, 6, 7)
    assert row.token_mask == (0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0)
    assert row.generation_logprobs == (0.0, 0.0, -0.1, 0.0, 0.0, -0.2, -0.3)
    assert (row.prompt_len, row.model_call_ids, row.weight_versions) == (2, ("fc_1", "msg_2"), (None, None))
    assert row.origin is RowOrigin.LEGACY
    assert (row.token_in_calls, row.text_root_calls, row.terminal_selection) == (0, 0, None)
    assert (row.call_spans, row.chain_index, row.reward) == ((), 0, 1.0)


def test_legacy_noncontiguous_prompt_is_a_placeholder():
    result = _legacy([_echo([1, 2], [3], [-0.1]), _echo([1, 2, 9, 4], [6], [-0.2])])

    assert isinstance(result, Placeholder)
    assert result.reason is PlaceholderReason.LEGACY_NONCONTIGUOUS
    assert result.detail == "call 1 prompt (4 ids) does not extend the 3 ids seen so far"
    assert result.reward == 1.0


def test_legacy_truncated_history_is_noncontiguous():
    result = _legacy([_echo([1, 2], [3], [-0.1]), _echo([1, 2], [6], [-0.2])])
    assert result.reason is PlaceholderReason.LEGACY_NONCONTIGUOUS


def test_legacy_without_echo_is_a_placeholder():
    assert _legacy([{"type": "message", "id": "m"}]).reason is PlaceholderReason.LEGACY_TOKEN_ECHO_MISSING
    no_response = legacy_row_from_result({"reward": 1.0}, rollout_id=RID, **SLOT)
    assert no_response.reason is PlaceholderReason.LEGACY_TOKEN_ECHO_MISSING


def test_legacy_malformed_echo_is_a_placeholder():
    partial = {"prompt_token_ids": [1], "generation_token_ids": [2]}
    assert _legacy([partial]).reason is PlaceholderReason.LEGACY_INVALID_ECHO
    assert _legacy([_echo([1], [2, 3], [-0.1])]).reason is PlaceholderReason.LEGACY_INVALID_ECHO
    assert _legacy([_echo([1], [2], [math.nan])]).reason is PlaceholderReason.LEGACY_INVALID_ECHO
    assert _legacy([_echo([1, -4], [2], [-0.1])]).reason is PlaceholderReason.LEGACY_INVALID_ECHO
    assert _legacy([_echo("12", [2], [-0.1])]).reason is PlaceholderReason.LEGACY_INVALID_ECHO


def test_legacy_without_generated_tokens_or_reward_is_a_placeholder():
    assert _legacy([_echo([1, 2], [], [])]) == Placeholder(
        RID, 2, 3, PlaceholderReason.EMPTY_GENERATION, "1 echoed calls generated no token", 1.0)
    assert _legacy([_echo([1, 2], [3], [-0.1])], reward=None) == Placeholder(
        RID, 2, 3, PlaceholderReason.REWARD_MISSING, "run result has no finite reward", None)


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 50_000), max_size=6),
            st.lists(st.tuples(st.integers(0, 50_000), st.floats(-20.0, 0.0)), min_size=1, max_size=6),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_legacy_row_is_the_concatenation_of_calls(calls):
    output, sequence, mask = [], [], []
    for k, (tail, generated) in enumerate(calls):
        gen_ids = [t for t, _ in generated]
        output.append(_echo(sequence + tail, gen_ids, [lp for _, lp in generated], f"msg_{k}"))
        sequence = sequence + tail + gen_ids
        mask += [0.0] * len(tail) + [1.0] * len(gen_ids)

    kept = _legacy(output)

    assert isinstance(kept, KeptRollout) and len(kept.rows) == 1
    row = kept.rows[0]
    assert row.token_ids == tuple(sequence)
    assert row.token_mask == tuple(mask)
    assert row.prompt_len == len(calls[0][0])
    assert [lp for m, lp in zip(row.token_mask, row.generation_logprobs) if m == 1.0] == [
        lp for _, generated in calls for _, lp in generated
    ]
