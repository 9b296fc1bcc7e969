"""ServedCall's unresolved-continuation flag and the worker's "history has an assistant turn" rule.

The worker marks a `text` admission over a history with assistant turns as an unresolved
continuation; the gate decided "root" for it by Gym's rule (`assistant_fingerprint` empty means
no assistant output). `has_assistant_turn` must agree with that rule on every request, or the
capture-health figures would count a root as a miss (or hide a miss).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_gym.token_id_capture.fingerprint import assistant_fingerprint

from nemo_rl.data.calls import ServedCall, ServedCallError, has_assistant_turn

_TEXT = st.text(max_size=12)
_TOOL_CALL = st.fixed_dictionaries({
    "id": st.sampled_from(["call_1", "call_2"]), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.just("calculator"),
                                       "arguments": st.sampled_from(['{"expression": "1 + 2"}', "{}", "not json"])}),
})
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]), "content": _TEXT}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": st.just("call_1"), "content": _TEXT}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), _TEXT)},
                          optional={"tool_calls": st.lists(_TOOL_CALL, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"), "name": st.just("calculator"),
                           "arguments": st.just("{}")}),
)


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(_MESSAGE, max_size=6))
def test_the_workers_rule_is_gyms_rule_for_assistant_output(messages):
    assert has_assistant_turn(messages) == bool(assistant_fingerprint(messages))


def test_an_empty_assistant_turn_is_still_a_turn():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert has_assistant_turn(history) is True and bool(assistant_fingerprint(history)) is True
    assert has_assistant_turn([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) is False


def test_only_a_text_admission_can_be_an_unresolved_continuation():
    root = ServedCall("r", "c2", None, "text", 3, True, unresolved_continuation=True)
    assert ServedCall.from_wire(root.to_wire()) == root
    with pytest.raises(ServedCallError, match="True only for a text admission"):
        ServedCall("r", "c2", "c1", "token_in", 3, True, unresolved_continuation=True)
    with pytest.raises(ServedCallError, match="unresolved_continuation is a bool"):
        ServedCall("r", "c2", None, "text", 3, True, unresolved_continuation=1)
