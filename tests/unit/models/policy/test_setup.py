"""The policy's set-up (`nemo_rl.models.policy.setup`): the dtype and device knobs a `PolicyCore` is built with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_rl.models.policy import PolicyConfig
from nemo_rl.models.policy.errors import PolicyLoadError
from nemo_rl.models.policy.state_io import get_logprobs
from nemo_rl.models.policy.worker import PolicyCore

SEQ = [3, 17, 42, 9, 77, 5, 101]


def test_policy_dtype_and_device_knobs(tiny_model_dir: Path) -> None:
    core = PolicyCore(PolicyConfig(model_path=str(tiny_model_dir), dtype="bfloat16"))
    assert {p.dtype for p in core.model.parameters()} == {torch.bfloat16}
    lps = get_logprobs(core, [SEQ])[0]
    assert lps[0] == 0.0 and all(lp <= 0.0 for lp in lps)
    if not torch.cuda.is_available():
        with pytest.raises(PolicyLoadError, match=r"policy.device='cuda'.*fix: .*policy.device=cpu") as excinfo:
            PolicyCore(PolicyConfig(model_path=str(tiny_model_dir), device="cuda"))
        assert excinfo.value.kind == "device"
