"""What a GRPO checkpoint holds besides the policy, and how a run finds the one to resume from.

A checkpoint `step_<k>` holds `policy/` (`models.policy.state_io.save_state`) and `trainer_state.json` (a
`TrainerState`: step, served weight version, masked-step streak, driver RNG states, the engine's
probe logprobs, the dataloader position). The dataloader position IS the step (prompt sources
are pure in (seed, step)), so `check_resumable` / `check_prompt_position` refuse a recipe that
would dispatch other prompts. Format 1 (the synchronous loop) holds nothing more; format 2 (the
async loop) adds `prompt_ledger`, the ledger at step k (its groups in flight), which
`ledger_to_resume` restores. `prepare_checkpointing` runs before anything starts: it removes
leftovers, picks the newest complete checkpoint or refuses a folder that already holds some,
and cuts the JSONL logs back to step k.
Invariant: `resume=latest` without a checkpoint is a `CheckpointError` (kind `no_checkpoint`), never a
fresh start. See docs/design-docs/token-capture-reliability.md, "What a GRPO checkpoint holds",
and docs/design-docs/async-grpo.md, "Resume".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nemo_rl.utils.checkpoint import (
    CheckpointError,
    CheckpointingConfig,
    RngStates,
    complete_steps,
    open_checkpoint,
    remove_leftovers,
    scan,
    truncate_jsonl_after,
)
from nemo_rl.experience.prompt_queue import LedgerSnapshot, PromptLedger, SnapshotMismatchError

TRAINER_STATE_FILE = "trainer_state.json"
POLICY_SUBDIR = "policy"
DISPATCHED_PROMPTS_FILE = "dispatched_prompts.jsonl"


class TrainerState(BaseModel):
    """The driver's side of a checkpoint (see the module docstring); format 2 iff `prompt_ledger` is set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1, 2] = 1
    step: int = Field(ge=1, description="The last completed step; the resumed run starts at step + 1.")
    weight_version: int = Field(ge=0, description="The version every engine served when the step ended.")
    masked_streak: int = Field(ge=0)
    seed: int
    num_prompts_per_step: int = Field(ge=1)
    prompt_batch_digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="batch_digest of step `step`'s prompts.")
    policy_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    optimizer_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    policy_steps_taken: int = Field(ge=0)
    engine_probe: tuple[float, ...] = Field(min_length=1, description="The engine's probe logprobs at save time.")
    rng: RngStates
    prompt_ledger: LedgerSnapshot | None = Field(
        None, description="Format 2 (the async loop): the prompt ledger when step `step` was saved; format 1: absent."
    )

    @model_validator(mode="after")
    def _ledger_is_the_steps(self) -> "TrainerState":
        ledger = self.prompt_ledger
        if (self.format == 2) != (ledger is not None):
            raise ValueError(
                f"format={self.format} with prompt_ledger {'set' if ledger is not None else 'absent'}: format 2 (the "
                "async loop) holds the prompt ledger's snapshot, format 1 (the synchronous loop) holds none"
            )
        if ledger is not None and ledger.step != self.step:
            raise ValueError(f"prompt_ledger.step={ledger.step} but step={self.step}: the snapshot must be the "
                             "ledger of the step the checkpoint saved")
        if ledger is not None and ledger.groups_per_step != self.num_prompts_per_step:
            raise ValueError(f"prompt_ledger.groups_per_step={ledger.groups_per_step} but num_prompts_per_step="
                             f"{self.num_prompts_per_step}: the snapshot's positions would name other prompts")
        return self


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from."""

    folder: Path
    state: TrainerState

    @property
    def step(self) -> int:
        return self.state.step


def batch_digest(rows: Sequence[Mapping[str, Any]]) -> str:
    """sha256 of a step's prompt rows (canonical JSON): equal digests, equal prompts in equal order."""
    return hashlib.sha256(json.dumps(list(rows), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def prompt_records(step: int, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One record per dispatched group (`<log_dir>/dispatched_prompts.jsonl`): step, group, row digest."""
    return [{"step": step, "group": g, "digest": batch_digest([row])} for g, row in enumerate(rows)]


def write_trainer_state(folder: Path, state: TrainerState) -> Path:
    path = folder / TRAINER_STATE_FILE
    # Format 1 without the absent field: the synchronous loop's file stays what it was.
    exclude = {"prompt_ledger"} if state.prompt_ledger is None else None
    path.write_text(state.model_dump_json(indent=1, exclude=exclude) + "\n", encoding="utf-8")
    return path  # made durable by commit_checkpoint's fsync of the whole folder


def read_trainer_state(folder: Path) -> TrainerState:
    path = folder / TRAINER_STATE_FILE
    try:
        return TrainerState.model_validate_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder} has no {TRAINER_STATE_FILE} (fix: delete {folder})", kind="corrupt") from e
    except ValidationError as e:
        raise CheckpointError(f"{path} is not a valid TrainerState: {e} (fix: delete {folder})", kind="corrupt") from e


def check_resumable(state: TrainerState, seed: int, num_prompts_per_step: int) -> None:
    """Refuse a recipe whose prompt source would continue with other prompts than the saved run's."""
    for field, saved, now in (("grpo.seed", state.seed, seed),
                              ("grpo.num_prompts_per_step", state.num_prompts_per_step, num_prompts_per_step)):
        if saved != now:
            raise CheckpointError(
                f"{field}={now} but the checkpoint of step {state.step} was written with {field}={saved}; the "
                f"prompt position is a function of (seed, step, batch size), so the resumed run would dispatch "
                f"other prompts (fix: set {field}={saved}, or start a new run without checkpointing.resume)",
                kind="mismatch",
            )


def check_prompt_position(state: TrainerState, rows_of_step: Sequence[Mapping[str, Any]]) -> None:
    """The prompt source must give step k the batch the saved run trained on at step k."""
    digest = batch_digest(rows_of_step)
    if digest != state.prompt_batch_digest:
        raise CheckpointError(
            f"the prompt source gives step {state.step} other prompts (digest {digest[:12]}) than the run that "
            f"wrote the checkpoint (digest {state.prompt_batch_digest[:12]}): the env: section, its dataset or "
            "the grpo sampling keys changed (fix: resume with the recipe the checkpoint was written with)",
            kind="mismatch",
        )


def ledger_to_resume(state: TrainerState | None, groups_per_step: int, max_in_flight: int) -> PromptLedger:
    """The async loop's prompt ledger at its start: fresh (no resume); at the checkpoint's step with
    nothing pending (format 1: the synchronous loop had no group in flight); or format 2's snapshot
    restored, every drawn, unconsumed prompt queued first and each dispatched one under a generation
    the snapshot never issued. A snapshot of another batch size is a `CheckpointError` (`mismatch`)."""
    if state is None:
        return PromptLedger(groups_per_step, max_in_flight)
    snapshot = state.prompt_ledger or LedgerSnapshot(
        groups_per_step=state.num_prompts_per_step, step=state.step, next_draw=state.step * state.num_prompts_per_step,
        pending=())
    try:
        return PromptLedger.restore(snapshot, groups_per_step, max_in_flight)
    except SnapshotMismatchError as e:
        raise CheckpointError(
            f"grpo.num_prompts_per_step={groups_per_step} but the prompt ledger of the checkpoint of step {state.step} "
            f"has groups_per_step={snapshot.groups_per_step}: its positions would name other prompts (fix: set "
            f"grpo.num_prompts_per_step={snapshot.groups_per_step}, or start a new run without checkpointing.resume)",
            kind="mismatch",
        ) from e


def prepare_checkpointing(
    ckpt: CheckpointingConfig, log_files: Sequence[Path], progress: Callable[[str], None] = print
) -> ResumePoint | None:
    """Before anything starts: clean leftovers, choose the checkpoint to resume from (or refuse)."""
    if ckpt.checkpoint_dir is None:  # the config guarantees: neither enabled nor resuming
        return None
    root = Path(ckpt.checkpoint_dir)
    removed = remove_leftovers(root)
    if removed:
        progress(f"[checkpoint] removed half-written checkpoints of a killed run from {root}: {removed}")
    steps = complete_steps(scan(root))
    if ckpt.resume is None:
        if ckpt.enabled and steps:
            raise CheckpointError(
                f"checkpointing.checkpoint_dir={str(root)!r} already holds checkpoints of steps {steps}, and this run "
                "would start from step 1 (fix: add checkpointing.resume=latest to continue that run, or use another "
                "checkpointing.checkpoint_dir)",
                kind="dir_not_empty",
            )
        return None
    if not steps:
        raise CheckpointError(
            f"checkpointing.resume={ckpt.resume!r} but checkpointing.checkpoint_dir={str(root)!r} holds no complete "
            f"checkpoint ({'the folder does not exist' if not root.exists() else 'no step_<k> folder with its marker'}) "
            "(fix: check the folder, or drop checkpointing.resume to start a new run from step 1)",
            kind="no_checkpoint",
        )
    folder = open_checkpoint(root, steps[-1])
    state = read_trainer_state(folder)
    if state.step != steps[-1]:
        raise CheckpointError(
            f"{folder} holds the trainer state of step {state.step} (fix: delete {folder})", kind="corrupt"
        )
    for path in log_files:
        dropped = truncate_jsonl_after(path, state.step)
        if dropped:
            progress(f"[checkpoint] {path}: dropped {dropped} record(s) after step {state.step} (those steps are redone)")
    return ResumePoint(folder=folder, state=state)
