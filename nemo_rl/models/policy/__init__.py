"""Torch policy for GRPO: logprobs, the clipped-loss step, weight export.

Modules: `config` (PolicyConfig, LossConfig), `errors`, `loss` (the LossFn protocol the step
calls, token logprobs, trainer/sampler agreement metrics: pure tensor math), `core`
(PolicyCore, plain torch), `interfaces` (PolicyWorkerHandle),
`worker` (the Ray actor and its deadline-bounded client). Only the light modules are
re-exported here; import `core` and `worker` explicitly (they pull in transformers and Ray).
The loss is an argument of `train_step`: nothing here imports `nemo_rl.algorithms`. The batch it
trains on is `nemo_rl.data.train.TrainBatch`.
"""

from nemo_rl.models.policy.config import LossConfig, PolicyConfig
from nemo_rl.models.policy.interfaces import PolicyWorkerHandle
from nemo_rl.models.policy.loss import LossFn

__all__ = ["LossConfig", "LossFn", "PolicyConfig", "PolicyWorkerHandle"]
