"""The data plane: TransferQueue (TQ 0.1.11) behind deadlines, completeness checks and named errors.

Only `nemo_rl.data_plane.tq_backend` imports `transfer_queue`, and lazily: importing this
package does not load torch-heavy TQ until a data plane is started or a client attaches.

Usage:
    handle = init_local_ray(num_cpus=2)                  # nemo_rl.distributed.ray_cluster
    plane = start_data_plane(DataPlaneConfig())          # driver, once per Ray job
    client = DataPlaneClient.attach(DataPlaneConfig())   # any process of the job
    client.put("part", "k", {"ids": torch.tensor([1, 2], dtype=torch.int64), "meta": "{}"})
    client.get("part", ["k"], ["ids", "meta"])           # -> [{"ids": tensor, "meta": "{}"}]
    client.close(); plane.shutdown(); handle.shutdown()

Field encoding (see `fields`; the row type is `nemo_rl.data.fields.Row`): token ids are 1-D int64 tensors, masks and logprobs 1-D float64
tensors (exact for every Python float, so logprobs round-trip bit for bit), metadata a `str`
(JSON) or `bytes` non-tensor field. TQ carries tensors as jagged nested tensors, one row per key.

What TQ does not give and this package adds: a deadline on every call (`DataPlaneTimeoutError`),
a split of failures into weather (`DataPlaneError`: deadlines, transport, dead components,
missing keys) and bugs (never a `DataPlaneError`; see `errors`),
reads that fail by name when a key is absent (`MissingKeysError`; TQ silently drops it),
`num_cpus=0` actors (TQ's defaults hang a 2-CPU cluster), per-client close that never kills
the shared controller, and TQ knobs taken from `DataPlaneConfig` only.
"""

from nemo_rl.data_plane.client import DataPlaneClient
from nemo_rl.data_plane.config import DataPlaneConfig
from nemo_rl.data_plane.errors import (
    DataPlaneClosedError,
    DataPlaneConfigError,
    DataPlaneDecodeError,
    DataPlaneError,
    DataPlaneTimeoutError,
    DataPlaneTransportError,
    DataPlaneUnavailableError,
    DataPlaneUsageError,
    FieldEncodingError,
    MissingKeysError,
)
from nemo_rl.data_plane.plane import DataPlane, start_data_plane

__all__ = [
    "DataPlane",
    "DataPlaneClient",
    "DataPlaneClosedError",
    "DataPlaneConfig",
    "DataPlaneConfigError",
    "DataPlaneDecodeError",
    "DataPlaneError",
    "DataPlaneTimeoutError",
    "DataPlaneTransportError",
    "DataPlaneUnavailableError",
    "DataPlaneUsageError",
    "FieldEncodingError",
    "MissingKeysError",
    "start_data_plane",
]
