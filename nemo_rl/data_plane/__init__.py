"""The data plane: TransferQueue (TQ 0.1.11) behind deadlines, completeness checks and named errors.

Only `nemo_rl.data_plane.tq_backend` imports `transfer_queue`, and lazily. What this package
adds to TQ: a deadline on every call, failures split into weather (`DataPlaneError`) and bugs
(`DataPlaneBugError`), reads that fail by name when a key is absent (`MissingKeysError`),
`num_cpus=0` actors, per-client close that never kills the shared controller, and TQ knobs
from `DataPlaneConfig` only. Fields: token ids 1-D int64, masks and logprobs 1-D float64
(bit-exact round trip), metadata `str` or `bytes` (`fields`). Use: `start_data_plane(cfg)` once per Ray job, then
`attach_client(cfg)` in any process.
See docs/design-docs/distributed.md ("The data-plane client", "The TransferQueue backend").
"""

from nemo_rl.data_plane.client import DataPlaneClient
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.data_plane.errors import (
    DataPlaneBugError,
    DataPlaneBugKind,
    DataPlaneError,
    DataPlaneKind,
    DataPlaneTimeoutError,
    FieldEncodingError,
    MissingKeysError,
)
from nemo_rl.data_plane.plane import DataPlane, attach_client, attach_client_async, start_data_plane

__all__ = [
    "DataPlane",
    "DataPlaneClient",
    "DataPlaneConfig",
    "DataPlaneBugError",
    "DataPlaneBugKind",
    "DataPlaneError",
    "DataPlaneKind",
    "DataPlaneTimeoutError",
    "FieldEncodingError",
    "MissingKeysError",
    "attach_client",
    "attach_client_async",
    "start_data_plane",
]
