"""The seam between the Gym environment and a task that ships its own resources server.

`env.task` names a task as `<module>:<attribute>` (default: the example arithmetic task), used
only when `env.gym` is null; the library never imports a task by name except through
`load_task`. A `GymTask` has `resources_server` and `rows(seed, count, sampling)`, a pure
function of `seed` carrying the recipe's `RowSampling`. `load_task` raises a `NemoGymError`
of kind `task_load` naming `env.task`, the value and the fix for any spec it cannot load.
See docs/design-docs/gym-environment.md, "Tasks".
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from nemo_rl.environments.nemo_gym_config import NemoGymError
from nemo_rl.environments.nemo_gym_launch import ResourcesServer

TASK_FIELD = "env.task"


class RowSampling(BaseModel):
    """Per-request sampling the agent sends with every model call of one rollout."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    temperature: float = Field(ge=0.0, allow_inf_nan=False)
    top_p: float = Field(gt=0.0, le=1.0, allow_inf_nan=False)
    max_output_tokens: int = Field(ge=1)


@runtime_checkable
class GymTask(Protocol):
    """A task run on our own Gym resources server (see the module docstring)."""

    @property
    def resources_server(self) -> ResourcesServer: ...

    def rows(self, seed: int, count: int, sampling: RowSampling) -> list[dict[str, Any]]: ...


def load_task(spec: str) -> GymTask:
    """The task object `spec` (`<module>:<attribute>`) names; a `task_load` `NemoGymError` when it cannot be used."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise NemoGymError(
            f"{TASK_FIELD}={spec!r} is not '<module>:<attribute>' (fix: e.g. {TASK_FIELD}=examples.arith.gym_task:TASK)",
            kind="task_load",
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise NemoGymError(
            f"{TASK_FIELD}={spec!r}: module {module_name!r} cannot be imported ({e}); fix: run from the "
            f"repository (its root on PYTHONPATH) or name an installed module",
            kind="task_load",
        ) from e
    if not hasattr(module, attribute):
        raise NemoGymError(
            f"{TASK_FIELD}={spec!r}: module {module_name!r} has no attribute {attribute!r}",
            kind="task_load",
        )
    task = getattr(module, attribute)
    if not isinstance(task, GymTask):
        raise NemoGymError(
            f"{TASK_FIELD}={spec!r} is a {type(task).__name__}, not a task: it needs `resources_server` "
            "and `rows(seed, count, sampling)` (nemo_rl.environments.task.GymTask)",
            kind="task_load",
        )
    return task
