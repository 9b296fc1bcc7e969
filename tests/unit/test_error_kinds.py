"""Error families with a `kind` (docs/design-docs/errors.md): one class per family, a validated kind.

Contract:
- Every kind of a family constructs, keeps the message as `str()` and the kind as `.kind`; an
  unknown kind is a `ValueError` at construction, a missing kind a `TypeError`.
- A kinded error pickles and unpickles with its kind and its other attributes (Ray pickles the
  exceptions that cross an actor call), also when a subclass has its own constructor, and it
  survives Ray's `RayTaskError(...).as_instanceof_cause()` the way the driver sees it.
"""

from __future__ import annotations

import pickle
import typing
from pathlib import Path

import pytest

from nemo_rl.algorithms.errors import GRPOError, GRPOKind, MaskedStepsError
from nemo_rl.algorithms.failed_rollouts import AllRolloutsFailedError
from nemo_rl.algorithms.grpo_async import AsyncLoopError
from nemo_rl.data.errors import FatalError, Kinded, RecoverableError
from nemo_rl.data.errors import RecordInvariantError, RecordKind
from nemo_rl.data_plane.errors import DataPlaneError, DataPlaneKind, DataPlaneTimeoutError, MissingKeysError
from nemo_rl.data_plane.errors import DataPlaneBugError, DataPlaneBugKind, FieldEncodingError
from nemo_rl.distributed.errors import RayClusterError, RayClusterKind
from nemo_rl.environments.nemo_gym_config import (
    GymRequirementsError,
    GymServerStartError,
    NemoGymError,
    NemoGymKind,
)
from nemo_rl.environments.nemo_gym_config import ManifestError, ManifestKind
from nemo_rl.experience.errors import AccountingError, AccountingKind
from nemo_rl.experience.finalizer_pool import FinalizerPoolError, FinalizerPoolKind
from nemo_rl.experience.prompt_queue import SnapshotMismatchError
from nemo_rl.models.generation.vllm.config import GenerationSetupError, GenerationSetupKind
from nemo_rl.models.policy.errors import PolicyLoadError, PolicyLoadKind, PolicyStepError, PolicyStepKind
from nemo_rl.models.policy.errors import PolicyStateError, PolicyStateKind, PolicyWorkerCallError, PolicyWorkerCallKind
from nemo_rl.token_capture.router_replay import RouterReplayError, RouterReplayKind, RouteShapeUnknownError
from nemo_rl.utils.checkpoint import CheckpointError, CheckpointKind
from nemo_rl.utils.config import ConfigError, ConfigKind

FAMILIES: list[tuple[type[Kinded], object, type]] = [
    (ConfigError, ConfigKind, FatalError),
    (CheckpointError, CheckpointKind, FatalError),
    (DataPlaneError, DataPlaneKind, RecoverableError),
    (NemoGymError, NemoGymKind, FatalError),
    (DataPlaneBugError, DataPlaneBugKind, FatalError),
    (ManifestError, ManifestKind, RecoverableError),
    (RouterReplayError, RouterReplayKind, RecoverableError),
    (AccountingError, AccountingKind, FatalError),
    (FinalizerPoolError, FinalizerPoolKind, FatalError),
    (GRPOError, GRPOKind, FatalError),
    (RecordInvariantError, RecordKind, FatalError),
    (PolicyLoadError, PolicyLoadKind, FatalError),
    (PolicyStepError, PolicyStepKind, FatalError),
    (PolicyStateError, PolicyStateKind, FatalError),
    (PolicyWorkerCallError, PolicyWorkerCallKind, FatalError),
    (RayClusterError, RayClusterKind, FatalError),
    (GenerationSetupError, GenerationSetupKind, FatalError),
]


# Kinds that have their own subclass (fields, or a builtin base): the family base refuses them.
OWN_CLASS = {cls: tuple(cls.OWN_CLASS) for cls, _, _ in FAMILIES}


def _every_kind() -> list[tuple[type[Kinded], str, type]]:
    return [
        (cls, kind, side)
        for cls, literal, side in FAMILIES
        for kind in typing.get_args(literal)
        if kind not in OWN_CLASS.get(cls, ())
    ]


@pytest.mark.parametrize(("cls", "kind", "side"), _every_kind(), ids=lambda v: getattr(v, "__name__", v))
def test_every_kind_constructs_pickles_and_keeps_its_message(cls, kind, side) -> None:
    assert cls.KINDS == typing.get_args(dict((c, lit) for c, lit, _ in FAMILIES)[cls])
    error = cls(f"{kind} went wrong (fix: do it right)", kind=kind)
    assert isinstance(error, side) and not isinstance(error, (RecoverableError if side is FatalError else FatalError))
    assert (str(error), error.kind) == (f"{kind} went wrong (fix: do it right)", kind)
    error.add_note("a note")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls and again.kind == kind and str(again) == str(error) and again.args == error.args
    assert again.__notes__ == ["a note"]
    assert repr(again) == f"{cls.__name__}({str(error)!r}, kind={kind!r})"


@pytest.mark.parametrize("cls", [cls for cls, _, _ in FAMILIES], ids=lambda c: c.__name__)
def test_an_unknown_or_missing_kind_is_a_bug(cls) -> None:
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: unknown kind 'nope'; the kinds are \["):
        cls("message", kind="nope")
    with pytest.raises(TypeError):
        cls("message")


def test_a_kinded_error_crosses_ray_as_itself() -> None:
    from ray import cloudpickle
    from ray.exceptions import RayTaskError

    cause = ConfigError("grpo.steps=0: must be >= 1", kind="section")
    task_error = cloudpickle.loads(cloudpickle.dumps(RayTaskError("f", "traceback", cause)))
    seen = task_error.as_instanceof_cause()
    assert isinstance(seen, ConfigError) and seen.kind == "section"
    assert type(seen.cause) is ConfigError and str(seen.cause) == "grpo.steps=0: must be >= 1"
    with pytest.raises(ConfigError) as raised:
        raise seen
    assert raised.value.kind == "section"


OWN_CLASS_ERRORS = [
    DataPlaneTimeoutError("get", "staging", 2.5, "detail"),
    MissingKeysError("staging", ["r1/a", "r1/b"], ["tokens"], operation="get"),
    GymServerStartError("policy_model", "the process exited with code 1", Path("/tmp/policy_model.log"), "tail"),
    GymRequirementsError("arith", Path("/tmp/requirements.txt"), ["sympy"]),
    FieldEncodingError("key 'k' field 'ids': list is not stored"),
    RouteShapeUnknownError("no row carries a usable route; pass num_layers and topk to shape the batch"),
    SnapshotMismatchError("the snapshot was taken with grpo.num_prompts_per_step=2, this run has 3"),
    MaskedStepsError("step 7: 3 consecutive steps had no trainable rollout"),
    AllRolloutsFailedError(7, {"run_failed": 2}, ["run_failed: HTTP 400"]),
    AsyncLoopError("the producer was closed"),
]


@pytest.mark.parametrize("cls", [cls for cls, _, _ in FAMILIES if cls.OWN_CLASS], ids=lambda c: c.__name__)
def test_the_family_base_refuses_the_kinds_of_its_own_classes(cls) -> None:
    for kind, owner in cls.OWN_CLASS.items():
        with pytest.raises(ValueError, match=rf"^{cls.__name__}: kind {kind!r} is raised as its own class, {owner}$"):
            cls("message", kind=kind)
        assert [e for e in OWN_CLASS_ERRORS if type(e).__name__ == owner], f"no {owner} in OWN_CLASS_ERRORS"


@pytest.mark.parametrize("error", OWN_CLASS_ERRORS, ids=lambda e: type(e).__name__)
def test_a_kind_with_its_own_class_pickles_with_its_fields(error) -> None:
    family = next(cls for cls, _, _ in FAMILIES if isinstance(error, cls))
    assert family.OWN_CLASS[error.kind] == type(error).__name__
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error) and again.__dict__ == error.__dict__
