"""The numba backend: its modules (arrays, tensors, kernels, pool, entry module), bounds checks,
kernels loaded from the on-disk cache and a cache shared by processes, the output pool, the half
conversions and the compile notices."""
