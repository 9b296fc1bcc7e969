"""The one rollout-id rule: minted ids pass it, and every caller refuses the same ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.store import validate_rollout_id

from nemo_rl.data.request_rules import (
    DEFAULT_MAX_ROLLOUT_ID_CHARS,
    MAX_ROLLOUT_ID_CHARS,
    RolloutIdError,
    check_rollout_id,
    rollout_id_for,
)


def test_minted_ids_name_the_attempt_and_pass_the_rule() -> None:
    rid = rollout_id_for("grpo-1a2b3c4d", 7, 3, 15, 2)
    assert rid == "grpo-1a2b3c4d-s7-g3-i15-a2"
    assert check_rollout_id(rid) == rid == validate_rollout_id(rid)


def test_a_run_id_that_cannot_start_an_id_fails_at_minting() -> None:
    with pytest.raises(RolloutIdError, match='it starts with "-"'):
        rollout_id_for("-run", 0, 0, 0, 0)
    with pytest.raises(RolloutIdError, match="too long"):
        rollout_id_for("r" * DEFAULT_MAX_ROLLOUT_ID_CHARS, 0, 0, 0, 0)


@pytest.mark.parametrize(
    ("rollout_id", "problem"),
    [
        ("", "the rollout id is empty"),
        ("a" * 129, "rollout id of 129 characters is too long"),
        ("a b", 'rollout id "a b" is not usable: it contains " "'),
        ("_x", 'rollout id "_x" is not usable: it starts with "_"'),
        (7, "the rollout id is a int, not a str"),
    ],
)
def test_the_error_names_the_problem_and_the_rule(rollout_id: object, problem: str) -> None:
    with pytest.raises(RolloutIdError) as e:
        check_rollout_id(rollout_id)
    assert e.value.problem == problem
    assert str(e.value) == f"{problem}; a rollout id is 1..128 ASCII letters, digits, '.', '_' or '-', starting " \
                           "with a letter or digit"


def test_limits_are_bounded_by_the_ceiling() -> None:
    assert check_rollout_id("r" * MAX_ROLLOUT_ID_CHARS, MAX_ROLLOUT_ID_CHARS)
    for bad in (0, MAX_ROLLOUT_ID_CHARS + 1, 1.5):
        with pytest.raises(ValueError, match="a rollout-id limit is an int"):
            check_rollout_id("r", bad)


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_every_id_the_rule_accepts_gym_accepts(rollout_id: str) -> None:
    try:
        check_rollout_id(rollout_id)
    except RolloutIdError:
        return
    assert validate_rollout_id(rollout_id) == rollout_id
