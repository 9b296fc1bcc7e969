"""The field values one data-plane row holds: what the row codecs here produce and read.

A row is a non-empty `dict[str, FieldValue]`; a field value is a 1-D CPU int64 or float64
`torch.Tensor`, a `str` (JSON metadata) or `bytes` (an opaque payload). The data plane
(`nemo_rl.data_plane.fields`) checks these rules on every write; the codecs in this package
(`staged_rows`, `train_rows`) build rows that satisfy them.
"""

from __future__ import annotations

import torch

FieldValue = torch.Tensor | str | bytes
Row = dict[str, FieldValue]
