"""Named data-plane errors, split into weather (recoverable) and bugs (never recoverable).

`DataPlaneError` and its subclasses are WEATHER: a missed deadline (`DataPlaneTimeoutError`), a
transport failure, a dead or absent component, an unreadable key (`MissingKeysError`), a closed
client, and at attach time a config the process cannot honour; its `kind` (`DataPlaneKind`) says
which. Callers may turn them into placeholders or retry (`RecoverableError`). A bug is never a
`DataPlaneError`: it is a `DataPlaneBugError` (`FatalError`, a `ValueError`) whose `kind`
(`DataPlaneBugKind`) says which (bad caller input, an undecodable TQ answer, a stopped stage
writer; a bad row or key is its `FieldEncodingError`), and anything else raised inside a TQ call
propagates unchanged (`client`). Each error names the operation, the partition and what to do;
TQ exceptions are chained.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from types import MappingProxyType
from typing import Literal

from nemo_rl.data.errors import FatalError, Kinded, RecoverableError

# Long key lists are cut in messages; the full list stays on the exception object.
_MAX_KEYS_IN_MESSAGE = 20


def format_keys(keys: Sequence[str]) -> str:
    """A readable, bounded rendering of a key list for error messages."""
    shown = ", ".join(repr(k) for k in keys[:_MAX_KEYS_IN_MESSAGE])
    if len(keys) > _MAX_KEYS_IN_MESSAGE:
        shown += f", ... ({len(keys)} keys in total)"
    return f"[{shown}]"


DataPlaneKind = Literal[
    "transport", "config", "unavailable", "closed", "start", "race", "client_loop", "timeout", "missing_keys"
]
"""Which weather: a TransferQueue call failed in transport (a ZeroMQ error or TQ's own
storage-unit timeout); the process cannot honour the given DataPlaneConfig; the data plane is not
running (or not reachable) where the caller expects it; the client was closed (attach a new
one); the TQ actors could not start (or already run); a concurrent write or clear raced a read
(retry it); the client's event loop is blocked or its thread did not stop; and the two kinds with
their own class and fields: `timeout` (`DataPlaneTimeoutError`), `missing_keys` (`MissingKeysError`)."""

class DataPlaneError(Kinded, RecoverableError, RuntimeError):
    """Base class of every recoverable data-plane failure (weather, never a bug)."""

    KINDS = typing.get_args(DataPlaneKind)
    OWN_CLASS = MappingProxyType({"timeout": "DataPlaneTimeoutError", "missing_keys": "MissingKeysError"})
    kind: DataPlaneKind

    def __init__(self, message: str, *, kind: DataPlaneKind) -> None:
        super().__init__(message, kind=kind)


DataPlaneBugKind = Literal["usage", "decode", "stage_writer", "field_encoding"]
"""Which bug: the caller passed an argument the data plane does not accept (e.g. an empty
partition); TQ answered with data that breaks this package's decode contract (a bug here or in
TQ); the write-behind thread stopped on a bug or was closed, so nothing more can be staged by this
worker; and, with its own class, a row, key or field value the data plane does not store
(`field_encoding`, `FieldEncodingError`, see `fields`)."""


class DataPlaneBugError(Kinded, FatalError, ValueError):
    """Base class of every data-plane bug (never weather): no caller turns it into a placeholder."""

    KINDS = typing.get_args(DataPlaneBugKind)
    OWN_CLASS = MappingProxyType({"field_encoding": "FieldEncodingError"})
    kind: DataPlaneBugKind

    def __init__(self, message: str, *, kind: DataPlaneBugKind) -> None:
        super().__init__(message, kind=kind)


class FieldEncodingError(DataPlaneBugError):
    """A row has a field value the data plane does not store (see the package docstring)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="field_encoding")


class DataPlaneTimeoutError(DataPlaneError):
    """An operation did not finish within its deadline (a dead or stalled TQ component)."""

    def __init__(self, operation: str, partition: str | None, timeout_s: float, detail: str = "") -> None:
        self.operation = operation
        self.partition = partition
        self.timeout_s = timeout_s
        where = f" on partition {partition!r}" if partition is not None else ""
        knob = "data_plane.startup_timeout_s" if operation == "start" else "data_plane.call_timeout_s"
        message = (
            f"data plane {operation}{where} did not finish within its {timeout_s:.3g} s deadline: the "
            f"TransferQueue controller or a storage unit is dead or stalled. Check that the process "
            f"owning the DataPlane is alive; raise {knob} only if the host is merely slow."
        )
        super().__init__(message + (f" ({detail})" if detail else ""), kind="timeout")


class MissingKeysError(DataPlaneError):
    """Requested keys are not readable: absent, cleared, unwritten, or lacking requested fields."""

    def __init__(
        self, partition: str, missing_keys: Sequence[str], fields: Sequence[str] = (), operation: str = "get"
    ) -> None:
        self.partition = partition
        self.missing_keys = list(missing_keys)
        self.fields = list(fields)
        self.operation = operation
        with_fields = f" with fields {self.fields}" if self.fields else ""
        super().__init__(
            f"data plane {operation}: {len(self.missing_keys)} key(s) not readable{with_fields} in partition "
            f"{partition!r}: {format_keys(self.missing_keys)}. They were never written, were cleared, were "
            f"written without these fields, or their write has not completed.",
            kind="missing_keys",
        )
