"""The Ray shell: same answers as the core, named errors, deadlines, a dead actor by name."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from nemo_rl.algorithms.grpo import ClippedPGLossFn
from nemo_rl.data.errors import PolicyWorkerError
from nemo_rl.data.train import TrainBatch
from nemo_rl.data_plane import DataPlane
from nemo_rl.distributed.ray_cluster import RayClusterHandle
from nemo_rl.models.policy import LossConfig, PolicyConfig, PolicyWorkerHandle
from nemo_rl.models.policy.errors import PolicyStepError, PolicyWorkerCallError
from nemo_rl.models.policy.state_io import (
    WEIGHTS_FILE,
    PolicyStateInfo,
    get_logprobs,
    optimizer_fingerprint,
    state_fingerprint,
)
from nemo_rl.models.policy.worker import PolicyCore, PolicyWorker, RayPolicyClient


def test_policy_worker_actor_shell(shared_ray: RayClusterHandle, tiny_model_dir: Path) -> None:
    cfg = PolicyConfig(model_path=str(tiny_model_dir))
    actor = PolicyWorker.remote(cfg)
    impatient = RayPolicyClient(actor, call_timeout_s=1e-3, name="policy")
    with pytest.raises(PolicyWorkerCallError, match=r"policy.state_fingerprint missed") as excinfo:
        impatient.state_fingerprint()  # the actor is still importing torch and loading
    assert excinfo.value.kind == "timeout"

    client = RayPolicyClient(actor, call_timeout_s=120.0, name="policy")
    assert isinstance(client, PolicyWorkerHandle)
    local = PolicyCore(cfg)
    assert client.state_fingerprint() == state_fingerprint(local)
    assert client.get_logprobs([[1, 2, 3]]) == get_logprobs(local, [[1, 2, 3]])
    with pytest.raises(PolicyWorkerError, match=r"get_logprobs failed: PolicyStepError\[token_ids\]: token_ids\[0\]\[1\]=999"):
        client.get_logprobs([[1, 999]])
    # The loss crosses into the actor with the call (pickled) and trains exactly as in-process.
    batch = TrainBatch(token_ids=[[1, 2, 3, 4]], token_mask=[[0, 1, 1, 1]],
                       generation_logprobs=[[0.0] * 4], advantages=[1.0])
    loss_fn = ClippedPGLossFn.from_config(LossConfig())
    assert client.train_step(batch, loss_fn) == local.train_step(batch, loss_fn)
    assert client.state_fingerprint() == state_fingerprint(local)
    with pytest.raises(PolicyStepError, match="ClippedPGLossFn.from_config") as excinfo:
        client.train_step(batch, LossConfig())  # refused in the driver, before any remote call
    assert excinfo.value.kind == "loss_fn"

    # Checkpoints through the actor: what it saves is what the local core would save, and loading
    # it back undoes a later step bit for bit (weights, optimizer and step counter).
    ckpt = Path(tempfile.mkdtemp(prefix="nrlpol_ckpt_"))
    try:
        saved = client.save_state(ckpt / "s")
        assert saved == PolicyStateInfo(1, state_fingerprint(local), optimizer_fingerprint(local))
        client.train_step(batch, loss_fn)
        assert client.optimizer_fingerprint() != saved.optimizer_fingerprint
        assert client.load_state(ckpt / "s") == saved
        assert (client.state_fingerprint(), client.optimizer_fingerprint()) == (saved.policy_fingerprint, saved.optimizer_fingerprint)
        with pytest.raises(PolicyWorkerError, match=r"save_state failed: PolicyStateError\[checkpoint\]: .*already holds"):
            client.save_state(ckpt / "s")
        # The refit export through the actor writes the weights the local core holds (same state).
        out = client.export_weights(ckpt / "refit")
        assert out == ckpt / "refit" and sorted(f.name for f in out.iterdir()) == ["config.json", WEIGHTS_FILE]
        exported, own = load_file(str(out / WEIGHTS_FILE)), local.model.state_dict()
        assert exported.keys() == own.keys() and all(torch.equal(exported[k], own[k]) for k in own)
    finally:
        shutil.rmtree(ckpt)

    client.kill()
    # ray.kill lands asynchronously: a call sent right after it may still be answered.
    deadline = time.monotonic() + 60.0
    while True:
        try:
            client.state_fingerprint()
        except PolicyWorkerCallError as e:
            assert "policy.state_fingerprint: the actor died" in str(e) and e.kind == "died"
            break
        assert time.monotonic() < deadline, "the killed policy actor still answers 60 s after ray.kill"
        time.sleep(0.2)


def test_policy_worker_trains_on_the_rows_it_reads_from_the_train_partition(shared_plane: DataPlane, tiny_model_dir: Path) -> None:
    """Rows written by `store_rows` (as a finalizer actor does) train in the actor exactly as the same
    TrainBatch passed by value; a plan whose digest does not match is refused and trains nothing."""
    import dataclasses

    from nemo_rl.data.rows import KeptRollout, RowOrigin, TrainRow
    from nemo_rl.data.train import TrainPlan
    from nemo_rl.data_plane import DataPlaneConfig, attach_client
    from nemo_rl.data_plane.partitions import TrainRowDigestError, store_rows

    row = TrainRow(
        rollout_id="r-0", group_index=0, sample_index=0, token_ids=(1, 2, 3, 4), token_mask=(0.0, 1.0, 1.0, 1.0),
        generation_logprobs=(0.0, -0.5, -0.25, -1.0), reward=1.0, prompt_len=1, model_call_ids=("c0",),
        weight_versions=(0,), token_in_calls=0, text_root_calls=1, terminal_selection="response_id",
        origin=RowOrigin.CAPTURE, call_spans=((0, 4),),
    )
    batch = TrainBatch(token_ids=[[1, 2, 3, 4]], token_mask=[[0, 1, 1, 1]],
                       generation_logprobs=[[0.0, -0.5, -0.25, -1.0]], advantages=[1.0])
    loss_fn = ClippedPGLossFn.from_config(LossConfig())
    cfg = PolicyConfig(model_path=str(tiny_model_dir))
    data_plane = DataPlaneConfig(call_timeout_s=30.0)
    with attach_client(data_plane) as client:  # the session's plane, with a 30 s deadline
        kept = store_rows(client, "policy_train", KeptRollout("r-0", 0, 0, (row,), 1.0, "response_id"), 30.0, False)
        plan = TrainPlan.of("policy_train", kept.rows, [1.0])
        policy = RayPolicyClient.spawn(cfg, data_plane=data_plane)
        local = PolicyCore(cfg)
        with pytest.raises(TrainRowDigestError, match=r"key 'r-0#0': payload digest [0-9a-f]{64} != 0{64}"):
            policy.train_planned(dataclasses.replace(plan, digests=("0" * 64,)), loss_fn)
        assert policy.state_fingerprint() == state_fingerprint(local)  # nothing trained
        assert policy.train_planned(plan, loss_fn) == local.train_step(batch, loss_fn)
        assert policy.state_fingerprint() == state_fingerprint(local)
        policy.kill()
        bare = RayPolicyClient.spawn(cfg)
        with pytest.raises(PolicyWorkerError, match="train_planned needs the data plane"):
            bare.train_planned(plan, loss_fn)
        bare.kill()
