#!/usr/bin/env bash
# A one-machine SLURM cluster (munge, slurmctld, slurmd on this host) for trying and
# testing launch/gpu_slurm.sbatch for real: sbatch, srun, scancel, requeue.
set -euo pipefail

usage() {
  cat <<'TXT'
Usage: launch/slurm_localhost.sh up|down|status [--dir DIR]

up      installs Debian's slurm-wlm and munge when they are missing (apt-get), writes
        /etc/slurm/slurm.conf for one node (this host's CPUs and memory, partition
        "local", JobRequeue=1), starts munged (unless one runs), slurmctld and slurmd,
        and waits until sinfo shows the node idle. Idempotent: a cluster it already
        brought up is left as it is.
down    stops exactly the daemons `up` started (their pids are in DIR) and removes the
        slurm.conf it wrote; nothing else.
status  says whether the cluster is up (status 0) or not (status 1).

Needs root (the daemons run as root) and, to install, apt-get with a package index;
exits with status 3 when it cannot have them, 1 on any other failure.
Refuses to overwrite a /etc/slurm/slurm.conf it did not write, or to start beside a
slurmctld or slurmd it did not start. DIR (default $MARS_SLURM_DIR or
/var/tmp/mars_jax_slurm) holds the daemons' state, spool, logs and pids.

Example (the GPU-cluster script on this CPU machine, two tasks):
  launch/slurm_localhost.sh up
  mkdir -p runs   # sbatch does not make --output's directory
  sbatch --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 \
      --gpus-per-node=0 --output=runs/slurm-%j.out launch/gpu_slurm.sbatch \
      --venv "$VIRTUAL_ENV" -- --config configs/tiny.py --workdir runs/slurm
  launch/slurm_localhost.sh down
TXT
}

CONF=/etc/slurm/slurm.conf
MARK="# Written by mars_jax launch/slurm_localhost.sh; removed by its 'down'."
action="${1:-}"; [[ $# -gt 0 ]] && shift
dir="${MARS_SLURM_DIR:-/var/tmp/mars_jax_slurm}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) dir="$2"; shift 2;;
    -h|--help) usage; exit 0;;
    *) echo "slurm_localhost.sh: unknown option $1" >&2; usage >&2; exit 2;;
  esac
done

die() { echo "slurm_localhost.sh: $*" >&2; exit 1; }
cannot() { echo "slurm_localhost.sh: $*" >&2; exit 3; }   # status 3: SLURM cannot be had here
ours() { [[ -f "$CONF" ]] && [[ "$(head -n 1 "$CONF")" == "$MARK" ]]; }
alive() { [[ -f "$dir/$1.pid" ]] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null; }
node_idle() { sinfo -h -N -o '%T' 2>/dev/null | grep -qxE 'idle|mixed|allocated|completing'; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
    && command -v sbatch >/dev/null && command -v munged >/dev/null && return
  command -v apt-get >/dev/null || cannot "slurmctld, slurmd or munged is missing and there is no apt-get to install Debian's slurm-wlm and munge; install them and rerun."
  echo "slurm_localhost.sh: installing slurm-wlm and munge (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends \
           slurmctld slurmd slurm-client munge >&2; } \
    || cannot "apt-get could not install slurm-wlm and munge (no package index reachable?)"
}

write_conf() {
  # The node line as slurmd sees this host: NodeName, CPUs, sockets, cores, RealMemory.
  local node; node="$(slurmd -C | head -n 1)"
  local host; host="$(hostname -s)"
  mkdir -p "$dir/state" "$dir/spool" /etc/slurm
  cat > "$CONF.tmp" <<CONF
$MARK
ClusterName=mars_jax_local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again once its old credential expires (120 s by default).
AuthInfo=cred_expire=20
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
# No cgroups in a container: track processes by their parent, bind no CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=30
$node State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  mv "$CONF.tmp" "$CONF"
}

up() {
  [[ $(id -u) == 0 ]] || cannot "needs root: the SLURM daemons run as root here (run it with sudo)."
  if ours && alive slurmctld && alive slurmd && node_idle; then
    echo "slurm_localhost.sh: already up (slurm.conf $CONF, state $dir)"; return
  fi
  [[ -f "$CONF" ]] && ! ours && die "$CONF exists and was not written by this script; refusing to touch another SLURM configuration."
  for d in slurmctld slurmd; do
    if pgrep -x "$d" >/dev/null && ! alive "$d"; then
      die "a $d that this script did not start is running (pid $(pgrep -x "$d" | head -n 1)); stop it first."
    fi
  done
  install_packages
  write_conf
  touch "$dir/started"
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    [[ -f /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (reinstall munge)."
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged || die "munged did not start"
    for _ in $(seq 50); do [[ -s /run/munge/munged.pid ]] && break; sleep 0.1; done
    cp /run/munge/munged.pid "$dir/munged.pid" || die "munged wrote no pid file"
    echo munged >> "$dir/started"
  fi
  alive slurmctld || { slurmctld -f "$CONF" || die "slurmctld did not start; see $dir/slurmctld.log"; echo slurmctld >> "$dir/started"; }
  alive slurmd || { slurmd -f "$CONF" || die "slurmd did not start; see $dir/slurmd.log"; echo slurmd >> "$dir/started"; }
  for _ in $(seq 60); do
    if node_idle; then
      echo "slurm_localhost.sh: up: node $(hostname -s), $(sinfo -h -o '%c CPUs, %m MB, partition %P'); state in $dir"
      return
    fi
    # A node that was down before (an earlier run) comes back when told so.
    scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  die "the node did not become idle in 60 s: $(sinfo -N 2>&1 | tail -n 1); see $dir/slurmctld.log and $dir/slurmd.log"
}

down() {
  [[ -f "$dir/started" ]] || { echo "slurm_localhost.sh: nothing to stop (no cluster started from $dir)"; return; }
  local d pid
  # slurmd first, then the controller, munged last.
  for d in slurmd slurmctld munged; do
    grep -qx "$d" "$dir/started" || continue
    [[ -f "$dir/$d.pid" ]] || continue
    pid="$(cat "$dir/$d.pid")"
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$dir/$d.pid"
  done
  rm -f "$dir/started"
  ours && rm -f "$CONF"
  echo "slurm_localhost.sh: down (logs kept in $dir)"
}

case "$action" in
  up) up;;
  down) down;;
  status) ours && alive slurmctld && alive slurmd && node_idle && { echo up; exit 0; }; echo down; exit 1;;
  -h|--help) usage;;
  *) usage >&2; exit 2;;
esac
