#!/usr/bin/env bash
# Interactive smoke test of token capture: a few GRPO steps of the tiny CPU capture recipe, run
# here (inside a Slurm allocation, as one step on it; otherwise on this machine), ending with a
# verdict read from the run's metrics.jsonl (nemo_rl/token_capture/verdict.py: a headline, then one line
# per further health finding; thresholds in nemo_rl/token_capture/capture_health.py).
#
#   bash examples/launchers/smoke_capture.sh [--steps N] [--log-dir DIR] [-- overrides]
#
# --steps      GRPO steps (default 2)
# --log-dir    where metrics.jsonl and driver.log go (default logs/smoke-capture-<time>)
# NRL_ENV_FILE a site env file sourced first; the capture block below is set after it and wins.
# Exit status: the driver's when it failed, else the verdict's (0 engaged, 1 degraded, unjudged
# or not engaged, 2 unreadable metrics).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
prog=smoke_capture.sh
steps=2
log_dir=""

while (( $# )); do
  case "$1" in
    --steps) (( $# >= 2 )) || { echo "$prog: error: --steps needs a value (fix: --steps 2)" >&2; exit 2; }
             steps=$2; shift 2 ;;
    --log-dir) (( $# >= 2 )) || { echo "$prog: error: --log-dir needs a value (fix: --log-dir logs/smoke)" >&2; exit 2; }
               log_dir=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) echo "$prog: error: unknown argument '$1' (fix: see --help; recipe overrides go after --)" >&2; exit 2 ;;
  esac
done
[[ $steps =~ ^[1-9][0-9]*$ ]] || { echo "$prog: error: --steps='$steps' is not a positive integer (fix: e.g. --steps 2)" >&2; exit 2; }

if [[ -n ${NRL_ENV_FILE:-} ]]; then
  if [[ ! -f $NRL_ENV_FILE ]]; then
    echo "$prog: error: NRL_ENV_FILE='$NRL_ENV_FILE' is not a file (fix: point it at your site env file, or unset it)" >&2
    exit 2
  fi
  # shellcheck source=/dev/null
  source "$NRL_ENV_FILE"
fi

# ---- the capture block (after the env file: it wins) ----
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
export TOKENIZERS_PARALLELISM=false
# The smoke brings up its own private Ray cluster, never one an outer shell points at.
unset RAY_ADDRESS

cd "$repo"
log_dir=${log_dir:-logs/smoke-capture-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$log_dir"
if command -v uv >/dev/null 2>&1; then uv_cmd=(uv); else uv_cmd=(python3 -m uv); fi
# Inside an allocation (salloc), the driver runs as a step on the allocated node.
launch=()
where="this machine"
if [[ -n ${SLURM_JOB_ID:-} ]]; then
  launch=(srun --overlap --nodes=1 --ntasks=1)
  where="a step of Slurm job $SLURM_JOB_ID"
fi

echo "[$prog] $steps step(s) of examples/configs/grpo_capture_tiny_cpu.yaml on $where; log dir $log_dir"
rc=0
"${launch[@]}" "${uv_cmd[@]}" run python examples/run_grpo_single_controller.py \
  --config examples/configs/grpo_capture_tiny_cpu.yaml \
  "grpo.max_num_steps=$steps" "logger.log_dir=$log_dir" "$@" token_capture.enabled=true \
  2>&1 | tee "$log_dir/driver.log" || rc=$?
(( rc == 0 )) || echo "[$prog] the driver exited with $rc (full log: $log_dir/driver.log)"
verdict_rc=0
"${uv_cmd[@]}" run python -m nemo_rl.token_capture.verdict "$log_dir" || verdict_rc=$?
if (( rc != 0 )); then exit "$rc"; fi
exit "$verdict_rc"
