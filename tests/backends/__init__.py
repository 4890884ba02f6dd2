"""Backends one at a time (the core's tests are in tests/core): the array_api backend here,
numba's and the CUDA kernels' in their folders."""
