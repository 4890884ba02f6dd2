#!/usr/bin/env bash
# Download, on a machine with network, the wheels benchmarks/gpu_check.sh installs on a GPU
# machine without network when its Python lacks them. ml_dtypes is a compiled wheel: this fetches
# it for the Python running here; for another one, add e.g. --python-version 3.12
# --only-binary=:all: to the pip command line.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps -d benchmarks/wheels "$@" \
  pluggy array-api-compat rich markdown-it-py mdurl pygments hypothesis attrs sortedcontainers \
  ml_dtypes
