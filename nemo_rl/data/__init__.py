"""Records that cross a process boundary, and their pure codecs and rules (the lowest layer).

Modules here import no other `nemo_rl` package (only the standard library, pydantic, numpy /
torch and Gym's record models where a codec wraps them) and do no I/O: no Ray, no
TransferQueue, no files or sockets; the I/O lives in the process packages above. This
`__init__` imports nothing, so a process that needs one module (the gate reads `request_rules`
and `rollout_ids`) does not load torch through another.
Modules: `rollout_ids`, `served`, `rows`, `train` (`TrainBatch`, `TrainPlan`, train-row codec),
`staged_rows` (and the data-plane `Row`), `request_rules`, `errors` (with the policy errors).
"""
