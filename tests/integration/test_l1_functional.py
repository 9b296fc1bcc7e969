"""Runs the L1 functional test script (flag-off leg, then capture leg, then cross-leg checks).

The script holds the assertions (through `tests/functional/l1_checks.py`); this wrapper lets the
README's test command (and so CI) run it, and checks that both legs left the records the checks
read. The script runs once per session (the `l1_legs` fixture in conftest.py), with 4 prompts per
step; `test_grpo_single_controller.py` asserts the metrics contract on the same legs.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.integration
def test_l1_functional_single_controller(l1_legs):
    lines = l1_legs.stdout.strip().splitlines()
    assert l1_legs.returncode == 0 and lines[-1].startswith("[L1] PASS"), l1_legs.describe()
    assert "[l1] compare: PASS" in lines
    assert "[L1] output in" in lines[0] and "extra overrides: grpo.num_prompts_per_step=4" in lines[0]
    for leg in ("legacy", "capture"):
        assert [json.loads(l)["step"] for l in (l1_legs.out_dir / leg / "metrics.jsonl").read_text().splitlines()] == [1, 2]
        workers = json.loads((l1_legs.out_dir / leg / "run_info.json").read_text())["generation/venv"]["workers"]
        assert len(workers) == 1 and workers[0]["spec_hash"] is not None
        records = [json.loads(l) for l in (l1_legs.out_dir / leg / "first_call_prompt_ids.jsonl").read_text().splitlines()]
        assert {r["step"] for r in records} == {1, 2} and all(r["origin"] in (leg, None) for r in records)
