"""The numba backend's quantized outputs (:mod:`normlab.quantize`), for NumPy arrays and CPU
tensors alike: the arrays as NumPy views (half and float8 types as their bit patterns), the
parameters in the compute dtype, then the kernels of :mod:`normlab.backends.numba_quantize`,
one pass over short rows, on the pool's threads. A row's bits do not depend on the thread count
or on the other rows.
"""

from __future__ import annotations

import functools
from typing import Any, Final

import numpy as np

from normlab.backends import output_pool
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
    x: Any, residual: Any, weight: Any, bias: Any, *, plan: Plan, residual_out: Any
) -> tuple[Any, Any, Any]:
    """q, scale and h of ``plan.op`` on the rows of ``x`` (and ``residual``), in x's family;
    see :mod:`normlab.hookspecs`. New outputs of many MiB come from the output pool."""
    k = kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    centre = plan.arithmetic.centred
    offset = plan.weight_offset
    w = k.ones if weight is None else compute_parameter(_parameter(weight), k.compute, offset)
    b = k.zeros if bias is None else compute_parameter(_parameter(bias), k.compute, 0.0)
    mode = plan.quantize or "int8"
    fp8 = mode == "fp8_e4m3"
    shape = (plan.rows, plan.cols)
    q = output_pool.POOL.empty(shape, _Q_BITS[fp8])
    scale = np.empty(plan.rows, np.float32)
    torch_family = plan.family == "torch"
    x_np = _bits(x, torch_family)
    r_np = h_np = h = None
    if residual is not None:
        r_np = _bits(residual, torch_family)
        if residual_out is not None:
            h, h_np = residual_out, _bits(residual_out, torch_family)
        elif plan.return_residual:
            h_np = output_pool.POOL.empty(shape, r_np.dtype)
    tail = (plan.quantize_scale or 0.0, _LIMITS[mode], fp8)
    threads = POOL.acquire(forward_work(plan, k) if k.long or plan.rows > 1 else 0)
    try:
        if k.long:
            y = _long_y(x_np, r_np, h_np, w, b, plan, centre, threads)
            quantized_rows(y, q, scale, *tail, threads)
        elif r_np is None:
            rows = (x_np, q, scale, w, b, plan.eps, centre, *tail)
            _run(norm_quantize_rows, norm_quantize_rows_parallel, rows, plan.rows, threads)
        else:
            added = (x_np, r_np, h_np, q, scale, w, b, plan.eps, centre, *tail)
            _run(add_norm_quantize_rows, add_norm_quantize_rows_parallel, added, plan.rows, threads)
    finally:
        POOL.release(threads)
    if h is None and h_np is not None:
        h = _as_family(h_np, residual, torch_family)
    if torch_family:
        import torch

        q_tensor = torch.from_numpy(q)
        return (q_tensor.view(torch.float8_e4m3fn) if fp8 else q_tensor), torch.from_numpy(scale), h
    return (q.view(_numpy_float8()) if fp8 else q), scale, h


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


#: The NumPy dtype q is written in: int8, or float8 e4m3fn's bits.
_Q_BITS: Final = {False: np.dtype(np.int8), True: np.dtype(np.uint8)}


def _bits(a: Any, tensor: bool) -> np.ndarray:
    """A NumPy array, or a CPU tensor (``tensor``), as the kernels read it: 1- and 2-byte float
    types as their bits."""
    if tensor:
        same_width = _tensor_bits().get(a.dtype)
        view: np.ndarray = (
            a.numpy() if same_width is None else a.view(same_width[0]).numpy().view(same_width[1])
        )
        return view
    bits = _BIT_TYPES.get(a.dtype.name)
    array: np.ndarray = a if bits is None else a.view(bits)
    return array


def _parameter(p: Any) -> np.ndarray:
    """A weight or bias as a NumPy array :func:`compute_parameter` converts (a tensor of a
    dtype NumPy lacks: in float32 first, exact)."""
    if isinstance(p, np.ndarray):
        return p
    p = p.detach()
    converted: np.ndarray = (p.float() if p.dtype in _tensor_bits() else p).numpy()
    return converted


def _as_family(h: np.ndarray, like: Any, tensor: bool) -> Any:
    """A new h (as the kernels wrote it) as an array of ``like``'s family and dtype."""
    if not tensor:
        return h.view(like.dtype)
    import torch

    return torch.from_numpy(h).view(like.dtype)


def _numpy_float8() -> Any:
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


@functools.cache
def _tensor_bits() -> dict[Any, tuple[Any, Any]]:
    """torch's 1- and 2-byte float dtypes: (torch dtype of the same width, NumPy bits dtype)
    (called for tensors only: torch is imported then)."""
    import torch

    return {
        torch.bfloat16: (torch.int16, np.uint16),
        torch.float16: (torch.int16, np.int16),
        torch.float8_e4m3fn: (torch.uint8, np.uint8),
    }
