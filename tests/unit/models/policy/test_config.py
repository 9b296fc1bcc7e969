"""The policy/loss config contracts."""

from __future__ import annotations

import pydantic
import pytest

from nemo_rl.models.policy import LossConfig, PolicyConfig


def test_config_defaults_and_extra_forbid() -> None:
    cfg = PolicyConfig(model_path="m")
    assert (cfg.weight_decay, cfg.max_grad_norm, cfg.train_micro_batch_size) == (0.0, 1.0, 8)
    assert (cfg.lr_warmup_steps, cfg.adam_beta1, cfg.adam_beta2) == (0, 0.9, 0.999)
    with pytest.raises(pydantic.ValidationError, match="lr_warmup_steps"):
        PolicyConfig(model_path="m", lr_warmup_steps=-1)
    with pytest.raises(pydantic.ValidationError, match="adam_beta2"):
        PolicyConfig(model_path="m", adam_beta2=1.0)
    assert LossConfig() == LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.2)
    with pytest.raises(pydantic.ValidationError, match="lr"):
        PolicyConfig(model_path="m", lr=1e-3)
    with pytest.raises(pydantic.ValidationError, match="ratio_clip_min"):
        LossConfig(ratio_clip_min=1.0)
    with pytest.raises(pydantic.ValidationError, match="model_path"):
        PolicyConfig()
