"""Records that cross a process boundary, and their pure codecs and rules (the lowest layer).

Modules here import no other `nemo_rl` package (only the standard library, pydantic, numpy /
torch and Gym's record models where a codec wraps them) and do no I/O: no Ray, no
TransferQueue, no files or sockets; the I/O lives in the process packages above. This
`__init__` imports nothing, and `calls` imports torch only inside its row codec, so the gate
(which reads the request rules) never loads torch.
Modules: `calls` (one model call's request rules, the rollout-id rule, the staged-row codec, the
data-plane `Row`, `ServedCall`), `rows`, `train` (`TrainBatch`, `TrainPlan`, train-row codec),
`errors` (with the policy errors).
"""
