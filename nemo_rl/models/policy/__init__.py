"""Torch policy for GRPO: logprobs, the clipped-loss step, weight export.

Modules: `config` (PolicyConfig, LossConfig), `batch` (TrainBatch), `errors`, `logprobs` (pure
tensor helpers), `core` (PolicyCore, plain torch), `interfaces` (PolicyWorkerHandle),
`worker` (the Ray actor and its deadline-bounded client). Only the light modules are
re-exported here; import `core` and `worker` explicitly (they pull in transformers and Ray).
"""

from nemo_rl.models.policy.batch import TrainBatch
from nemo_rl.models.policy.config import LossConfig, PolicyConfig
from nemo_rl.models.policy.interfaces import PolicyWorkerHandle

__all__ = ["LossConfig", "PolicyConfig", "PolicyWorkerHandle", "TrainBatch"]
