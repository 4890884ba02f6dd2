#!/usr/bin/env bash
# The GPU check of the cupy backend, for a machine with an NVIDIA GPU and no network whose Python
# has torch, cupy, numpy and pytest but not normlab. Runs from this source tree (PYTHONPATH=.;
# the built-in backends need no entry points). Dependencies that are missing (pluggy,
# array-api-compat, rich, hypothesis and theirs, ml_dtypes) are pip-installed, without network,
# from the wheels in benchmarks/wheels/ (made beforehand by benchmarks/fetch_gpu_wheels.sh) into
# a temporary folder put on PYTHONPATH.
#
# Stages, each under its own time limit, each covering layer_norm and rms_norm; the limits add
# up to 270 s, so the whole check (with the wheels' install, ~10 s) stays under 5 minutes:
#   info         (10 s)  normlab info: which backends run here, and why not
#   kernels      (30 s)  normlab kernels: NVRTC compiles every kernel (forward, fused,
#                        quantizing, backward: 44 programs) for this GPU (fills the cubin cache
#                        of the later stages; 130 s of CPU time on a 2-core VM, in parallel on
#                        the machine's cores); not in a dry run
#   conformance  (75 s)  normlab check cupy: the conformance suite on CuPy arrays
#   conformance-torch
#                (75 s)  normlab check cupy --arrays torch: the suite on CUDA tensors through
#                        backend="cupy", autograd of tensors that require grad included
#   large        (30 s)  65537 rows; 2^31 + 4096 float16 elements; rows of 1 ... 262144 elements
#   bench        (50 s)  GB/s of the cupy backend, torch.nn.functional.layer_norm / rms_norm and
#                        a copy; of the backward against torch.autograd.grad
#
#   benchmarks/gpu_check.sh             results in $OUT (default ./gpu-results): summary.md,
#                                       one .md and one .log per stage
#   benchmarks/gpu_check.sh --dry-run   no GPU needed: the stages on CPU stand-ins (the suite on
#                                       numpy arrays and, through numba, CPU tensors; the rest
#                                       on CPU tensors through the torch backend), small shapes
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

ARRAYS=(cupy) TENSORS=(cupy --arrays torch)
if ((${#DRY[@]})); then  # the suite's stand-ins: NumPy arrays, and CPU tensors through numba
  ARRAYS=(numpy) TENSORS=(numba --arrays torch)
fi

stage info 10 "$PYTHON" -m normlab info
if ((${#DRY[@]} == 0)); then  # NVRTC needs no GPU, but 400 kernels take minutes on 2 cores
  stage kernels 30 "$PYTHON" -m normlab kernels --arch "$ARCH"
fi
stage conformance 75 "$PYTHON" -m normlab check "${ARRAYS[@]}"
stage conformance-torch 75 "$PYTHON" -m normlab check "${TENSORS[@]}"
stage large 30 "$PYTHON" benchmarks/gpu_check.py large --out "$OUT" ${DRY[@]+"${DRY[@]}"}
stage bench 50 "$PYTHON" benchmarks/gpu_check.py bench --out "$OUT" ${DRY[@]+"${DRY[@]}"}

{
  echo
  echo "## Kernels ($ARCH)"
  echo
  echo '```'
  cat "$OUT/kernels.log" 2> /dev/null || echo "not compiled in a dry run"
  echo '```'
  echo
  for name in conformance conformance-torch; do
    echo
    echo "## $name (last lines)"
    echo
    echo '```'
    tail -n 25 "$OUT/$name.log"
    echo '```'
  done
  for name in large bench; do
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
