"""The project's error base, and the errors every process shares (docs/design-docs/errors.md).

Contract:
- Every exception class in `nemo_rl` derives from exactly one of `RecoverableError` (this call,
  request, rollout or attempt failed; the run goes on) and `FatalError` (a component or the run
  cannot continue), both `NemoRLError`s; builtin bases stay beside them where callers rely on them.
- A family whose members differed only by name is one class with a validated `kind` (`Kinded`);
  its message is unchanged and it pickles (Ray) with its kind.
- An `ApiError`'s HTTP status follows from its type (`STATUS_OF`); only the transports
  (`models.generation.vllm.http`, `environments.gate.app`) turn it into a response.
- A record that breaks its module's invariants is a `RecordInvariantError` (fatal, a kind per
  record). `PolicyError` (fatal) is the base of every policy failure; `PolicyWorkerError`
  carries strings only, so it crosses Ray intact.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

STATUS_OF: Mapping[str, int] = MappingProxyType(
    {
        # The caller's request is at fault.
        "invalid_request": 400,
        "invalid_json": 400,
        "invalid_capture_admission": 400,
        "capture_not_installed": 400,
        "context_length_exceeded": 400,
        "invalid_rollout_id": 400,
        "control_auth_required": 401,
        "control_auth_invalid": 403,
        "request_too_large": 413,
        # The request conflicts with what was served before.
        "prefix_mismatch": 409,
        "duplicate_model_call_id": 409,
        # Ours: a bug, a bad upstream answer, or a component that is not available (retryable).
        "internal_error": 500,
        "upstream_error": 502,
        "staging_unavailable": 503,
        "generation_timeout": 503,
        "worker_failed": 503,
        "worker_refitting": 503,
        "worker_starting": 503,
        "worker_stopping": 503,
        "upstream_unavailable": 503,
    }
)


class NemoRLError(Exception):
    """The base of every `nemo_rl` exception; never raised itself: raise a named subclass."""


class RecoverableError(NemoRLError):
    """This call, request, rollout or attempt failed; the run goes on.

    What a caller does: retry it, record a placeholder for it, or answer it with a 4xx/5xx; a
    caller with none of those options lets it propagate (it then stops that caller, by name).
    """


class FatalError(NemoRLError):
    """A component or the run cannot continue: a bug, a broken invariant, a misconfiguration,
    or a component that is gone for good.

    What a caller does: nothing but stop loudly, naming it; never turn it into a placeholder or
    a retry.
    """


def _rebuild(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    """An exception of `cls` with `args`, without its `__init__` (its state follows from pickle)."""
    return cls.__new__(cls, *args)


class Kinded:
    """The mixin of a family base whose members differ only by name: one class, a validated `kind`.

    Place it before the side: `class ConfigError(Kinded, FatalError, ValueError)`, with
    `KINDS = typing.get_args(ConfigKind)` and an `__init__(self, message, *, kind: ConfigKind)`
    that calls this one. A kind whose errors carry fields keeps its own subclass, which passes its
    kind itself; `OWN_CLASS` maps such kinds to that subclass's name, and the family base refuses
    them. `str()` is the message alone (unchanged by the consolidation); `repr()` shows the kind. Pickling (Ray's too) rebuilds the instance without calling `__init__` and then
    restores its attributes, so a required keyword-only `kind`, or a subclass with its own
    constructor (e.g. `MissingKeysError`), still round-trips.
    """

    KINDS: ClassVar[tuple[str, ...]] = ()
    OWN_CLASS: ClassVar[Mapping[str, str]] = MappingProxyType({})
    kind: str

    def __init__(self, message: str, *, kind: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"{type(self).__name__}: unknown kind {kind!r}; the kinds are {list(self.KINDS)}")
        owner = self.OWN_CLASS.get(kind)
        if owner is not None and owner not in (c.__name__ for c in type(self).__mro__):
            raise ValueError(f"{type(self).__name__}: kind {kind!r} is raised as its own class, {owner}")
        super().__init__(message)  # type: ignore[call-arg]  # the exception base after the mixin
        self.kind = kind

    def __repr__(self) -> str:
        args = ", ".join(repr(a) for a in self.args)  # type: ignore[attr-defined]
        return f"{type(self).__name__}({args}, kind={self.kind!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args), self.__dict__)  # type: ignore[attr-defined]


def error_name(error: BaseException) -> str:
    """What a detail or a log line calls `error`: its class, and its kind where the class does not say it
    (`PolicyStepError[empty_mask]`, but `DataPlaneTimeoutError`: a class of its own already names its kind)."""
    name = type(error).__name__
    if isinstance(error, Kinded) and error.OWN_CLASS.get(error.kind) != name:
        return f"{name}[{error.kind}]"
    return name


class ApiError(RecoverableError):
    """An answer for the caller: named type (its status follows from it), message, field at fault."""

    def __init__(self, err_type: str, message: str, param: str | None = None) -> None:
        status = STATUS_OF.get(err_type)
        if status is None:
            raise ValueError(f"unknown API error type {err_type!r}: add it to nemo_rl.data.errors.STATUS_OF")
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()


RecordKind = Literal["row", "served_call", "train_plan", "train_batch"]
"""Which record: a training row, placeholder, kept rollout or group (`data.rows`); a served-call
witness (`data.calls.ServedCall`); a `TrainPlan` or a `TrainBatch` (`data.train`)."""


class RecordInvariantError(Kinded, FatalError, ValueError):
    """A record of `nemo_rl.data` violates an invariant its module lists (a bug or a version mismatch)."""

    KINDS = typing.get_args(RecordKind)
    kind: RecordKind

    def __init__(self, message: str, *, kind: RecordKind) -> None:
        super().__init__(message, kind=kind)


# --- the policy failures that cross a process boundary (records below the policy, its actor) ---


class PolicyError(FatalError):
    """Base class of every policy failure."""


class PolicyWorkerError(PolicyError):
    """A call into a remote PolicyWorker failed inside the worker."""
