"""Torch policy for GRPO: logprobs, the clipped-loss step, weight export.

Modules: `config` (PolicySettings, PolicyConfig, LossConfig), `errors`, `worker` (the train step: PolicyCore,
plain torch, the LossFn protocol it calls, token logprobs and trainer/sampler agreement metrics;
the Ray actor and its deadline-bounded client), `setup` (device, model and optimizer, built once),
`state_io` (the refit export and probe, checkpoints, fingerprints), `interfaces`
(PolicyWorkerHandle). Only the light modules are re-exported here; import `worker`, `setup` and
`state_io` explicitly (they pull in torch, safetensors and Ray). The loss is an argument of
`train_step`: nothing here imports `nemo_rl.algorithms`. The batch it trains on is
`nemo_rl.data.train.TrainBatch`.
"""

from nemo_rl.models.policy.config import LossConfig, PolicyConfig, PolicySettings
from nemo_rl.models.policy.interfaces import PolicyWorkerHandle

__all__ = ["LossConfig", "PolicyConfig", "PolicySettings", "PolicyWorkerHandle"]
