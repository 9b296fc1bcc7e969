"""The policy takes its loss as an argument: the LossFn contract, its checks, the dtype check,
and the import rule (nothing under nemo_rl/models/policy imports nemo_rl.algorithms)."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest
import torch

from nemo_rl.algorithms.grpo import ClippedPGLossFn
from nemo_rl.data.train import TrainBatch
from nemo_rl.models.policy import LossConfig, PolicyConfig
from nemo_rl.models.policy.config import dtype_mismatch
from nemo_rl.models.policy.errors import PolicyStepError
from nemo_rl.models.policy.state_io import get_logprobs
from nemo_rl.models.policy.worker import CORE_METRICS, LossFn, PolicyCore, check_loss_fn, check_loss_output

POLICY_DIR = Path(__file__).resolve().parents[4] / "nemo_rl" / "models" / "policy"
SEQ = [3, 17, 42, 9, 77, 5, 101]
MASK = [0, 0, 0, 1, 1, 1, 1]


def _batch(n: int = 1) -> TrainBatch:
    return TrainBatch(
        token_ids=[SEQ] * n, token_mask=[MASK] * n,
        generation_logprobs=[[0.0] * len(SEQ)] * n, advantages=[1.0] * n,
    )


def mean_nll_loss(*, curr_logprobs, prev_logprobs, generation_logprobs, advantages, mask, normalizer):
    """A non-GRPO LossFn (module level: picklable): token-mean negative log-likelihood."""
    share = -torch.where(mask, curr_logprobs, torch.zeros_like(curr_logprobs)).sum() / normalizer
    return share, {"nll": float(share.detach()), "tokens_seen": float(mask.sum()) / normalizer}


def test_policy_package_never_imports_algorithms() -> None:
    offenders = []
    for path in sorted(POLICY_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("nemo_rl.algorithms")]
    assert offenders == []


def test_grpo_loss_is_a_picklable_loss_fn() -> None:
    fn = ClippedPGLossFn.from_config(LossConfig(ratio_clip_min=0.1, ratio_clip_max=0.3))
    assert isinstance(fn, LossFn)
    assert pickle.loads(pickle.dumps(fn)) == fn == ClippedPGLossFn(0.1, 0.3, "captured", 2.0)
    assert check_loss_fn(fn) is fn and check_loss_fn(mean_nll_loss) is mean_nll_loss


def test_a_loss_config_or_a_non_callable_is_refused_with_the_fix() -> None:
    with pytest.raises(PolicyStepError, match=r"LossConfig.*ClippedPGLossFn\.from_config\(cfg\.loss_fn\)") as excinfo:
        check_loss_fn(LossConfig())
    assert excinfo.value.kind == "loss_fn"
    with pytest.raises(PolicyStepError, match="loss_fn=0.2 .* not callable") as excinfo:
        check_loss_fn(0.2)
    assert excinfo.value.kind == "loss_fn"


def test_loss_output_contract() -> None:
    good = (torch.tensor(1.0), {"nll": 1.0})
    assert check_loss_output(good, mean_nll_loss) is not None
    with pytest.raises(PolicyStepError, match=r"returns \(loss, metrics\)") as excinfo:
        check_loss_output(torch.tensor(1.0), mean_nll_loss)
    assert excinfo.value.kind == "loss_fn"
    with pytest.raises(PolicyStepError, match="0-dim tensor") as excinfo:
        check_loss_output((torch.ones(2), {}), mean_nll_loss)
    assert excinfo.value.kind == "loss_fn"
    for name in sorted(CORE_METRICS):
        with pytest.raises(PolicyStepError, match=f"'{name}'.*rename") as excinfo:
            check_loss_output((torch.tensor(1.0), {name: 1.0}), mean_nll_loss)
        assert excinfo.value.kind == "loss_fn"


def test_core_trains_with_any_loss_fn_and_sums_its_shares(tiny_model_dir: Path) -> None:
    # Three samples in micro-batches of 1: each share is 4/12 tokens; the sums are batch values.
    core = PolicyCore(PolicyConfig(model_path=str(tiny_model_dir), train_micro_batch_size=1))
    before = get_logprobs(core, [SEQ])[0]
    metrics = core.train_step(_batch(3), mean_nll_loss)
    assert metrics["tokens_seen"] == pytest.approx(1.0)
    assert metrics["nll"] == pytest.approx(-sum(lp for lp, m in zip(before, MASK) if m) / 4, rel=1e-5)
    assert metrics["num_tokens"] == 12.0 and metrics["grad_norm"] > 0.0
    assert sum(get_logprobs(core, [SEQ])[0]) > sum(before)  # NLL went down
    with pytest.raises(PolicyStepError, match="LossConfig") as excinfo:
        core.train_step(_batch(), LossConfig())
    assert excinfo.value.kind == "loss_fn"


def test_dtype_mismatch_names_both_keys() -> None:
    assert dtype_mismatch("bfloat16", "bfloat16") is None
    msg = dtype_mismatch("float32", "bfloat16")
    assert "policy.dtype='float32'" in msg and "generation.vllm.dtype='bfloat16'" in msg and "fix:" in msg
