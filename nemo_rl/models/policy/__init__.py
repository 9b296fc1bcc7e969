"""Torch policy for GRPO: logprobs, the clipped-loss step, weight export.

Modules: `config` (PolicyConfig, LossConfig), `errors`, `core` (the train step: PolicyCore, plain
torch, and the LossFn protocol it calls with token logprobs and trainer/sampler agreement
metrics), `state_io` (the refit export, checkpoints, fingerprints), `interfaces`
(PolicyWorkerHandle), `worker` (the Ray actor and its deadline-bounded client). Only the light
modules are re-exported here; import `core`, `state_io` and `worker` explicitly (they pull in
torch, safetensors and Ray). The loss is an argument of `train_step`: nothing here imports
`nemo_rl.algorithms`. The batch it trains on is `nemo_rl.data.train.TrainBatch`.
"""

from nemo_rl.models.policy.config import LossConfig, PolicyConfig
from nemo_rl.models.policy.interfaces import PolicyWorkerHandle

__all__ = ["LossConfig", "PolicyConfig", "PolicyWorkerHandle"]
