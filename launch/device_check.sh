#!/usr/bin/env bash
# The accelerator check: on one GPU, install, run the device-marked tests, then
# `python -m mars_jax.bench device`, each section under its own time limit.
set -uo pipefail

usage() {
  cat <<'TXT'
Usage: launch/device_check.sh [options] OUT_DIR

One prepared run on a single-GPU machine (CUDA 13, package index reachable), at most
--budget seconds (480) including the install. Sections, each under a limit (seconds):

  install    (170) a venv (--venv, default OUT_DIR/venv); requirements.txt, then
             jax as the README says: pip install -U "jax[cuda13]>=0.11,<0.12", then
             what the marked tests need of requirements-test.txt, at its pins: torch
             (the CPU build, from --torch-index), safetensors, pytest, pytest-xdist;
             checks that JAX sees a GPU
  tests       (75) pytest -m device -n 0 over the files that hold marked tests:
             transformers parity, objective one pass == separate passes, sampler
             tau=1 == greedy AR, on the GPU
  train       (65) MARS vs AR-SFT bf16 train steps, 0.5B shape: ms/step, ratio, MFU
  decode      (95) 0.5B decoding at batch 1,4,16,64: AR, MARS W=4,5 at tau 0 and
             W=5 at tau 1, per forward vs the HBM roofline
  decode_7b   (65) 7B shape at batch 1: ms per forward vs the HBM roofline

A section that would pass the overall budget is shortened, or skipped (said so);
one that hits its limit is stopped and the rest go on. In the bench sections an
item that would not fit is skipped and listed. Results: OUT_DIR/device.json and
OUT_DIR/device.md (with a table of the sections), logs OUT_DIR/<section>.log.

Options:
  --smoke             no install, JAX on CPU, tiny shapes: the same steps (the tests
                      get 240 s on a CPU, the budget 600 s)
  --dry-run           print what each section would run, run nothing
  --venv DIR          the venv to make or reuse (default OUT_DIR/venv)
  --no-install        use --venv (or, without it, the python3 on PATH) as it is
  --sections LIST     run only these, e.g. train,decode (a rerun; implies --no-install
                      unless install is listed)
  --installer pip|uv  (default: uv when on PATH, else pip)
  --torch-index URL   index of the CPU torch build (default
                      https://download.pytorch.org/whl/cpu; "none": the default index)
  --budget S          overall seconds (default 480; 600 with --smoke)
  --limits L          e.g. install=240,decode=120 (seconds per section)
  --peak-tflops X     the chip's dense bf16 TFLOP/s, if not in the bench's table
  --hbm-tbps Y        the chip's HBM TB/s, likewise
  -h, --help

Example (docs/performance.md, "Accelerator check"):
  launch/device_check.sh runs/device
TXT
}

here=$PWD
cd "$(dirname "$0")/.." || exit 2
smoke=0; dry=0; install=1; venv=""; installer=""; budget=""; bench_flags=(); only=""
torch_index="https://download.pytorch.org/whl/cpu"
declare -A limit=([install]=170 [tests]=75 [train]=65 [decode]=95 [decode_7b]=65) asked=()
order=(install tests train decode decode_7b)
out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) smoke=1; shift;;
    --dry-run) dry=1; shift;;
    --venv) venv="$2"; shift 2;;
    --no-install) install=0; shift;;
    --sections)
      only=" ${2//,/ } "
      for k in ${2//,/ }; do [[ -n "${limit[$k]+x}" ]] || { echo "device_check.sh: --sections: unknown '$k' (sections: ${order[*]})" >&2; exit 2; }; done
      shift 2;;
    --installer) installer="$2"; shift 2;;
    --torch-index) torch_index="$2"; shift 2;;
    --budget) budget="$2"; shift 2;;
    --limits)
      IFS=, read -ra items <<<"$2"
      for it in "${items[@]}"; do
        k=${it%%=*}; v=${it#*=}
        [[ -n "${limit[$k]+x}" && "$v" =~ ^[0-9]+$ ]] || { echo "device_check.sh: --limits: bad item '$it' (sections: ${order[*]})" >&2; exit 2; }
        asked[$k]=$v
      done
      shift 2;;
    --peak-tflops|--hbm-tbps) bench_flags+=("$1" "$2"); shift 2;;
    -h|--help) usage; exit 0;;
    -*) echo "device_check.sh: unknown option $1" >&2; usage >&2; exit 2;;
    *) [[ -z "$out" ]] || { echo "device_check.sh: one OUT_DIR only" >&2; exit 2; }; out="$1"; shift;;
  esac
done
[[ -n "$out" ]] || { echo "device_check.sh: OUT_DIR is required" >&2; usage >&2; exit 2; }
[[ -z "$only" || "$only" == *" install "* ]] || install=0
# --smoke runs the marked tests on the CPU: they need longer there than on a GPU.
[[ $smoke == 1 ]] && limit[tests]=240
budget=${budget:-$([[ $smoke == 1 ]] && echo 600 || echo 480)}
for k in "${!asked[@]}"; do limit[$k]=${asked[$k]}; done
[[ "$out" = /* ]] || out="$here/$out"
venv=${venv:-$out/venv}
[[ "$venv" = /* ]] || venv="$here/$venv"
if [[ -z "$installer" ]]; then command -v uv >/dev/null 2>&1 && installer=uv || installer=pip; fi

if [[ $smoke == 1 ]]; then
  install=0
  export JAX_PLATFORMS=cpu
  bench_flags+=(--smoke)
  py=$([[ -x "$venv/bin/python" ]] && echo "$venv/bin/python" || command -v python3)
elif [[ $install == 0 ]]; then
  py=$([[ -x "$venv/bin/python" ]] && echo "$venv/bin/python" || command -v python3)
else
  py="$venv/bin/python"
fi
q() { local s; s=$(printf '%q ' "$@"); echo "${s% }"; }

# ---- what each section runs ------------------------------------------------------------
# The marked tests need these of requirements-test.txt (pins read from it), not all of it.
test_pins=$(grep -E '^(safetensors|pytest|pytest-xdist)==' requirements-test.txt | tr '\n' ' ')
torch_pin=$(grep -E '^torch==' requirements-test.txt | head -1)
if [[ $installer == uv ]]; then pipi="uv pip install -q --python $(q "$venv/bin/python")"; else pipi="$(q "$venv/bin/python") -m pip install -q"; fi
install_cmd="set -e
python3 -m venv $(q "$venv")
$pipi -r requirements.txt
$pipi -U 'jax[cuda13]>=0.11,<0.12'
$(if [[ "$torch_index" == none ]]; then echo "$pipi $(q "$torch_pin")"; else
  echo "$pipi $(q "$torch_pin") --index-url $(q "$torch_index") || $pipi $(q "$torch_pin")"; fi)
$pipi $test_pins
$(q "$py") -c 'import jax; d = jax.devices()[0]; print(\"jax\", jax.__version__, d.platform, d.device_kind); assert d.platform == \"gpu\", \"JAX sees no GPU\"'"
platform_env=$([[ $smoke == 1 ]] && echo cpu || echo cuda)
# Only the files holding marked tests are collected: others may import what the check
# does not install (lm_eval).
marked=$(grep -l '^@pytest.mark.device' tests/test_*.py | tr '\n' ' ')
tests_cmd="JAX_PLATFORMS=$platform_env XLA_PYTHON_CLIENT_PREALLOCATE=false $(q "$py") -m pytest -q -m device -n 0 -p no:cacheprovider ${marked% }"
bench() {
  local flags=""
  (( ${#bench_flags[@]} )) && flags=" $(q "${bench_flags[@]}")"
  echo "$(q "$py") -m mars_jax.bench device --out $(q "$out")$flags $*"
}

# ---- running them under the budget -----------------------------------------------------
start=$SECONDS
if [[ $dry == 1 ]]; then :
elif [[ -z "$only" ]]; then mkdir -p "$out" && rm -f "$out"/device.json "$out"/device.md "$out"/sections.tsv
elif [[ -f "$out/sections.tsv" ]]; then  # a rerun: the other sections' results stay
  awk -F'\t' -v only="$only" 'index(only, " " $1 " ") == 0' "$out/sections.tsv" >"$out/sections.tsv.new"
  mv "$out/sections.tsv.new" "$out/sections.tsv"
else mkdir -p "$out"
fi
# A rerun on the same machine skips compilations (timings never include them).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$out/jax-cache} PYTHONUNBUFFERED=1
echo "device_check: out=$out venv=$venv python=$py installer=$installer budget=${budget}s smoke=$smoke"
failed=0

record() {  # name limit used status detail
  [[ $dry == 1 ]] || printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$out/sections.tsv"
}

# section NAME COMMAND: runs COMMAND (a bash string) under min(limit, budget left).
section() {
  local name=$1 cmd=$2 lim=${limit[$1]} left soft t0 rc used status detail
  if [[ -n "$only" && "$only" != *" $name "* ]]; then
    echo "== $name: not run (--sections)"; return 0
  fi
  left=$((budget - (SECONDS - start) - 10))   # 10 s kept for the report
  (( lim > left )) && lim=$left
  if (( left < 15 )); then
    echo "== $name: SKIPPED, ${left}s of the ${budget}s budget left"
    record "$name" "${limit[$name]}" 0 "skipped (budget)" "${left}s left"
    return 1
  fi
  soft=$((lim > 30 ? lim - 15 : lim * 2 / 3))   # the bench's own limit: startup excluded
  cmd=${cmd//@SOFT@/$soft}
  echo "== $name (limit ${lim}s, $((SECONDS - start))s used so far)"
  if [[ $dry == 1 ]]; then printf '%s\n' "$cmd"; return 0; fi
  t0=$SECONDS
  timeout --kill-after=5 "$lim" bash -c "$cmd" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  used=$((SECONDS - t0))
  detail=$(grep -E '(passed|failed|error|skipped|deselected)( in |,)' "$out/$name.log" | tail -1)
  case $rc in
    0) status=ok;;
    124|137) status="stopped at its ${lim}s limit"; failed=1;;
    *) status="failed (exit $rc)"; failed=1;;
  esac
  echo "== $name: $status after ${used}s${detail:+: $detail}"
  record "$name" "$lim" "$used" "$status" "$detail"
  [[ $rc == 0 ]]
}

if [[ $install == 1 ]]; then
  section install "$install_cmd" || { echo "device_check: the install failed; nothing else can run"; [[ $dry == 1 ]] || exit 1; }
else
  echo "== install: not run (${py})"
  [[ -n "$only" ]] || record install 0 0 "not run" "$py"
fi
section tests "$tests_cmd"
for s in train decode decode_7b; do
  section "$s" "$(bench --merge --sections "$s" --limits "$s=@SOFT@")"
done
if [[ $dry == 1 ]]; then
  echo "== report"; bench --report
else
  timeout 30 bash -c "$(bench --report)" || failed=1
  echo "device_check: $((SECONDS - start))s; $out/device.md:"
  cat "$out/device.md" 2>/dev/null
fi
exit $failed
