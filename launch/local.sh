#!/usr/bin/env bash
# N training processes on this machine over CPU, with gloo collectives: the way the
# multi-process tests run, and a rehearsal of a multi-host launch.
set -euo pipefail

usage() {
  cat <<'TXT'
Usage: launch/local.sh [--num-processes N] [--devices-per-process D] [--port P]
                       [--logdir DIR] [--dry-run] -- <train args>

Starts N processes of `python -m mars_jax.train <train args>` on localhost, each with
D simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=D), a
coordinator at localhost:P, and logs in DIR/process_<i>.log. A SIGTERM to this
script goes to every process (as SLURM and TPU VM preemption send it to every task),
which save a checkpoint at the same step and exit with status 143. Exits 0 when
every process succeeds, 143 when every process stopped that way (rerun the same
command to resume, docs/preemption.md), 1 otherwise. --dry-run prints the commands
instead of running them.

Example:
  launch/local.sh --num-processes 2 --devices-per-process 2 -- \
      --config configs/tiny.py --workdir /tmp/run --config.train.steps=20
TXT
}

n=2; d=1; port=12355; logdir=""; dry=0; python="${PYTHON:-python}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --num-processes) n="$2"; shift 2;;
    --devices-per-process) d="$2"; shift 2;;
    --port) port="$2"; shift 2;;
    --logdir) logdir="$2"; shift 2;;
    --dry-run) dry=1; shift;;
    -h|--help) usage; exit 0;;
    --) shift; break;;
    *) echo "local.sh: unknown option $1 (train arguments go after --)" >&2; usage >&2; exit 2;;
  esac
done
[[ $# -gt 0 ]] || { echo "local.sh: no train arguments after --" >&2; usage >&2; exit 2; }
logdir="${logdir:-${TMPDIR:-/tmp}/mars_jax_local_$$}"

pids=()
for ((i = 0; i < n; i++)); do
  env_vars=(JAX_PLATFORMS=cpu "XLA_FLAGS=--xla_force_host_platform_device_count=$d"
            MARS_COORDINATOR_ADDRESS="localhost:$port" MARS_NUM_PROCESSES="$n" MARS_PROCESS_ID="$i")
  cmd=(env "${env_vars[@]}" "$python" -m mars_jax.train "$@")
  if [[ $dry == 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo "> $logdir/process_$i.log"
    continue
  fi
  mkdir -p "$logdir"
  "${cmd[@]}" > "$logdir/process_$i.log" 2>&1 &
  pids+=($!)
done
[[ $dry == 1 ]] && exit 0

# `wait` returns early (status > 128) when a trapped signal arrives: wait again
# while the process still runs; a finished process's status stays available.
status_of() {
  while wait "$1"; [[ $? -gt 128 ]] && kill -0 "$1" 2>/dev/null; do :; done
  wait "$1"
}
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM

codes=()
for i in "${!pids[@]}"; do
  status_of "${pids[$i]}" && codes+=(0) || codes+=($?)
  if [[ ${codes[$i]} != 0 ]]; then
    echo "local.sh: process $i exited with status ${codes[$i]}; see $logdir/process_$i.log" >&2
    tail -n 20 "$logdir/process_$i.log" >&2
  fi
done
echo "local.sh: logs in $logdir"
all=$(printf '%s\n' "${codes[@]}" | sort -u)
[[ $all == 0 || $all == 143 ]] && exit "$all"
exit 1
