"""NumPy arrays through the numba kernels: the NumPy family's adapter, :data:`ARRAYS`.

The kernels read NumPy arrays as they are. ``x``, ``residual``, ``dy``, ``out`` and
``residual_out`` are passed with any strides (no copy); float16 and bfloat16 arrays as views of
their bit patterns (``int16`` and ``uint16``). Weight and bias are converted to the compute
dtype (float32, or float64 for float64 x): two arrays of ``cols`` elements, or the stand-ins of
:mod:`normlab.backends.numba_kernel_types` for absent ones. An ``out`` that is ``x``'s very
memory is normalized in place. Rows of more than
:data:`~normlab.backends.numba_forward.LONG_ROW_BYTES` take the segmented form. New outputs come
from the output pool (:mod:`normlab.backends.output_pool`).

Each call asks :data:`~normlab.backends.numba_pool.POOL` for its threads and runs the serial
kernels (on the calling thread) or their parallel drivers, whose serial kernels are loaded first
(:func:`~normlab.backends.numba_pool.load_serial_first`); the results are the same bits either
way. The CPU tensor family (:mod:`normlab.backends.numba_tensors`) runs the same functions on
NumPy views of its tensors' memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np

from normlab.backends import output_pool
from normlab.backends.numba_backward import backward_chunks, backward_chunks_parallel, sum_chunks
from normlab.backends.numba_family import Family
from normlab.backends.numba_forward import (
    SEGMENT,
    layer_norm_rows,
    layer_norm_rows_parallel,
    long_rows_parallel,
    merge_segments,
    segment_moments,
    write_segments,
)
from normlab.backends.numba_fused import (
    add_norm_rows,
    add_norm_rows_parallel,
    add_rows,
    add_rows_parallel,
)
from normlab.backends.numba_kernel_types import BITS, KernelTypes
from normlab.backends.numba_pool import POOL, forward_work, load_serial_first
from normlab.constants import ROW_CHUNK
from normlab.hookspecs import Plan

__all__ = [
    "ARRAYS",
    "RowArgs",
    "add_every_row",
    "add_normalize",
    "backward",
    "compute_parameter",
    "normalize",
    "rows_parallel",
    "segmented",
    "serial_add_rows",
    "serial_rows",
]

#: The arguments of the forward kernels, without a row range or thread count:
#: ``(x, y, w, b, eps, mean, rstd, centre)`` (see ``numba_forward.layer_norm_rows``).
RowArgs = tuple[Any, Any, Any, Any, float, Any, Any, bool]


def normalize(
    x: np.ndarray,
    weight: Any,
    bias: Any,
    plan: Plan,
    k: KernelTypes,
    out: np.ndarray | None,
    centre: bool,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Both norms: ``centre`` subtracts the row mean (LayerNorm), else none (RMSNorm)."""
    w = k.ones if weight is None else compute_parameter(weight, k.compute, plan.weight_offset)
    b = k.zeros if bias is None else compute_parameter(bias, k.compute, 0.0)
    mean = np.empty(plan.rows, k.stats) if plan.return_stats and centre else k.no_stats
    rstd = np.empty(plan.rows, k.stats) if plan.return_stats else k.no_stats
    y = output_pool.POOL.empty((plan.rows, plan.cols), x.dtype) if out is None else out
    in_place = out is not None and _same_memory(x, y)
    x_bits = x if k.bits is None else x.view(k.bits)
    y_bits = None if in_place else y if k.bits is None else y.view(k.bits)
    args = (x_bits, y_bits, w, b, plan.eps, mean, rstd, centre)
    # one short row runs on one thread: it does not take the pool from another caller
    threads = POOL.acquire(forward_work(plan, k) if k.long or plan.rows > 1 else 0)
    try:
        if k.long and threads > 1:
            _long_rows_parallel(args, threads)
        elif k.long:
            _long_rows(args)
        elif threads > 1:
            rows_parallel(args, threads)
        else:
            layer_norm_rows(*args, 0, plan.rows)
    finally:
        POOL.release(threads)
    mean_out = mean if plan.return_stats and centre else None
    rstd_out = rstd if plan.return_stats else None
    return y, mean_out, rstd_out


def add_normalize(
    x: np.ndarray,
    residual: np.ndarray,
    weight: Any,
    bias: Any,
    plan: Plan,
    k: KernelTypes,
    out: np.ndarray | None,
    residual_out: np.ndarray | None,
    centre: bool,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Both fused ops: ``centre`` subtracts the row mean (LayerNorm), else none (RMSNorm).
    ``residual`` (and ``residual_out``, h) of x's dtype, or float32 beside half x
    (``plan.residual_dtype``: a float32 stream, h kept in float32)."""
    long = k.long
    w = k.ones if weight is None else compute_parameter(weight, k.compute, plan.weight_offset)
    b = k.zeros if bias is None else compute_parameter(bias, k.compute, 0.0)
    mean = np.empty(plan.rows, k.stats) if plan.return_stats and centre else k.no_stats
    rstd = np.empty(plan.rows, k.stats) if plan.return_stats else k.no_stats
    shape = (plan.rows, plan.cols)
    y = output_pool.POOL.empty(shape, x.dtype) if out is None else out
    h = None
    if plan.return_residual:
        h = output_pool.POOL.empty(shape, residual.dtype) if residual_out is None else residual_out
    h_dtype = plan.residual_dtype or plan.dtype
    x_bits, y_bits = _as_bits(x, plan.dtype), _as_bits(y, plan.dtype)
    r_bits = _as_bits(residual, h_dtype)
    h_bits = None if h is None else _as_bits(h, h_dtype)
    threads = POOL.acquire(forward_work(plan, k) if long or plan.rows > 1 else 0)
    try:
        if long:
            # not fused: h into its output (or, not returned, into y, or a float32 stream's
            # into a scratch array), then normalized from there
            in_place: np.ndarray | None = y_bits
            if h_bits is not None:
                h_target = h_bits
            elif plan.residual_dtype is not None:
                h_target = np.empty(shape, residual.dtype)
            else:
                h_target, in_place = y_bits, None
            add_every_row((x_bits, r_bits, h_target), threads)
            row_args = (h_target, in_place, w, b, plan.eps, mean, rstd, centre)
            if threads > 1:
                _long_rows_parallel(row_args, threads)
            else:
                _long_rows(row_args)
        else:
            args = (x_bits, r_bits, y_bits, h_bits, w, b, plan.eps, mean, rstd, centre)
            if threads > 1:
                load_serial_first(add_norm_rows_parallel, args, (add_norm_rows, (*args, 0, 0)))
                add_norm_rows_parallel(*args, threads)
            else:
                add_norm_rows(*args, 0, plan.rows)
    finally:
        POOL.release(threads)
    mean_out = mean if plan.return_stats and centre else None
    rstd_out = rstd if plan.return_stats else None
    return y, h, mean_out, rstd_out


def backward(
    dy: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray | None,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Both backward ops (``mean`` None: RMSNorm); weight already in the compute dtype when it
    comes from a tensor."""
    compute = np.float64 if plan.compute_dtype == "float64" else np.float32
    rows, cols = plan.rows, plan.cols
    chunks = -(-rows // ROW_CHUNK)
    w = None if weight is None else compute_parameter(weight, compute, plan.weight_offset)
    mean = np.empty(0, rstd.dtype) if mean is None else mean
    dx = output_pool.POOL.empty((rows, cols), x.dtype) if "x" in needs else None
    dx_bits = None if dx is None else _as_bits(dx, plan.dtype)
    dw_parts = np.empty((chunks, cols), compute)
    db_parts = np.empty((chunks, cols), compute)
    args = (_as_bits(dy, plan.dtype), _as_bits(x, plan.dtype), mean, rstd, w, dx_bits)
    held = POOL.acquire(rows * cols)
    try:
        if min(held, chunks) > 1:
            serial = (backward_chunks, (*args, dw_parts, db_parts, ROW_CHUNK, 0, 0))
            load_serial_first(backward_chunks_parallel, (*args, dw_parts, db_parts), serial)
            backward_chunks_parallel(*args, dw_parts, db_parts, ROW_CHUNK, min(held, chunks))
        else:
            backward_chunks(*args, dw_parts, db_parts, ROW_CHUNK, 0, chunks)
    finally:
        POOL.release(held)
    dweight = dbias = None
    if "weight" in needs:
        dweight = np.empty(cols, compute)
        sum_chunks(dw_parts, dweight)
    if "bias" in needs:
        dbias = np.empty(cols, compute)
        sum_chunks(db_parts, dbias)
    return dx, dweight, dbias


def serial_rows(plan: Plan, k: KernelTypes, centre: bool) -> Callable[..., Any]:
    """The serial norm kernel of ``plan`` on NumPy arrays as they are (see
    :class:`~normlab.backends.numba_family.Family`): :func:`normalize` of a call on the calling
    thread without out or statistics, the same kernel on the same arguments."""
    compute, bits, shape = k.compute, k.bits, (plan.rows, plan.cols)
    eps, no_stats, stop, offset = plan.eps, k.no_stats, plan.rows, plan.weight_offset

    def run(x: Any, weight: Any, bias: Any) -> tuple[Any, ...] | None:
        params = _array_params(weight, bias, k, compute, offset)
        if params is None:
            return None
        w, b = params
        y = np.empty(shape, x.dtype)
        if bits is None:
            layer_norm_rows(x, y, w, b, eps, no_stats, no_stats, centre, 0, stop)
        else:
            layer_norm_rows(
                x.view(bits), y.view(bits), w, b, eps, no_stats, no_stats, centre, 0, stop
            )
        return (y, None, None) if centre else (y, None)

    return run


def serial_add_rows(plan: Plan, k: KernelTypes, centre: bool) -> Callable[..., Any]:
    """The serial fused kernel of ``plan`` on NumPy arrays as they are: :func:`add_normalize` of
    a call on the calling thread without outputs given or statistics, the same kernel on the
    same arguments."""
    compute, shape, keep_h = k.compute, (plan.rows, plan.cols), plan.return_residual
    eps, no_stats, stop, offset = plan.eps, k.no_stats, plan.rows, plan.weight_offset
    # the bit-pattern types the kernel reads x and y, residual and h as (None: their own)
    x_type, h_type = BITS.get(plan.dtype), BITS.get(plan.residual_dtype or plan.dtype)

    def run(x: Any, residual: Any, weight: Any, bias: Any) -> tuple[Any, ...] | None:
        params = _array_params(weight, bias, k, compute, offset)
        if params is None:
            return None
        w, b = params
        y = np.empty(shape, x.dtype)
        h = np.empty(shape, residual.dtype) if keep_h else None
        if x_type is not None:
            x, y_bits = x.view(x_type), y.view(x_type)
        else:
            y_bits = y
        if h_type is not None:
            residual = residual.view(h_type)
        h_kernel: Any = h if h is None or h_type is None else h.view(h_type)
        add_norm_rows(x, residual, y_bits, h_kernel, w, b, eps, no_stats, no_stats, centre, 0, stop)
        return (y, h, None, None) if centre else (y, h, None)

    return run


def _array_params(
    weight: Any, bias: Any, k: KernelTypes, compute: Any, offset: float
) -> tuple[Any, Any] | None:
    """Weight (plus ``offset``) and bias as the serial kernels read them (the stand-ins for
    absent ones), or None when one must be converted first (:func:`compute_parameter`: another
    dtype, not C-contiguous)."""
    if weight is None:
        weight = k.ones
    elif not (weight.dtype == compute and weight.flags.c_contiguous):
        return None
    elif offset:
        weight = compute_parameter(weight, compute, offset)
    if bias is None:
        bias = k.zeros
    elif not (bias.dtype == compute and bias.flags.c_contiguous):
        return None
    return weight, bias


def rows_parallel(args: RowArgs, threads: int) -> None:
    """``layer_norm_rows_parallel`` on ``args`` (those of ``layer_norm_rows`` without the range)."""
    load_serial_first(layer_norm_rows_parallel, args, (layer_norm_rows, (*args, 0, 0)))
    layer_norm_rows_parallel(*args, threads)


def segmented(args: RowArgs, threads: int) -> None:
    """The segmented (long-row) form of the forward on ``args`` on ``threads`` threads (the
    pool's, held by the caller)."""
    if threads > 1:
        _long_rows_parallel(args, threads)
    else:
        _long_rows(args)


def _long_rows(args: RowArgs) -> None:
    """The segmented form of ``long_rows_parallel`` (same ``args``, without the thread count) on
    the calling thread: its three kernels in turn, so the bits are the parallel driver's."""
    x, y, w, b, eps, mean, rstd, centre = args
    rows, cols = x.shape
    segments = -(-cols // SEGMENT)
    items = rows * segments
    moments = np.empty((rows, segments, 2))
    stats, wide = np.empty((rows, 3)), np.empty(rows, np.bool_)
    segment_moments(x, w, centre, moments, 0, items)
    merge_segments(x, w, eps, centre, moments, stats, wide, mean, rstd)
    write_segments(x, y, w, b, stats, wide, 0, items)


def _long_rows_parallel(args: RowArgs, threads: int) -> None:
    """``long_rows_parallel`` on ``args`` (those of :func:`_long_rows`)."""
    x, y, w, b, eps, mean, rstd, centre = args
    moments = np.empty((0, -(-x.shape[1] // SEGMENT), 2))
    stats, wide = np.empty((0, 3)), np.empty(0, np.bool_)
    load_serial_first(
        long_rows_parallel,
        args,
        (segment_moments, (x, w, centre, moments, 0, 0)),
        (merge_segments, (x, w, eps, centre, moments, stats, wide, mean, rstd)),
        (write_segments, (x, y, w, b, stats, wide, 0, 0)),
    )
    long_rows_parallel(*args, threads)


def add_every_row(args: tuple[np.ndarray, np.ndarray, np.ndarray], threads: int) -> None:
    """``h = x + residual`` of every row (``args``: x, residual, h) on ``threads`` threads."""
    if threads > 1:
        load_serial_first(add_rows_parallel, args, (add_rows, (*args, 0, 0)))
        add_rows_parallel(*args, threads)
    else:
        add_rows(*args, 0, args[0].shape[0])


def _as_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` itself, or a view of its bit patterns for float16/bfloat16 (any strides)."""
    bits = BITS.get(dtype)
    return a if bits is None else a.view(bits)


def _same_memory(x: np.ndarray, y: np.ndarray) -> bool:
    """Whether ``y`` is exactly ``x``'s memory (same first element and strides): in place.

    The core passes an ``out`` that is either that or shares no element with ``x``."""
    if y is x:
        return True
    if not np.may_share_memory(x, y):  # bounds only: cheap
        return False
    data = x.__array_interface__["data"][0]
    return bool(y.__array_interface__["data"][0] == data and y.strides == x.strides)


def compute_parameter(p: Any, compute: Any, offset: float) -> np.ndarray:
    """A weight or bias as a contiguous compute-dtype array (``p`` itself when it is one),
    plus ``offset`` (``plan.weight_offset``; 0 for a bias) added in the compute dtype: the bits
    of ``compute(p) + offset`` (:mod:`normlab.parameters`)."""
    if p.dtype == compute and p.flags.c_contiguous:
        formed = p
    else:
        formed = np.ascontiguousarray(p, dtype=compute)
    return formed + np.dtype(compute).type(offset) if offset else formed  # type: ignore[no-any-return]


#: The NumPy family's adapter.
ARRAYS: Final = Family(
    normalize=normalize,
    add_normalize=add_normalize,
    backward=backward,
    serial_rows=serial_rows,
    serial_add_rows=serial_add_rows,
)
