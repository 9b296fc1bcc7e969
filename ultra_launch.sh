#!/usr/bin/env bash
# ultra_launch.sh: run a NeMo-RL driver on Slurm, on a Ray cluster that spans the allocation.
#
# Contract:
# - Every knob is validated before anything is written or submitted; a bad or missing one exits 2
#   with a message naming the knob, its value and the fix.
# - The sbatch script is generated whole: the knobs are baked in as shell-quoted assignments, so
#   the job sees exactly what `--dry-run` prints. `--dry-run` prints it to stdout and submits
#   nothing; otherwise it is written under NRL_LAUNCH_LOG_DIR and submitted with sbatch.
# - In the job: one `ray start --head --block` on the first node and one `ray start --block` per
#   other node (each its own `srun --overlap` step), a bounded wait until every node is alive,
#   then the driver (`python $NRL_ENTRYPOINT --config $CONFIG <overrides>`) with RAY_ADDRESS set,
#   so it joins that cluster instead of starting a private one.
# - On exit the job stops only its own Ray processes: SIGTERM to the srun of each node, whose
#   `ray start --block` then stops what it started. Never a host-wide `ray stop`.
# - The cluster uses Ray's token auth with a per-job token (mode 600) in the job's log dir.
set -euo pipefail

PROG=ultra_launch.sh
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Ray's Unix-socket paths live under its temp dir; see MAX_TEMP_DIR_CHARS in
# nemo_rl/distributed/ray_cluster.py (the AF_UNIX 107-byte limit).
MAX_RAY_TMPDIR_CHARS=36
# Variables forwarded into the job when set at submission (baked as export lines).
FORWARDED_ENV=(TOKENIZERS_PARALLELISM NRL_FORCE_REBUILD_VENVS_LIST NRL_VENVS_DIR NRL_CACHE_DIR
               PIP_FIND_LINKS UV_FIND_LINKS HF_HOME)

usage() {
  cat <<'EOF'
Usage: bash ultra_launch.sh [options] [-- recipe overrides...]

Submit a Slurm batch job that starts a Ray cluster over its nodes (head on the first, workers on
the others), waits until every node has joined, then runs the driver against that cluster:
    python $NRL_ENTRYPOINT --config <recipe> <overrides...>

Options:
  --nodes N             nodes to allocate (default 1); N > 1 needs the overrides
                        generation.vllm.bind=node_ip data_plane.bind=node_ip and a shared
                        grpo.refit_dir (docs/guides/launching.md, "Multi-node")
  --partition NAME      Slurm partition (default: none, the cluster's default partition)
  --account NAME        Slurm account (default: none)
  --gpus-per-node G     GPUs per node (default: none, no --gpus-per-node line)
  --container IMAGE     run every step in this container image (pyxis --container-image);
                        the repo and the log dir are mounted at their own paths
  --job-name NAME       Slurm job name (default nrl-grpo)
  --config RECIPE       YAML recipe for the driver (default
                        examples/configs/grpo_capture_tiny_cpu.yaml)
  --dry-run             print the sbatch script to stdout and submit nothing
  -h, --help            this help
  -- OVERRIDES...       Hydra-style recipe overrides, passed to the driver verbatim

Environment knobs:
  WALLTIME                     time limit, HH:MM:SS or D-HH:MM:SS (default 01:00:00)
  SLURM_QOS                    QOS; empty or unset: no --qos line at all (default empty)
  NRL_ENTRYPOINT               driver script, relative to the repo root or absolute
                               (default examples/run_grpo_single_controller.py)
  NRL_DRIVER_PYTHONPATH        prepended to the driver's PYTHONPATH (default empty; the repo
                               root is always on it)
  NRL_DRIVER_PIP_INSTALL       requirement specs `uv pip install`ed into the project venv once,
                               before Ray starts (default empty: nothing)
  NRL_DRIVER_UV_RUN_FLAGS      flags for every `uv run` of the job (Ray nodes and driver share
                               one environment), e.g. "--locked --no-sync" (default empty)
  NRL_FORCE_REBUILD_VENVS_LIST passed through: flavored venvs to rebuild (see
                               nemo_rl/utils/venvs.py)
  UV_CACHE_DIR                 uv cache of the job; when unset, a per-job cache in the job's
                               log dir (removed when the job ends)
  NRL_LAUNCH_LOG_DIR           where scripts, job output and Ray logs go (default
                               <repo>/logs/slurm); must be visible from every node
  NRL_CONTAINER_MOUNTS         extra pyxis mounts with --container, e.g. /data:/data
  NRL_RAY_HEAD_IP              address the nodes and the driver use for the head (default: the
                               head node's `hostname --ip-address`); loopback needs --nodes 1
  NRL_RAY_TMPDIR               Ray temp dir on every node, absolute, at most 36 chars
                               (default /tmp/nrl-j<job id>)
  NRL_RAY_WAIT_TIMEOUT_S       seconds to wait for every node to join (default 600)
Forwarded into the job when set: TOKENIZERS_PARALLELISM NRL_VENVS_DIR NRL_CACHE_DIR
PIP_FIND_LINKS UV_FIND_LINKS HF_HOME. RAY_ENABLE_UV_RUN_RUNTIME_ENV is always 0 in the job.

Example:
  SLURM_QOS=normal WALLTIME=02:00:00 bash ultra_launch.sh --nodes 1 --partition batch \
      --config examples/configs/grpo_capture_tiny_cpu.yaml -- grpo.max_num_steps=5
EOF
}

die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 2
}

nodes=1
partition=""
account=""
gpus_per_node=""
container=""
job_name="nrl-grpo"
config="examples/configs/grpo_capture_tiny_cpu.yaml"
dry_run=0
overrides=()

need_value() {  # need_value FLAG NUMBER_OF_REMAINING_ARGS
  (( $2 >= 2 )) || die "$1 needs a value (fix: $1 VALUE; see --help)"
}

while (( $# )); do
  case "$1" in
    --nodes) need_value "$1" $#; nodes=$2; shift 2 ;;
    --nodes=*) nodes=${1#*=}; shift ;;
    --partition) need_value "$1" $#; partition=$2; shift 2 ;;
    --partition=*) partition=${1#*=}; shift ;;
    --account) need_value "$1" $#; account=$2; shift 2 ;;
    --account=*) account=${1#*=}; shift ;;
    --gpus-per-node) need_value "$1" $#; gpus_per_node=$2; shift 2 ;;
    --gpus-per-node=*) gpus_per_node=${1#*=}; shift ;;
    --container) need_value "$1" $#; container=$2; shift 2 ;;
    --container=*) container=${1#*=}; shift ;;
    --job-name) need_value "$1" $#; job_name=$2; shift 2 ;;
    --job-name=*) job_name=${1#*=}; shift ;;
    --config) need_value "$1" $#; config=$2; shift 2 ;;
    --config=*) config=${1#*=}; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; overrides=("$@"); break ;;
    *) die "unknown argument '$1' (fix: see --help; recipe overrides go after --, e.g. -- grpo.max_num_steps=2)" ;;
  esac
done

walltime=${WALLTIME:-01:00:00}
qos=${SLURM_QOS:-}
entrypoint=${NRL_ENTRYPOINT:-examples/run_grpo_single_controller.py}
driver_pythonpath=${NRL_DRIVER_PYTHONPATH:-}
log_root=${NRL_LAUNCH_LOG_DIR:-$REPO_ROOT/logs/slurm}
container_mounts=${NRL_CONTAINER_MOUNTS:-}
ray_head_ip=${NRL_RAY_HEAD_IP:-}
ray_tmpdir=${NRL_RAY_TMPDIR:-}
ray_wait_timeout_s=${NRL_RAY_WAIT_TIMEOUT_S:-600}
uv_cache_dir=${UV_CACHE_DIR:-}
# Word lists: split on whitespace here, without glob expansion (read -a does not glob).
read -r -a driver_pip_install <<< "${NRL_DRIVER_PIP_INSTALL:-}"
read -r -a uv_run_flags <<< "${NRL_DRIVER_UV_RUN_FLAGS:-}"

# ---- validation: everything before anything is written or submitted ----

[[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes='$nodes' is not a positive integer (fix: e.g. --nodes 2)"
[[ $walltime =~ ^([0-9]+-)?[0-9]{1,2}:[0-5][0-9]:[0-5][0-9]$ ]] ||
  die "WALLTIME='$walltime' is not a Slurm time limit (fix: WALLTIME=HH:MM:SS or D-HH:MM:SS, e.g. WALLTIME=04:00:00)"
[[ -z $gpus_per_node || $gpus_per_node =~ ^[0-9]+$ ]] ||
  die "--gpus-per-node='$gpus_per_node' is not a non-negative integer (fix: e.g. --gpus-per-node 8)"
[[ $ray_wait_timeout_s =~ ^[1-9][0-9]*$ ]] ||
  die "NRL_RAY_WAIT_TIMEOUT_S='$ray_wait_timeout_s' is not a positive integer of seconds (fix: e.g. NRL_RAY_WAIT_TIMEOUT_S=600)"

check_slurm_name() {  # check_slurm_name KNOB VALUE: #SBATCH lines are not shell-parsed; keep them one token
  [[ -z $2 || $2 =~ ^[A-Za-z0-9._,:+-]+$ ]] ||
    die "$1='$2' holds characters a Slurm name cannot (fix: letters, digits and ._,:+- only)"
}
check_slurm_name --partition "$partition"
check_slurm_name --account "$account"
check_slurm_name SLURM_QOS "$qos"
check_slurm_name --job-name "$job_name"
[[ -n $job_name ]] || die "--job-name is empty (fix: e.g. --job-name nrl-grpo)"

[[ $REPO_ROOT != *[[:space:]]* ]] || die "the repo path '$REPO_ROOT' contains whitespace, which #SBATCH lines cannot hold (fix: clone it to a path without spaces)"
[[ $log_root = /* ]] || log_root="$PWD/$log_root"
[[ $log_root != *[[:space:]]* ]] ||
  die "NRL_LAUNCH_LOG_DIR='$log_root' contains whitespace, which #SBATCH --output cannot hold (fix: a path without spaces)"

# A path knob is found relative to the current directory first, then to the repo root. It is
# baked relative to the repo root when it lies inside it (the job runs there), else absolute.
resolve_path() {  # resolve_path KNOB VALUE EXAMPLE -> prints the path to bake
  local knob=$1 value=$2 example=$3 found=""
  [[ -n $value ]] || die "$knob is empty (fix: e.g. $knob=$example)"
  if [[ $value = /* ]]; then
    [[ -f $value ]] && found=$value
  elif [[ -f $PWD/$value ]]; then
    found=$PWD/$value
  elif [[ -f $REPO_ROOT/$value ]]; then
    found=$REPO_ROOT/$value
  fi
  [[ -n $found ]] || die "$knob='$value' is not a file (looked in $PWD and $REPO_ROOT; fix: e.g. $knob=$example)"
  found="$(cd "$(dirname "$found")" && pwd)/$(basename "$found")"
  if [[ $found = "$REPO_ROOT"/* ]]; then
    printf '%s\n' "${found#"$REPO_ROOT"/}"
  else
    printf '%s\n' "$found"
  fi
}
entrypoint=$(resolve_path NRL_ENTRYPOINT "$entrypoint" examples/run_grpo_single_controller.py)
config=$(resolve_path --config "$config" examples/configs/grpo_capture_tiny_cpu.yaml)

if [[ -n $ray_tmpdir ]]; then
  [[ $ray_tmpdir = /* ]] || die "NRL_RAY_TMPDIR='$ray_tmpdir' is not absolute (fix: e.g. NRL_RAY_TMPDIR=/tmp/nrl-ray)"
  (( ${#ray_tmpdir} <= MAX_RAY_TMPDIR_CHARS )) ||
    die "NRL_RAY_TMPDIR='$ray_tmpdir' is ${#ray_tmpdir} chars; Ray's socket paths under it would pass the AF_UNIX limit (fix: at most $MAX_RAY_TMPDIR_CHARS chars, e.g. /tmp/nrl-ray)"
fi
if [[ $ray_head_ip =~ ^(127\.|localhost$|::1$) ]] && (( nodes > 1 )); then
  die "NRL_RAY_HEAD_IP='$ray_head_ip' is a loopback address but --nodes=$nodes: other nodes cannot reach it (fix: unset NRL_RAY_HEAD_IP, or --nodes 1)"
fi
[[ $ray_head_ip != *[[:space:]]* ]] || die "NRL_RAY_HEAD_IP='$ray_head_ip' contains whitespace (fix: one address, e.g. 10.0.0.1)"
if (( ${#uv_run_flags[@]} )) && [[ ${uv_run_flags[0]} != -* ]]; then
  die "NRL_DRIVER_UV_RUN_FLAGS='${NRL_DRIVER_UV_RUN_FLAGS:-}' must start with a flag, or uv would run '${uv_run_flags[0]}' as the command (fix: e.g. NRL_DRIVER_UV_RUN_FLAGS='--locked --no-sync')"
fi
[[ -z $container_mounts || -n $container ]] ||
  die "NRL_CONTAINER_MOUNTS='$container_mounts' is set without --container (fix: add --container IMAGE, or unset NRL_CONTAINER_MOUNTS)"
for override in "${overrides[@]}"; do
  [[ -n $override ]] || die "an empty recipe override was given after -- (fix: drop it)"
done
if (( ! dry_run )); then
  command -v sbatch >/dev/null 2>&1 ||
    die "sbatch is not on PATH (fix: run on a Slurm login node, or pass --dry-run to only print the script)"
fi

# ---- the sbatch script ----

assign() { printf '%s=%q\n' "$1" "$2"; }
assign_array() {
  local name=$1 item
  shift
  printf '%s=(' "$name"
  for item in "$@"; do printf ' %q' "$item"; done
  printf ' )\n'
}

render_script() {
  echo '#!/usr/bin/env bash'
  echo "#SBATCH --job-name=$job_name"
  echo "#SBATCH --nodes=$nodes"
  echo '#SBATCH --ntasks-per-node=1'
  echo '#SBATCH --exclusive'
  echo '#SBATCH --mem=0'
  echo "#SBATCH --time=$walltime"
  echo "#SBATCH --output=$log_root/%x-%j.out"
  echo "#SBATCH --chdir=$REPO_ROOT"
  [[ -z $partition ]] || echo "#SBATCH --partition=$partition"
  [[ -z $account ]] || echo "#SBATCH --account=$account"
  [[ -z $qos ]] || echo "#SBATCH --qos=$qos"
  [[ -z $gpus_per_node ]] || echo "#SBATCH --gpus-per-node=$gpus_per_node"
  echo "# Generated by $PROG. Knobs and what this job does: docs/guides/launching.md"
  echo 'set -euo pipefail'
  echo
  echo '# ---- settings (baked at submission) ----'
  assign NRL_REPO "$REPO_ROOT"
  assign NRL_LOG_ROOT "$log_root"
  assign NRL_ENTRYPOINT "$entrypoint"
  assign NRL_CONFIG "$config"
  assign_array NRL_OVERRIDES "${overrides[@]}"
  assign NRL_NODES "$nodes"
  assign NRL_DRIVER_PYTHONPATH "$driver_pythonpath"
  assign_array NRL_DRIVER_PIP_INSTALL "${driver_pip_install[@]}"
  assign_array NRL_DRIVER_UV_RUN_FLAGS "${uv_run_flags[@]}"
  assign NRL_CONTAINER "$container"
  assign NRL_CONTAINER_MOUNTS "$container_mounts"
  assign NRL_RAY_HEAD_IP "$ray_head_ip"
  assign NRL_RAY_TMPDIR "$ray_tmpdir"
  assign NRL_RAY_WAIT_TIMEOUT_S "$ray_wait_timeout_s"
  assign NRL_EXTERNAL_UV_CACHE_DIR "$uv_cache_dir"
  echo '# Ray must not re-run its workers through uv run (see nemo_rl/__init__.py).'
  echo 'export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0'
  echo '# A cluster binds to routable addresses, whatever a submitting process had set (see nemo_rl/__init__.py).'
  echo 'export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1'
  local var
  for var in "${FORWARDED_ENV[@]}"; do
    [[ -z ${!var:-} ]] || printf 'export %s=%q\n' "$var" "${!var}"
  done
  echo '# ---- end settings ----'
  cat <<'BODY'

# srun reads SLURM_QOS as its own --qos; the steps already run under the job's QOS.
unset SLURM_QOS
log() { printf '[ultra_launch %(%H:%M:%S)T] %s\n' -1 "$*"; }
fail() { log "error: $*" >&2; exit 2; }

cd "$NRL_REPO"
job_dir="$NRL_LOG_ROOT/$SLURM_JOB_NAME-$SLURM_JOB_ID"
mkdir -p "$job_dir"
if [[ -n $NRL_EXTERNAL_UV_CACHE_DIR ]]; then
  export UV_CACHE_DIR="$NRL_EXTERNAL_UV_CACHE_DIR"
else
  export UV_CACHE_DIR="$job_dir/uv-cache"
fi
if command -v uv >/dev/null 2>&1; then uv_cmd=(uv); else uv_cmd=(python3 -m uv); fi
uv_run=("${uv_cmd[@]}" run "${NRL_DRIVER_UV_RUN_FLAGS[@]}")

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#nodes[@]} == NRL_NODES )) || fail "the allocation has ${#nodes[@]} nodes (${nodes[*]}), expected $NRL_NODES"
head_node=${nodes[0]}
ray_tmp=${NRL_RAY_TMPDIR:-/tmp/nrl-j$SLURM_JOB_ID}
(( ${#ray_tmp} <= 36 )) || fail "Ray temp dir '$ray_tmp' is over 36 chars (AF_UNIX limit); set NRL_RAY_TMPDIR to a shorter dir"
# The batch script runs on the first node of the allocation, so the head's ports are picked here.
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
head_ip=${NRL_RAY_HEAD_IP:-$(hostname --ip-address | awk '{print $1}')}
gcs_port=$(free_port)
ray_address="$head_ip:$gcs_port"

# Ray's token auth, with a token of this job only (nodes and driver read it from the log dir).
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$job_dir/ray_auth_token"
(umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' > "$RAY_AUTH_TOKEN_PATH")

# Every step overlaps the others on the node's CPUs (head, workers, waiter and driver run at once).
step=(srun --overlap --nodes=1 --ntasks=1 --cpus-per-task="$SLURM_CPUS_ON_NODE")
if [[ -n $NRL_CONTAINER ]]; then
  mounts="$NRL_REPO:$NRL_REPO,$NRL_LOG_ROOT:$NRL_LOG_ROOT"
  [[ -z $NRL_EXTERNAL_UV_CACHE_DIR ]] || mounts+=",$UV_CACHE_DIR:$UV_CACHE_DIR"
  [[ -z $NRL_CONTAINER_MOUNTS ]] || mounts+=",$NRL_CONTAINER_MOUNTS"
  step+=(--container-image="$NRL_CONTAINER" --container-mounts="$mounts" --container-workdir="$NRL_REPO")
fi

head_pid=""
worker_pids=()
stop_ray() {
  local status=$? pid deadline
  # Only the batch shell cleans up: a forked child (a step not yet exec'd) must not run this.
  [[ $BASHPID == "$$" ]] || exit "$status"
  # SIGTERM to a node's srun reaches its `ray start --block`, which stops exactly the Ray
  # processes it started (never a host-wide `ray stop`).
  local pids=("${worker_pids[@]}" ${head_pid:+"$head_pid"})
  for pid in "${pids[@]}"; do
    # `|| true`: the step may have exited between the check and the signal; that is the goal.
    if kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  deadline=$((SECONDS + 60))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "Ray step pid $pid ignored SIGTERM for 60s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  wait  # reap the steps (without arguments `wait` returns 0)
  if (( status != 0 )) && [[ -d $ray_tmp/session_latest/logs ]]; then
    cp -r "$ray_tmp/session_latest/logs" "$job_dir/ray-head-session-logs"
    log "Ray session logs of the head copied to $job_dir/ray-head-session-logs"
  fi
  rm -rf -- "$ray_tmp"
  [[ -n $NRL_EXTERNAL_UV_CACHE_DIR ]] || rm -rf -- "$UV_CACHE_DIR"
  log "Ray stopped; job exits with $status"
  exit "$status"
}
trap stop_ray EXIT

log "job $SLURM_JOB_ID: ${#nodes[@]} node(s) ${nodes[*]}; Ray head $ray_address; logs in $job_dir"
# Sync the project venv once, from one node, before any node starts Ray from it.
venv_python=$("${step[@]}" -w "$head_node" "${uv_run[@]}" python -c 'import sys; print(sys.executable)')
if (( ${#NRL_DRIVER_PIP_INSTALL[@]} )); then
  log "installing into $venv_python: ${NRL_DRIVER_PIP_INSTALL[*]}"
  "${step[@]}" -w "$head_node" "${uv_cmd[@]}" pip install --python "$venv_python" "${NRL_DRIVER_PIP_INSTALL[@]}"
fi

# Ports are picked before the step forks, so the recorded PID is srun's at once.
client_port=$(free_port)
agent_port=$(free_port)
"${step[@]}" -w "$head_node" --output="$job_dir/ray-head.log" \
  "${uv_run[@]}" ray start --head --block --disable-usage-stats --include-dashboard=false \
  --node-ip-address="$head_ip" --port="$gcs_port" --ray-client-server-port="$client_port" \
  --dashboard-agent-listen-port="$agent_port" --temp-dir="$ray_tmp" &
head_pid=$!
watch=(--watch "$head_pid=Ray head on $head_node (log: $job_dir/ray-head.log)")
for node in "${nodes[@]:1}"; do
  "${step[@]}" -w "$node" --output="$job_dir/ray-worker-$node.log" \
    "${uv_run[@]}" ray start --block --disable-usage-stats --address="$ray_address" --temp-dir="$ray_tmp" &
  worker_pids+=("$!")
  watch+=(--watch "$!=Ray worker on $node (log: $job_dir/ray-worker-$node.log)")
done

"${step[@]}" -w "$head_node" "${uv_run[@]}" python -m nemo_rl.distributed.ray_cluster wait-for-nodes \
  --address "$ray_address" --nodes "${#nodes[@]}" --timeout-s "$NRL_RAY_WAIT_TIMEOUT_S" "${watch[@]}"

driver_pythonpath="$NRL_REPO${PYTHONPATH:+:$PYTHONPATH}"
[[ -z $NRL_DRIVER_PYTHONPATH ]] || driver_pythonpath="$NRL_DRIVER_PYTHONPATH:$driver_pythonpath"
log "driver: python $NRL_ENTRYPOINT --config $NRL_CONFIG ${NRL_OVERRIDES[*]}"
"${step[@]}" -w "$head_node" env RAY_ADDRESS="$ray_address" PYTHONPATH="$driver_pythonpath" \
  "${uv_run[@]}" python "$NRL_ENTRYPOINT" --config "$NRL_CONFIG" "${NRL_OVERRIDES[@]}"
BODY
}

if (( dry_run )); then
  render_script
  exit 0
fi

mkdir -p "$log_root"
script_path="$log_root/$job_name-$(date +%Y%m%d-%H%M%S)-$$.sbatch"
render_script > "$script_path"
submitted=$(sbatch --parsable "$script_path") || die "sbatch rejected $script_path (its message is above; fix the knob it names)"
job_id=${submitted%%;*}
echo "$PROG: submitted job $job_id; output $log_root/$job_name-$job_id.out; script $script_path"
