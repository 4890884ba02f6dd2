"""The numba backend's quantized outputs (:mod:`normlab.quantize`), for NumPy arrays and CPU
tensors alike: the arrays as NumPy views (half and float8 types as their bit patterns), the
parameters in the compute dtype, then the kernels of :mod:`normlab.backends.numba_quantize`,
one pass over short rows, on the pool's threads. A row's bits do not depend on the thread count
or on the other rows.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from normlab.backends.numba_arrays import add_every_row, compute_parameter, segmented
from normlab.backends.numba_kernel_types import BITS, kernel_types
from normlab.backends.numba_pool import POOL, forward_work, load_serial_first
from normlab.backends.numba_quantize import (
    add_norm_quantize_rows,
    add_norm_quantize_rows_parallel,
    norm_quantize_rows,
    norm_quantize_rows_parallel,
    quantize_rows,
    quantize_rows_parallel,
)
from normlab.hookspecs import Plan

__all__ = ["quantized", "quantized_rows"]

#: The largest magnitude of q per mode (normlab.spec.quantize.LIMITS; a backend imports no
#: module of the core's).
_LIMITS: Final = {"int8": 127.0, "fp8_e4m3": 448.0}
#: The integer type holding each 1- or 2-byte float type's bits.
_BIT_TYPES: Final = {**BITS, "float8_e4m3fn": np.uint8}


def quantized(
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    *,
    plan: Plan,
    q: Any,
    scale: Any,
    residual_out: Any,
) -> None:
    """q and scale of ``plan.op`` on the rows of ``x`` (and ``residual``), h into
    ``residual_out``; see :mod:`normlab.hookspecs`."""
    k = kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    centre = plan.op in ("layer_norm", "add_layer_norm")
    offset = plan.weight_offset
    w = k.ones if weight is None else compute_parameter(_numpy(weight, True), k.compute, offset)
    b = k.zeros if bias is None else compute_parameter(_numpy(bias, True), k.compute, 0.0)
    mode = plan.quantize or "int8"
    static = plan.quantize_scale or 0.0
    kernel_q, kernel_scale = _numpy(q), _numpy(scale)
    x_np = _numpy(x)
    r_np = None if residual is None else _numpy(residual)
    h_np = None if residual_out is None else _numpy(residual_out)
    tail = (static, _LIMITS[mode], mode == "fp8_e4m3")
    threads = POOL.acquire(forward_work(plan, k) if k.long or plan.rows > 1 else 0)
    try:
        if k.long:
            y = _long_y(x_np, r_np, h_np, w, b, plan, centre, threads)
            quantized_rows(y, kernel_q, kernel_scale, *tail, threads)
        elif r_np is None:
            rows = (x_np, kernel_q, kernel_scale, w, b, plan.eps, centre, *tail)
            _run(norm_quantize_rows, norm_quantize_rows_parallel, rows, plan.rows, threads)
        else:
            added = (x_np, r_np, h_np, kernel_q, kernel_scale, w, b, plan.eps, centre, *tail)
            _run(add_norm_quantize_rows, add_norm_quantize_rows_parallel, added, plan.rows, threads)
    finally:
        POOL.release(threads)


def quantized_rows(
    y: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    static: float,
    limit: float,
    fp8: bool,
    threads: int,
) -> None:
    """q (int8, or uint8 e4m3fn bits) and scale of the rows of ``y`` in memory (2-D, float32, or
    any dtype as the kernels read it: half types as their bits): the quantizer alone, one pass,
    on ``threads`` threads (the pool's, held by the caller)."""
    _run(
        quantize_rows,
        quantize_rows_parallel,
        (y, q, scale, static, limit, fp8),
        y.shape[0],
        threads,
    )


def _run(serial: Any, parallel: Any, args: tuple[Any, ...], rows: int, threads: int) -> None:
    """``serial`` over every row on this thread, or ``parallel`` on ``threads`` threads."""
    if threads > 1:
        load_serial_first(parallel, args, (serial, (*args, 0, 0)))
        parallel(*args, threads)
    else:
        serial(*args, 0, rows)


def _long_y(
    x: np.ndarray,
    r: np.ndarray | None,
    h: np.ndarray | None,
    w: np.ndarray,
    b: np.ndarray,
    plan: Plan,
    centre: bool,
    threads: int,
) -> np.ndarray:
    """Long rows' y in float32: x (for the fused ops h, added first into h or a scratch array)
    converted to float32, then the forward's segmented kernels, as the float32 call runs them
    (the kernels' sums may be vectorized differently for another element type); float64 x in
    float64, rounded after."""
    if r is not None:
        target = h if h is not None else np.empty(x.shape, r.dtype)
        add_every_row((x, r, target), threads)
        x = target
    h_dtype = plan.residual_dtype or plan.dtype
    wide = x if h_dtype in ("float32", "float64") else _widened(x, h_dtype)
    y = np.empty(wide.shape, wide.dtype)
    no_stats = np.empty(0, wide.dtype)
    segmented((wide, y, w, b, plan.eps, no_stats, no_stats, centre), threads)
    return y if y.dtype == np.float32 else y.astype(np.float32)


def _widened(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float32 of a half array given as its bits (``BITS``)."""
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def _numpy(a: Any, parameter: bool = False) -> Any:
    """A NumPy array, or a CPU tensor, as the NumPy array the kernels read: 1- and 2-byte float
    types as their bits (a parameter: converted by :func:`compute_parameter` instead)."""
    if isinstance(a, np.ndarray):
        bits = None if parameter else _BIT_TYPES.get(a.dtype.name)
        return a if bits is None else a.view(bits)
    import torch

    name = str(a.dtype).removeprefix("torch.")
    if parameter:
        return (
            a.detach().float().numpy()
            if name in ("bfloat16", "float8_e4m3fn")
            else a.detach().numpy()
        )
    bits = _BIT_TYPES.get(name)
    if bits is None:
        return a.numpy()
    same_width = torch.int16 if np.dtype(bits).itemsize == 2 else torch.uint8
    return a.view(same_width).numpy().view(bits)
