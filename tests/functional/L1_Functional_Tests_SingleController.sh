#!/usr/bin/env bash
# L1 functional test of the single-controller GRPO loop on the tiny CPU recipe: the flag-off
# (legacy) leg first, then the capture leg, 2 steps each, one venv cache shared by both legs,
# each leg with its own logger.log_dir. What is asserted, and why: the docstring of
# tests/functional/l1_checks.py, which this script calls on each leg and on the pair.
#
#   bash tests/functional/L1_Functional_Tests_SingleController.sh
#
# Environment:
#   L1_OUT_DIR    where the legs write (<leg>/ log dirs, <leg>.log); default: a fresh temp folder
#   NRL_VENVS_DIR the shared venv cache (default: .venvs in the repository)
#   L1_OVERRIDES  extra recipe overrides for both legs, space-separated (default: none); the
#                 integration suite passes grpo.num_prompts_per_step=4 and reads the legs' records
# Prints progress and a final "[L1] PASS" or "[L1] FAIL" line; exits non-zero on any failure.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
STEPS=2
RECIPE=examples/configs/grpo_capture_tiny_cpu.yaml
OUT="${L1_OUT_DIR:-$(mktemp -d -t nrl-l1-XXXXXX)}"
mkdir -p "$OUT"
# Inside `uv run` (the pytest wrapper) UV names uv's own binary; otherwise use the README's form.
if [[ -n "${UV:-}" ]]; then UV_CMD=("$UV"); else UV_CMD=(python3 -m uv); fi
PY=("${UV_CMD[@]}" run python)

read -r -a EXTRA <<<"${L1_OVERRIDES:-}"
failures=()
start=$SECONDS
echo "[L1] output in $OUT; venv cache ${NRL_VENVS_DIR:-$REPO/.venvs}; extra overrides: ${EXTRA[*]:-none}"

run_leg() {  # <name> <token_capture.enabled>
  local name=$1 capture=$2 t0=$SECONDS status=0
  echo "[L1] leg $name (token_capture.enabled=$capture): $STEPS steps, log in $OUT/$name.log"
  "${PY[@]}" examples/run_grpo_single_controller.py --config "$RECIPE" \
    "token_capture.enabled=$capture" "grpo.max_num_steps=$STEPS" \
    "logger.log_dir=$OUT/$name" "logger.dump_first_call_prompt_ids=true" ${EXTRA[@]+"${EXTRA[@]}"} \
    >"$OUT/$name.log" 2>&1 || status=$?
  if ((status != 0)); then
    echo "[L1] leg $name exited with status $status after $((SECONDS - t0))s; last lines of its log:"
    tail -n 40 "$OUT/$name.log" | sed 's/^/[L1]   | /'
    failures+=("leg $name did not finish")
    return 1
  fi
  grep -E '^(step [0-9]+ \||\[venv\])' "$OUT/$name.log" | sed 's/^/[L1]   /' || true  # progress only
  echo "[L1] leg $name finished in $((SECONDS - t0))s"
}

check() {  # <what> <l1_checks arguments...>
  local what=$1
  shift
  "${PY[@]}" -m tests.functional.l1_checks "$@" || failures+=("$what")
}

# The flag-off leg runs first: with a fresh cache it builds the vLLM venv, and the capture leg
# must then run in the venv of its own spec (checked from what its workers report).
if run_leg legacy false; then
  check "legacy leg checks" leg --log-dir "$OUT/legacy" --mode legacy --steps "$STEPS"
fi
if run_leg capture true; then
  check "capture leg checks" leg --log-dir "$OUT/capture" --mode capture --steps "$STEPS"
fi
if [[ -f "$OUT/legacy/metrics.jsonl" && -f "$OUT/capture/metrics.jsonl" ]]; then
  check "cross-leg checks" compare --legacy "$OUT/legacy" --capture "$OUT/capture"
fi

if ((${#failures[@]})); then
  echo "[L1] FAIL after $((SECONDS - start))s: $(IFS=';'; echo "${failures[*]}")"
  exit 1
fi
echo "[L1] PASS after $((SECONDS - start))s"
