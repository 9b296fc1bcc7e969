"""`refit_to`: the one refit the step and the resume run (export, load as a version, check, probe)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.algorithms.errors import GRPOError
from nemo_rl.algorithms.refit import Refit, RefitWorkers, max_abs_diff, refit_to


class FakePolicy:
    def __init__(self) -> None:
        self.exported: list[Path] = []

    def export_weights(self, out_dir: str | Path) -> Path:
        self.exported.append(Path(out_dir))
        return Path(out_dir)

    def get_logprobs(self, token_ids: list[list[int]]) -> list[list[float]]:
        return [[-0.5] * len(ids) for ids in token_ids]


class FakeWorkers:
    def __init__(self, reported: list[int] | None = None) -> None:
        self.reported = reported
        self.loaded: list[tuple[Path, int]] = []
        self.probed = 0

    def update_weights(self, weights_dir: Path, version: int) -> list[int]:
        self.loaded.append((weights_dir, version))
        return self.reported if self.reported is not None else [version, version]

    def prompt_logprobs(self, token_ids: list[int]) -> list[list[float]]:
        self.probed += 1
        return [[-0.25] * len(token_ids), [-0.25] * len(token_ids)]


def test_refit_to_loads_the_version_everywhere_and_scores_the_probe(tmp_path: Path) -> None:
    policy, workers = FakePolicy(), FakeWorkers()
    refit = refit_to(policy, workers, tmp_path / "step_3", 3, [5, 6, 2], context="step 3: refit to version 3")
    assert refit == Refit(3, (-0.25, -0.25, -0.25), (-0.5, -0.5, -0.5))
    assert refit.engine_trainer_max_abs_diff == 0.25
    assert policy.exported == [tmp_path / "step_3"] and workers.loaded == [(tmp_path / "step_3", 3)]


def test_a_worker_on_another_version_is_stale_and_nothing_is_probed(tmp_path: Path) -> None:
    workers: RefitWorkers = FakeWorkers(reported=[5, 4])
    with pytest.raises(GRPOError) as caught:
        refit_to(FakePolicy(), workers, tmp_path / "step_2", 5, [1, 2],
                 context="resume from step 2: refit to the saved weight version 5")
    assert caught.value.kind == "stale_weights"
    assert str(caught.value) == (
        "resume from step 2: refit to the saved weight version 5 but the workers report versions [5, 4]")
    assert isinstance(workers, FakeWorkers) and workers.probed == 0


def test_probes_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="need equal, non-zero lengths"):
        Refit(1, (0.0,), ())
    with pytest.raises(ValueError, match="need equal, non-zero lengths"):
        max_abs_diff([1.0], [1.0, 2.0])
    assert max_abs_diff([1.0, -1.0], [0.5, 1.0]) == 2.0
