"""Records that cross a process boundary, and their pure codecs and rules (the lowest layer).

Modules here import no other `nemo_rl` package (only the standard library, pydantic, numpy /
torch and Gym's record models where a codec wraps them) and do no I/O: no Ray, no
TransferQueue, no files or sockets; the I/O lives in the process packages above. This
`__init__` imports nothing, so a process that needs one module (the gate reads `request_rules`)
does not load torch through another.
Modules: `request_rules` (chat request rules, the rollout-id rule), `calls` (the staged-row codec,
the data-plane `Row`, `ServedCall`), `rows`, `train` (`TrainBatch`, `TrainPlan`, train-row codec),
`errors` (with the policy errors).
"""
