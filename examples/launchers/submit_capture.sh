#!/usr/bin/env bash
# Submit the capture recipe to Slurm through ultra_launch.sh (a batch job; returns at submission).
#
#   NRL_ENV_FILE=site.env bash examples/launchers/submit_capture.sh [ultra_launch options] [-- overrides]
#
# Options (--nodes, --partition, --account, --config, --dry-run, ...) and knobs (WALLTIME,
# SLURM_QOS, NRL_*) are ultra_launch.sh's: see `bash ultra_launch.sh --help`. The recipe defaults
# to examples/configs/grpo_capture_tiny_cpu.yaml.
#
# Order matters: the env file (site settings: partition, QOS, caches, ...) is sourced first; the
# block capture needs is set after it, so nothing the env file sets can turn capture off or
# break it; token_capture.enabled=true comes after the caller's overrides, so it wins too.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

if [[ -n ${NRL_ENV_FILE:-} ]]; then
  if [[ ! -f $NRL_ENV_FILE ]]; then
    echo "submit_capture.sh: error: NRL_ENV_FILE='$NRL_ENV_FILE' is not a file (fix: point it at your site env file, or unset it)" >&2
    exit 2
  fi
  # shellcheck source=/dev/null
  source "$NRL_ENV_FILE"
fi

# ---- the capture block (after the env file: it wins) ----
# Ray must not re-run workers through `uv run` (see nemo_rl/__init__.py).
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0
# The tokenizers' thread pool must be off in processes that fork (Gym servers, Ray workers).
export TOKENIZERS_PARALLELISM=false
capture_overrides=(token_capture.enabled=true)

options=()
overrides=()
while (( $# )); do
  if [[ $1 == -- ]]; then
    shift
    overrides=("$@")
    break
  fi
  options+=("$1")
  shift
done

exec bash "$repo/ultra_launch.sh" --config examples/configs/grpo_capture_tiny_cpu.yaml "${options[@]}" \
  -- "${overrides[@]}" "${capture_overrides[@]}"
