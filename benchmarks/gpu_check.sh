#!/usr/bin/env bash
# The GPU check of the cupy backend, for a machine with an NVIDIA GPU and no network whose Python
# has torch, cupy, numpy and pytest but not normlab. Runs from this source tree (PYTHONPATH=.;
# the built-in backends need no entry points). Dependencies that are missing (pluggy,
# array-api-compat, rich, hypothesis and theirs, ml_dtypes) are pip-installed, without network,
# from the wheels in benchmarks/wheels/ (made beforehand by benchmarks/fetch_gpu_wheels.sh) into
# a temporary folder put on PYTHONPATH.
#
# Stages, each under its own time limit (465 s in all), each covering layer_norm and rms_norm:
#   info         normlab info: which backends run here, and why not
#   kernels      normlab kernels: NVRTC compiles every kernel, forward and backward, for this GPU
#                (fills the cubin cache)
#   conformance  normlab check cupy: the conformance suite on CuPy arrays
#   correctness  every kernel on CuPy arrays and CUDA tensors; rows bitwise alone or in a batch
#   large        65537 rows; 2^31 + 4096 float16 elements; rows of 1 ... 262144 elements
#   backward     gradients through autograd (custom ops, backward kernels) against torch autograd;
#                bitwise repeatable, rows alone, CuPy arrays, every subset of the gradients
#   bench        GB/s of the cupy backend, torch.nn.functional.layer_norm / rms_norm and a copy;
#                of the backward against torch.autograd.grad
#
#   benchmarks/gpu_check.sh             results in $OUT (default ./gpu-results): summary.md,
#                                       one .md and one .log per stage
#   benchmarks/gpu_check.sh --dry-run   no GPU needed: the stages on CPU stand-ins, small shapes
#
# Exit status: 0 when every stage passed (a benchmark never fails on speed).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-./gpu-results}"
PYTHON="${PYTHON:-python3}"
DRY=()
if [[ "${1:-}" == "--dry-run" ]]; then
  DRY=(--dry-run)
fi
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export NORMLAB_CACHE_DIR="$WORK/cubins"

# Missing dependencies, from the wheels brought along: "distribution:module" pairs.
shopt -s nullglob nocaseglob
wheels=()
for pair in pluggy:pluggy array_api_compat:array_api_compat rich:rich markdown_it_py:markdown_it \
            mdurl:mdurl pygments:pygments hypothesis:hypothesis attrs:attr \
            sortedcontainers:sortedcontainers ml_dtypes:ml_dtypes; do
  dist="${pair%%:*}" module="${pair##*:}"
  if ! "$PYTHON" -c "import $module" 2>/dev/null; then
    found=(benchmarks/wheels/"$dist"-*.whl)
    if ((${#found[@]})); then
      wheels+=("${found[0]}")
    else
      echo "$module is missing and benchmarks/wheels/ has no $dist wheel" | tee -a "$OUT/wheels.log"
    fi
  fi
done
shopt -u nullglob nocaseglob
for wheel in ${wheels[@]+"${wheels[@]}"}; do  # one at a time: a wheel for another Python fails alone
  "$PYTHON" -m pip install --no-index --no-deps --target "$WORK/site" "$wheel" \
    >> "$OUT/wheels.log" 2>&1 || echo "could not install $wheel: see $OUT/wheels.log"
done

ARCH=sm_90
if [[ ${#DRY[@]} -eq 0 ]] && command -v nvidia-smi > /dev/null; then
  ARCH="sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')"
fi

{
  echo "# GPU check of the cupy backend"
  echo
  echo "- $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
  echo "- $("$PYTHON" --version 2>&1); target $ARCH"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/- /'
  fi
  echo
  echo "| stage | result | seconds |"
  echo "|---|---|--:|"
} > "$OUT/summary.md"

status=0
stage() {  # stage NAME SECONDS COMMAND...: run COMMAND under a time limit, log to NAME.log
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS verdict=passed
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  if ((rc == 124 || rc == 137)); then
    verdict="**timed out** after $limit s"
  elif ((rc != 0)); then
    verdict="**failed** (exit $rc)"
  fi
  ((rc == 0)) || status=1
  echo "| $name | $verdict | $((SECONDS - start)) |" >> "$OUT/summary.md"
  echo "$name: $verdict"
}

stage info 15 "$PYTHON" -m normlab info
stage kernels 90 "$PYTHON" -m normlab kernels --arch "$ARCH"
stage conformance 90 "$PYTHON" -m normlab check cupy
stage correctness 60 "$PYTHON" benchmarks/gpu_check.py correctness --out "$OUT" ${DRY[@]+"${DRY[@]}"}
stage large 60 "$PYTHON" benchmarks/gpu_check.py large --out "$OUT" ${DRY[@]+"${DRY[@]}"}
stage backward 60 "$PYTHON" benchmarks/gpu_check.py backward --out "$OUT" ${DRY[@]+"${DRY[@]}"}
stage bench 90 "$PYTHON" benchmarks/gpu_check.py bench --out "$OUT" ${DRY[@]+"${DRY[@]}"}

{
  echo
  echo "## Kernels ($ARCH)"
  echo
  echo '```'
  cat "$OUT/kernels.log"
  echo '```'
  echo
  echo "## Conformance (last lines)"
  echo
  echo '```'
  tail -n 25 "$OUT/conformance.log"
  echo '```'
  for name in correctness large backward bench; do
    echo
    if [[ -f "$OUT/$name.md" ]]; then
      cat "$OUT/$name.md"
    else
      echo "## $name: no report (see $name.log)"
    fi
  done
} >> "$OUT/summary.md"
echo "results: $OUT/summary.md"
exit $status
