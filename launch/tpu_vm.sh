#!/usr/bin/env bash
# MARS training on a Cloud TPU VM slice: create (or reuse) it, install, run the same
# train command on every worker, collect logs, optionally delete.
set -euo pipefail

usage() {
  cat <<'TXT'
Usage: launch/tpu_vm.sh --name NAME --zone ZONE [--type v5p-32] [--version RUNTIME]
                        [--project P] [--repo URL_OR_DIR] [--logdir DIR] [--delete]
                        [--dry-run] -- <train args>

1. creates the TPU VM slice NAME unless it exists (gcloud compute tpus tpu-vm create);
2. copies this repository to every worker (or clones --repo) and installs
   requirements.txt plus jax[tpu];
3. runs `python -m mars_jax.train <train args>` on all workers at once
   (--worker=all); JAX detects the TPU slice, so no coordinator flags are needed;
4. copies each worker's log to --logdir; --delete removes the slice at the end.
--dry-run prints every gcloud command instead of running it. LIBTPU_INIT_ARGS, set
where this script runs, is set for the train command on every worker, e.g. the
scheduler flag that overlaps context parallelism's ring sends at head size 128
(docs/long_rows.md): LIBTPU_INIT_ARGS=--xla_tpu_enable_all_experimental_scheduler_features=true

Preemption (spot or preemptible slices, maintenance; docs/preemption.md): every
worker's process gets SIGTERM, they save a checkpoint at the same step and exit
143 (the remote command keeps python's status: pipefail), and this script exits
non-zero; rerun it with the same arguments once the slice is back to resume. The
log's tee ignores SIGTERM and a closed ssh session, so the log records the save.

Example:
  launch/tpu_vm.sh --name mars --zone us-east5-a --type v5p-32 -- \
      --config configs/qwen2_5_7b_mars.py --workdir gs://bucket/runs/7b_mars
TXT
}

name=""; zone=""; type="v5p-32"; version="v2-alpha-tpuv5"; project=""; repo=""
logdir="tpu_logs"; delete=0; dry=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2;;
    --zone) zone="$2"; shift 2;;
    --type) type="$2"; shift 2;;
    --version) version="$2"; shift 2;;
    --project) project="$2"; shift 2;;
    --repo) repo="$2"; shift 2;;
    --logdir) logdir="$2"; shift 2;;
    --delete) delete=1; shift;;
    --dry-run) dry=1; shift;;
    -h|--help) usage; exit 0;;
    --) shift; break;;
    *) echo "tpu_vm.sh: unknown option $1 (train arguments go after --)" >&2; exit 2;;
  esac
done
[[ -n "$name" && -n "$zone" ]] || { echo "tpu_vm.sh: --name and --zone are required" >&2; usage >&2; exit 2; }
[[ $# -gt 0 ]] || { echo "tpu_vm.sh: no train arguments after --" >&2; usage >&2; exit 2; }

gc=(gcloud compute tpus tpu-vm)
scope=(--zone "$zone"); [[ -n "$project" ]] && scope+=(--project "$project")
run() { if [[ $dry == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi; }

train="set -o pipefail; cd mars_jax && "
if [[ -n "${LIBTPU_INIT_ARGS:-}" ]]; then   # the TPU compiler's flags, on every worker
  train+="LIBTPU_INIT_ARGS=$(printf '%q' "$LIBTPU_INIT_ARGS") "
fi
train+="python -m mars_jax.train"
for a in "$@"; do train+=" $(printf '%q' "$a")"; done
train+=" 2>&1 | (trap '' TERM; exec tee -p \$HOME/mars_train_\$(hostname).log)"
install="cd mars_jax && pip install -q -r requirements.txt && pip install -q -U 'jax[tpu]>=0.11'"

if [[ $dry == 1 ]] || ! "${gc[@]}" describe "$name" "${scope[@]}" >/dev/null 2>&1; then
  run "${gc[@]}" create "$name" "${scope[@]}" --accelerator-type "$type" --version "$version"
fi
if [[ -n "$repo" ]]; then
  run "${gc[@]}" ssh "$name" "${scope[@]}" --worker=all --command "rm -rf mars_jax && git clone $(printf '%q' "$repo") mars_jax"
else
  src="$(cd "$(dirname "$0")/.." && pwd)"
  run "${gc[@]}" scp --recurse "$src" "$name:~/mars_jax" "${scope[@]}" --worker=all
fi
run "${gc[@]}" ssh "$name" "${scope[@]}" --worker=all --command "$install"
status=0
run "${gc[@]}" ssh "$name" "${scope[@]}" --worker=all --command "$train" || status=$?
[[ $dry == 1 ]] || mkdir -p "$logdir"
run "${gc[@]}" scp "$name:~/mars_train_*.log" "$logdir/" "${scope[@]}" --worker=all || true
[[ $delete == 1 ]] && run "${gc[@]}" delete "$name" "${scope[@]}" --quiet
exit $status
