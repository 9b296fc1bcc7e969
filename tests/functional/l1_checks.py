"""The assertions of the L1 functional test (`tests/functional/L1_Functional_Tests_SingleController.sh`).

The script runs the single-controller GRPO recipe twice with one venv cache, first with
`token_capture.enabled=false` (the legacy leg), then with capture on (the capture leg), each
with its own `logger.log_dir` and `logger.dump_first_call_prompt_ids=true`, and calls this module
on what the runs wrote. Every check reads files the run produced; none trusts a counter the check
could have mirrored.

Checks of one leg (`leg`), from `<log_dir>/metrics.jsonl` and `<log_dir>/run_info.json`:
- the steps logged are exactly 1..N;
- every step trained: `train/loss` is present and finite (a step whose rollouts were all
  placeholders logs no loss);
- always-N: `rollouts/dispatched > 0` and `rollouts/dispatched == finalize/kept_rollouts +
  finalize/placeholders`, and `finalize/rows >= finalize/kept_rollouts` (a kept rollout trains
  one row per verified chain, so rows equal kept rollouts only on an unbranched tool loop);
- capture health, both legs: every finding of `nemo_rl.token_capture.capture_health.health_findings`
  (the same judgement and the same `THRESHOLDS` as the smoke script's verdict: every
  placeholder reason against its class's threshold, an unclassified reason included,
  `invalid_row_rate`, the kept generated-token fraction, `token_mult_prob_error`, and on the
  capture leg `token_in_rate` on steps with continuation calls and `unresolved_continuations`);
  a line lacking a judged metric is a failure naming it;
- capture leg: the weight version read from the rows is one version per step (`weight_version/min ==
  weight_version/max`) and advances by exactly one from each step to the next (each trained step
  refits the workers to a new version, and the next step's rows carry it);
- legacy leg: `weight_version/min == weight_version/max == -1` (Gym's token echo carries no
  weight version and its schema has no field for one, so legacy rows cannot carry it without
  changing the flag-off wire, which the flag-off path must not do);
- both legs, what the engine itself measured after each trained step's refit (the evidence that
  the next step's rows were sampled from new weights, and on the legacy leg the only one):
  `refit/engine_logprob_change > 0` (the engine's logprobs of a fixed probe moved) and
  `refit/engine_trainer_max_abs_diff <= MAX_ENGINE_TRAINER_DIFF` (the engine serves what the
  trainer trained);
- venv (`generation/venv` in run_info.json): every worker reports running in the folder named by
  the spec the driver used, whose marker holds that spec's hash, and that hash equals the one this
  module computes now from the committed spec files (`venvs.spec_hash(venvs.vllm_spec(flavor))`).

Checks across the legs (`compare`):
- venv: each leg's workers ran in the venv of its own spec (the per-leg check above: the folder
  name carries the spec hash and the marker inside must equal it, so a venv built for another
  spec is caught: the NeMo-RL bug of caching venvs by actor class name); and when both legs'
  specs hash the same, their workers ran in the same folder (the capture leg reused the flag-off
  leg's build instead of building another copy);
- first-call prompts: for every (step, group, rollout) both legs dumped, the prompt ids of the
  first call of each of its rows (ordered by chain) are identical. A mismatch names the rollout,
  the chain and the first differing position with both ids. A rollout dumped by one leg only is a
  failure; a rollout that is a placeholder in either leg has no row to compare and is listed as
  not comparable; at least one rollout must be compared.

CLI (exit status 0 iff every check passed; one line per check, then a PASS/FAIL line):
    python -m tests.functional.l1_checks leg --log-dir DIR --mode {capture,legacy} --steps N
    python -m tests.functional.l1_checks compare --legacy DIR --capture DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from nemo_rl.token_capture.capture_health import health_findings
from nemo_rl.utils.logger import FIRST_CALL_PROMPTS_FILE, METRICS_FILE, RUN_INFO_FILE, read_jsonl_objects
from nemo_rl.utils.venvs import spec_hash, venv_folder_name, vllm_spec

VENV_KEY = "generation/venv"
NO_WEIGHT_VERSION = -1.0
# Engine vs trainer logprobs of the refit probe; measured ~6e-6 on the CPU engine (fp32).
MAX_ENGINE_TRAINER_DIFF = 1e-3


class L1DataError(ValueError):
    """A file the L1 checks read is missing or malformed (the message names the file and the fix)."""


def _read_json_lines(path: Path) -> list[dict]:
    if not path.is_file():
        raise L1DataError(f"{path} does not exist (fix: did the leg run with this logger.log_dir?)")
    return read_jsonl_objects(path, L1DataError)


def read_metrics(log_dir: Path) -> list[dict]:
    return _read_json_lines(Path(log_dir) / METRICS_FILE)


def read_first_call_prompts(log_dir: Path) -> list[dict]:
    path = Path(log_dir) / FIRST_CALL_PROMPTS_FILE
    if not path.is_file():
        raise L1DataError(f"{path} does not exist (fix: run the leg with logger.dump_first_call_prompt_ids=true)")
    return _read_json_lines(path)


def read_run_info(log_dir: Path) -> dict:
    path = Path(log_dir) / RUN_INFO_FILE
    if not path.is_file():
        raise L1DataError(f"{path} does not exist (fix: the loop writes it at set-up; did set-up finish?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise L1DataError(f"{path} is not JSON: {e}") from e


def _get(line: Mapping[str, Any], key: str, problems: list[str]) -> float | None:
    value = line.get(key)
    if value is None:
        problems.append(f"step {line.get('step')}: metric {key} is missing from {METRICS_FILE}")
    return value


def check_metrics_lines(lines: Sequence[Mapping[str, Any]], *, capture: bool, steps: int) -> list[str]:
    """Problems with one leg's metrics lines (empty when every check passes)."""
    problems: list[str] = []
    logged = [line.get("step") for line in lines]
    if logged != list(range(1, steps + 1)):
        problems.append(f"{METRICS_FILE} logs steps {logged}, expected {list(range(1, steps + 1))}")
    for line in lines:
        step = line.get("step")
        loss = line.get("train/loss")
        if loss is None or not math.isfinite(loss):
            problems.append(f"step {step}: train/loss={loss!r}, expected a finite loss (the step trained nothing? "
                            "see finalize/placeholders/* in that line)")
        dispatched = _get(line, "rollouts/dispatched", problems)
        kept = _get(line, "finalize/kept_rollouts", problems)
        placeholders = _get(line, "finalize/placeholders", problems)
        rows = _get(line, "finalize/rows", problems)
        if None not in (dispatched, kept, placeholders, rows):
            if dispatched <= 0 or dispatched != kept + placeholders:
                problems.append(f"step {step}: rollouts/dispatched={dispatched} but kept_rollouts={kept} + "
                                f"placeholders={placeholders} (always-N broke)")
            if rows < kept:
                problems.append(f"step {step}: finalize/rows={rows} < kept_rollouts={kept}")
        change = _get(line, "refit/engine_logprob_change", problems)
        if change is not None and not change > 0:
            problems.append(f"step {step}: refit/engine_logprob_change={change}, expected > 0 (the engine's logprobs "
                            "did not move: the next step samples from the same weights)")
        diff = _get(line, "refit/engine_trainer_max_abs_diff", problems)
        if diff is not None and not diff <= MAX_ENGINE_TRAINER_DIFF:
            problems.append(f"step {step}: refit/engine_trainer_max_abs_diff={diff} > {MAX_ENGINE_TRAINER_DIFF} (the "
                            "engine does not serve the weights the trainer trained)")
        low, high = _get(line, "weight_version/min", problems), _get(line, "weight_version/max", problems)
        if capture:
            if None not in (low, high) and (low != high or low < 0):
                problems.append(f"step {step}: rows carry weight versions {low}..{high}, expected one version >= 0")
        elif None not in (low, high) and (low, high) != (NO_WEIGHT_VERSION, NO_WEIGHT_VERSION):
            problems.append(f"step {step}: legacy rows carry weight versions {low}..{high}, expected none (-1)")
    problems += [f"capture health: {finding.describe()}" for finding in health_findings(lines, capture=capture)]
    if capture:
        versions = [(line.get("step"), line.get("weight_version/min")) for line in lines]
        for (step_a, a), (step_b, b) in zip(versions, versions[1:]):
            if a is not None and b is not None and b != a + 1:
                problems.append(f"weight version read from the rows went {a} (step {step_a}) -> {b} (step {step_b}), "
                                "expected +1: the refit after a trained step did not reach the next step's rows")
    return problems


def check_venv_record(info: Mapping[str, Any], *, expected_hash: str | None = None) -> list[str]:
    """Problems with one leg's `generation/venv` record; `expected_hash` defaults to the spec's hash now."""
    record = info.get(VENV_KEY)
    if not isinstance(record, dict):
        return [f"{RUN_INFO_FILE} has no {VENV_KEY!r} record"]
    problems: list[str] = []
    name, digest, folder = record.get("spec"), record.get("spec_hash"), record.get("folder")
    if expected_hash is None:
        flavor = record.get("flavor")
        try:
            expected_hash = spec_hash(vllm_spec(flavor))
        except ValueError as e:
            return [f"{VENV_KEY}.flavor={flavor!r}: {e}"]
    if digest != expected_hash:
        problems.append(f"{VENV_KEY}.spec_hash={digest!r}, but the committed spec hashes to {expected_hash!r}")
    if not isinstance(name, str) or folder != venv_folder_name(name, expected_hash):
        problems.append(f"{VENV_KEY}.folder={folder!r}, expected {venv_folder_name(str(name), expected_hash)!r}")
    workers = record.get("workers")
    if not isinstance(workers, list) or not workers:
        return problems + [f"{VENV_KEY}.workers={workers!r}: no worker reported its venv"]
    for index, worker in enumerate(workers):
        if not isinstance(worker, dict):
            problems.append(f"{VENV_KEY}.workers[{index}]={worker!r} is not an object")
            continue
        prefix = str(worker.get("prefix"))
        if worker.get("folder") != folder or Path(prefix).name != folder:
            problems.append(f"worker {index} ran in {prefix!r}, expected the folder {folder!r}")
        if worker.get("spec_hash") != expected_hash:
            problems.append(f"worker {index} ran in a venv whose marker names {worker.get('spec_hash')!r}, "
                            f"expected {expected_hash!r}")
    return problems


def compare_venv_records(legacy: Mapping[str, Any], capture: Mapping[str, Any]) -> list[str]:
    """Each leg ran its own spec's venv; equal specs share one folder, different specs never do."""
    problems = [f"legacy leg: {p}" for p in check_venv_record(legacy)]
    problems += [f"capture leg: {p}" for p in check_venv_record(capture)]
    if problems:
        return problems
    a, b = legacy[VENV_KEY], capture[VENV_KEY]
    prefixes_a = {w["prefix"] for w in a["workers"]}
    prefixes_b = {w["prefix"] for w in b["workers"]}
    if a["spec_hash"] == b["spec_hash"] and prefixes_a != prefixes_b:
        problems.append(f"both legs have spec {a['spec_hash'][:16]} but ran in {sorted(prefixes_a)} vs "
                        f"{sorted(prefixes_b)}: the capture leg did not reuse the flag-off leg's venv")
    return problems


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where `a` and `b` differ (a length difference counts), or None if equal."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def _by_rollout(records: Sequence[Mapping[str, Any]], leg: str) -> dict[tuple, dict]:
    """(step, group, rollout) -> {"placeholder": reason | None, "chains": {chain: prompt_ids}}."""
    out: dict[tuple, dict] = {}
    for record in records:
        try:
            key = (int(record["step"]), int(record["group"]), int(record["rollout"]))
            placeholder = record["placeholder"]
            chain, prompt_ids = record["chain"], record["prompt_ids"]
            if placeholder is None and (type(chain) is not int or not isinstance(prompt_ids, list)):
                raise TypeError("a row record needs an int chain and a prompt_ids list")
        except (KeyError, TypeError, ValueError) as e:
            raise L1DataError(
                f"{leg} leg: {FIRST_CALL_PROMPTS_FILE} record {str(record)[:200]} is malformed ({e!r}); expected the "
                "fields of nemo_rl.token_capture.metrics.first_call_prompt_records"
            ) from e
        slot = out.setdefault(key, {"placeholder": None, "chains": {}})
        if placeholder is not None:
            slot["placeholder"] = placeholder
        else:
            slot["chains"][chain] = prompt_ids
    return out


def _name(key: tuple) -> str:
    return f"step {key[0]} group {key[1]} rollout {key[2]}"


def compare_first_call_prompts(
    legacy: Sequence[Mapping[str, Any]], capture: Sequence[Mapping[str, Any]]
) -> tuple[list[str], list[str], int]:
    """(problems, not-comparable notes, rollouts compared) over the two legs' first-call prompt dumps."""
    a, b = _by_rollout(legacy, "legacy"), _by_rollout(capture, "capture")
    problems: list[str] = []
    notes: list[str] = []
    compared = 0
    for key in sorted(set(a) | set(b)):
        if key not in b or key not in a:
            problems.append(f"{_name(key)}: dumped by the {'legacy' if key in a else 'capture'} leg only")
            continue
        x, y = a[key], b[key]
        if x["placeholder"] is not None or y["placeholder"] is not None:
            notes.append(f"{_name(key)}: not comparable (legacy: {x['placeholder'] or 'row'}, "
                         f"capture: {y['placeholder'] or 'row'})")
            continue
        compared += 1
        if sorted(x["chains"]) != sorted(y["chains"]):
            problems.append(f"{_name(key)}: legacy rows are chains {sorted(x['chains'])}, capture rows chains "
                            f"{sorted(y['chains'])}")
            continue
        for chain in sorted(x["chains"]):
            ids_a, ids_b = x["chains"][chain], y["chains"][chain]
            position = first_difference(ids_a, ids_b)
            if position is not None:
                got_a = ids_a[position] if position < len(ids_a) else "<end>"
                got_b = ids_b[position] if position < len(ids_b) else "<end>"
                problems.append(
                    f"{_name(key)} chain {chain}: first-call prompt ids differ at position {position}: "
                    f"legacy {got_a} vs capture {got_b} (lengths {len(ids_a)} vs {len(ids_b)}; "
                    f"context legacy {ids_a[max(0, position - 3):position + 4]} capture {ids_b[max(0, position - 3):position + 4]})"
                )
    if compared == 0:
        problems.append("no rollout had rows in both legs: nothing was compared")
    return problems, notes, compared


def _report(title: str, problems: Sequence[str], out: TextIO | None) -> bool:
    out = out or sys.stdout  # resolved per call, so a redirected sys.stdout is honoured
    for problem in problems:
        print(f"[l1]   FAIL {title}: {problem}", file=out)
    print(f"[l1] {'ok  ' if not problems else 'FAIL'} {title}", file=out)
    return not problems


def run_leg(log_dir: Path, mode: str, steps: int, out: TextIO | None = None) -> bool:
    ok = _report(f"{mode} leg metrics ({log_dir / METRICS_FILE})",
                 check_metrics_lines(read_metrics(log_dir), capture=mode == "capture", steps=steps), out)
    info = read_run_info(log_dir)
    record = info.get(VENV_KEY)
    folder = record.get("folder") if isinstance(record, dict) else None
    ok &= _report(f"{mode} leg venv ({folder})", check_venv_record(info), out)
    read_first_call_prompts(log_dir)  # present and well formed; compared by `compare`
    return ok


def run_compare(legacy_dir: Path, capture_dir: Path, out: TextIO | None = None) -> bool:
    ok = _report("venv: each leg ran its own spec's venv", compare_venv_records(read_run_info(legacy_dir),
                                                                            read_run_info(capture_dir)), out)
    problems, notes, compared = compare_first_call_prompts(read_first_call_prompts(legacy_dir),
                                                           read_first_call_prompts(capture_dir))
    for note in notes:
        print(f"[l1]   note: {note}", file=out or sys.stdout)
    ok &= _report(f"first-call prompt ids identical between legs ({compared} rollouts compared)", problems, out)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Checks of the L1 functional test.")
    sub = parser.add_subparsers(dest="command", required=True)
    leg = sub.add_parser("leg", help="check one leg's log dir")
    leg.add_argument("--log-dir", type=Path, required=True)
    leg.add_argument("--mode", choices=("capture", "legacy"), required=True)
    leg.add_argument("--steps", type=int, required=True)
    cmp_ = sub.add_parser("compare", help="check the two legs against each other")
    cmp_.add_argument("--legacy", type=Path, required=True)
    cmp_.add_argument("--capture", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        ok = run_leg(args.log_dir, args.mode, args.steps) if args.command == "leg" \
            else run_compare(args.legacy, args.capture)
    except L1DataError as e:
        print(f"[l1] FAIL {e}")
        ok = False
    title = f"leg {args.mode}" if args.command == "leg" else "compare"
    print(f"[l1] {title}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
