"""Records that cross a process boundary, and their pure codecs and rules (the lowest layer).

Contract:
- Modules here import no other `nemo_rl` package: only the standard library, pydantic, numpy /
  torch (the field values rows are encoded to) and Gym's record models where a codec wraps them.
- No Ray, no TransferQueue, no files or sockets: records, validation and encoding only. The I/O
  that moves these records lives in the process packages above (`data_plane`, the workers).
- This package's `__init__` imports nothing, so a process that needs one module (the gate reads
  `request_rules` and `rollout_ids`) does not load torch through another.
- Modules: `rollout_ids` (the one rollout-id rule), `served` (served-call records), `rows`
  (train rows, `RowRef`, kept rollouts, placeholders, groups), `train_rows` (`TrainPlan` and the
  train-row codec), `train_batch` (`TrainBatch`), `policy_errors` (the policy failures that cross
  Ray), `staged_rows` (the staged-row codec), `fields` (data-plane field values), `request_rules`
  (the chat request rules the worker and the gate share), `errors` (the one OpenAI-style error).
"""
