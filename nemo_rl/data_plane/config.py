"""`DataPlaneConfig`: the one and only home of data-plane (TransferQueue) defaults.

Immutable, rejects unknown keys, strict types; no other data-plane module carries a fallback
value. Deadlines are finite and > 0 (`call_timeout_s` per client call, `startup_timeout_s` for
the actors). The `tq_*` knobs become TQ's import-time environment variables (`tq_backend`).
`bind`: `loopback` (default) keeps every TQ socket on 127.0.0.1 (TQ carries pickled data
without authentication); `node_ip` keeps Ray's node IP for a trusted multi-node cluster.
See docs/design-docs/distributed.md, "Data-plane settings".
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_rl.distributed.topology import Bind as DataPlaneBind


class DataPlaneConfig(BaseModel):
    """Settings for the TransferQueue-backed data plane."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    num_storage_units: int = Field(
        default=1,
        ge=1,
        description="Number of TransferQueue SimpleStorageUnit actors (rows are hashed across them).",
    )
    storage_capacity: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Maximum number of rows held across all storage units; None means unbounded. "
            "Retention (clearing committed keys) is what keeps memory bounded either way."
        ),
    )
    call_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        allow_inf_nan=False,
        description=(
            "Deadline in seconds for one client call (attach, put, get, list, clear). Past it the "
            "call raises DataPlaneTimeoutError instead of hanging on a dead controller."
        ),
    )
    startup_timeout_s: float = Field(
        default=300.0,
        gt=0.0,
        allow_inf_nan=False,
        description=(
            "Deadline in seconds for starting the controller and storage-unit actors. Each imports "
            "torch and TQ's tensordict (which pulls in torch._dynamo): ~17 s of one core each, "
            "over 120 s when a shared 2-core host is 3x oversubscribed. An actor that crashes "
            "fails at once regardless; only a stall waits this long."
        ),
    )
    client_zmq_io_threads: int = Field(
        default=1,
        ge=1,
        description="Native ZeroMQ I/O threads per client (TQ's own default of 8 is sized for big nodes).",
    )
    tq_num_threads: int = Field(
        default=1,
        ge=1,
        description=(
            "TQ_NUM_THREADS: torch threads TQ uses while packing a put/get. TQ logs a warning on "
            "every call when this exceeds the physical core count."
        ),
    )
    tq_storage_send_recv_timeout_s: int = Field(
        default=30,
        ge=1,
        description=(
            "TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT: per-attempt socket timeout to a storage unit "
            "(TQ's default of 200 s times 3 attempts stalls reads ~10 min on a dead unit)."
        ),
    )
    tq_storage_max_attempts: int = Field(
        default=2,
        ge=1,
        description="TQ_SIMPLE_STORAGE_MAX_ATTEMPTS: attempts per storage-unit request, each on a new socket.",
    )
    bind: DataPlaneBind = Field(
        default="loopback",
        description=(
            "Where TransferQueue's sockets listen: `loopback` (127.0.0.1; single machine, the default) or "
            "`node_ip` (Ray's node IP; multi-node clusters on a trusted network only: TQ has no authentication)."
        ),
    )
    tq_log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        default="ERROR",
        description=(
            "TQ_LOGGING_LEVEL for TQ's loggers. TQ logs expected outcomes (e.g. a read of an absent "
            "key, which every first-time stage probes for) at WARNING; failures reach callers as "
            "DataPlaneError exceptions regardless of this level."
        ),
    )
