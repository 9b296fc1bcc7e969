"""The cluster family: this Ray cluster cannot host this run as asked (docs/design-docs/errors.md).

Contract:
- `RayClusterError` (fatal, a `RuntimeError`) is every failure to start, join, await, size or
  stop the cluster, to place the vLLM workers on it (`placement`) or to reach every endpoint
  across its nodes (`bind`); its `kind` (`RayClusterKind`) says which, the message names the
  address or knobs and the fix. Pure: no Ray import, so Ray-free modules (`topology`) raise it.
- The actor-call failures (`actor_call`) and an unshared folder (`shared_fs.SharedDirError`)
  are not in it: callers catch those by name.
"""

from __future__ import annotations

import typing
from typing import Literal

from nemo_rl.data.errors import FatalError, Kinded

RayClusterKind = Literal[
    "argument", "already_initialized", "start", "join", "resources", "nodes", "shutdown", "placement", "bind"
]
"""What failed: an argument the cluster calls refuse (temp dir, address, CPU count, timeout,
`--watch`); Ray is already initialized in this process; a private cluster could not start;
nothing answers at the address, or the join failed; the cluster has too few CPUs or too many
nodes; the awaited nodes did not join (a deadline, or a watched process exited); the handle
would shut down a connection it does not own; the vLLM workers do not fit the alive nodes
(`distributed.placement`); several nodes meet an endpoint bound to loopback (`distributed.topology`)."""


class RayClusterError(Kinded, FatalError, RuntimeError):
    """The Ray cluster could not be started, joined, awaited, stopped or fitted to this run as requested."""

    KINDS = typing.get_args(RayClusterKind)
    kind: RayClusterKind

    def __init__(self, message: str, *, kind: RayClusterKind) -> None:
        super().__init__(message, kind=kind)
