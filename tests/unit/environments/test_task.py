"""The task seam: `env.task` names a task by `<module>:<attribute>`, loaded with errors that name the field."""

from __future__ import annotations

import sys
import types

import pydantic
import pytest

from examples.arith.gym_task import RESOURCES_SERVER, TASK
from nemo_rl.environments.nemo_gym_config import DEFAULT_TASK, NemoGymConfig, NemoGymError
from nemo_rl.environments.task import GymTask, RowSampling, load_task

SAMPLING = RowSampling(temperature=1.0, top_p=1.0, max_output_tokens=16)


def test_the_default_task_is_the_example_arithmetic_task() -> None:
    assert NemoGymConfig().task == DEFAULT_TASK == "examples.arith.gym_task:TASK"
    task = load_task(DEFAULT_TASK)
    assert task is TASK and isinstance(task, GymTask)
    assert task.resources_server == RESOURCES_SERVER
    assert (RESOURCES_SERVER.name, RESOURCES_SERVER.agent_name, RESOURCES_SERVER.module) == (
        "arith_resources", "arith_agent", "examples.arith.resources")
    assert task.rows(5, 3, SAMPLING) == task.rows(5, 3, SAMPLING) != task.rows(6, 3, SAMPLING)


def test_a_malformed_task_string_is_refused_by_the_config() -> None:
    with pytest.raises(pydantic.ValidationError, match="task"):
        NemoGymConfig(task="examples.arith.gym_task")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", r"env\.task='no_colon_here' is not '<module>:<attribute>'"),
        ("no_such_module_xyz:TASK", r"env\.task='no_such_module_xyz:TASK': module 'no_such_module_xyz' cannot be imported"),
        ("examples.arith.gym_task:NOPE", r"module 'examples\.arith\.gym_task' has no attribute 'NOPE'"),
        ("examples.arith.gym_task:RESOURCES_MODULE", r"is a str, not a task: it needs `resources_server` and `rows"),
    ],
)
def test_load_errors_name_the_field_the_value_and_the_cause(spec: str, message: str) -> None:
    with pytest.raises(NemoGymError, match=message) as raised:
        load_task(spec)
    assert raised.value.kind == "task_load"


def test_any_object_with_a_resources_server_and_rows_is_a_task(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("nrl_test_task")
    module.MY_TASK = types.SimpleNamespace(resources_server=RESOURCES_SERVER, rows=lambda seed, count, sampling: [])
    monkeypatch.setitem(sys.modules, "nrl_test_task", module)
    assert load_task("nrl_test_task:MY_TASK") is module.MY_TASK
