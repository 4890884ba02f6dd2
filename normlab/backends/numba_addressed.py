"""Kernel entries by address: C-contiguous CPU tensors handed to the kernels as integers.

A NumPy view of a tensor (``Tensor.numpy()``) and a tensor of a NumPy result
(``torch.from_numpy``) cost about 0.6 µs each, and a one-token call crosses four to six times:
more than the kernel itself. For C-contiguous tensors the backend passes each tensor's address
(``Tensor.data_ptr()``) instead; these entries view that memory as the C-contiguous arrays it
holds (``numba.carray``) and call the very serial kernels a NumPy call runs — on the calling
thread (``*_at``) or on numba's threads, a range of rows each (``*_parallel_at``)
(:func:`~normlab.backends.numba_forward.layer_norm_rows`,
:func:`~normlab.backends.numba_fused.add_norm_rows`), so the results are bit for bit the NumPy
call's. Types come from numba's own dispatch on the other arguments: ``x_like`` is an array of
the kernels' element type for x (x's dtype, or the bit-pattern integer type of a half dtype),
``r_like`` one of the type of the residual and h (x's, or float32 for a float32 stream),
``w_like`` one of the compute dtype and ``p_like`` one of the type weight and bias are stored in
(the compute dtype; or any other float type, half types as bit patterns: then they are converted
to the compute dtype once per call, as ``Tensor.float()`` would); the addresses are integers.

The caller guarantees what the views assume: each address is element 0 of live, C-contiguous
memory aligned to its element type, of ``rows * cols`` elements of ``x_like``'s type (x, y) or
``r_like``'s (residual, h), or ``cols`` of ``p_like``'s (weight, bias), and ``y`` and ``h``
share no memory with each other or the inputs. The statistics arrays are passed as arrays, as
to the kernels.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.numpy_support import carray

from normlab.backends.numba_forward import FASTMATH, layer_norm_rows, load, narrow
from normlab.backends.numba_fused import add_norm_rows

__all__ = [
    "add_norm_rows_at",
    "add_norm_rows_parallel_at",
    "layer_norm_rows_at",
    "layer_norm_rows_parallel_at",
]


def _pointer_typed(typingctx: Any, address: Any) -> Any:
    """The integer ``address`` as a ``void*`` (for ``carray``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.intp), codegen


_pointer: Final[Any] = intrinsic(_pointer_typed)


def parameter(p: Any, like: Any, offset: float) -> Any:
    """The weight or bias ``p`` (1-D, C-contiguous) as an array of ``like``'s dtype (the
    compute dtype), plus ``offset`` (``plan.weight_offset``; 0 for a bias): ``p`` itself when
    it is one and the offset 0, else a new array of its elements converted (half bit patterns
    widened, float32 widened or float64 rounded to the compute dtype) and, for a nonzero
    offset, added to it in the compute dtype, rounded once there: the bits of
    ``compute(p) + offset`` (:mod:`normlab.parameters`).

    A Numba overload (:func:`_parameter_typed`): callable from jitted code only."""
    raise NotImplementedError("parameter is a Numba overload; call it from jitted code")


def _parameter_formed(p: Any, like: Any, offset: Any) -> Any:
    formed = np.empty(p.shape[0], like.dtype)
    if offset == 0.0:  # no addition: a weight of -0.0 keeps its sign
        for j in range(p.shape[0]):
            formed[j] = narrow(load(p[j]), like)
        return formed
    shift = narrow(offset, like)
    for j in range(p.shape[0]):
        formed[j] = narrow(load(p[j]), like) + shift
    return formed


def _parameter_itself(p: Any, like: Any, offset: Any) -> Any:
    if offset == 0.0:
        return p
    formed = np.empty(p.shape[0], like.dtype)
    shift = narrow(offset, like)
    for j in range(p.shape[0]):
        formed[j] = p[j] + shift
    return formed


@overload(parameter)
def _parameter_typed(p: Any, like: Any, offset: Any) -> Any:
    if p.dtype == like.dtype:
        return _parameter_itself
    convertible = p.dtype in (types.int16, types.uint16) or isinstance(p.dtype, types.Float)
    return _parameter_formed if convertible else None


@njit(error_model="numpy", cache=True)
def layer_norm_rows_at(
    x_like: Any,
    w_like: Any,
    p_like: Any,
    x_at: int,
    y_at: int,
    w_at: int,
    b_at: int,
    offset: float,
    rows: int,
    cols: int,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    start: int,
    stop: int,
) -> None:
    # layer_norm_rows: x and y (rows, cols) of x_like's type, w and b (cols,) of p_like's
    # (read as w_like's, the weight as offset + w), at these addresses; eps, mean, rstd,
    # centre, start, stop as there.
    # (start and stop are arguments, not constants: a constant would make numba compile
    # another specialization of the kernel, which may round differently from the NumPy call's.)
    x = carray(_pointer(x_at), (rows, cols), x_like.dtype)
    y = carray(_pointer(y_at), (rows, cols), x_like.dtype)
    w = parameter(carray(_pointer(w_at), cols, p_like.dtype), w_like, offset)
    b = parameter(carray(_pointer(b_at), cols, p_like.dtype), w_like, 0.0)
    layer_norm_rows(x, y, w, b, eps, mean, rstd, centre, start, stop)


@njit(error_model="numpy", cache=True)
def add_norm_rows_at(
    x_like: Any,
    w_like: Any,
    p_like: Any,
    r_like: Any,
    h_like: Any,
    x_at: int,
    r_at: int,
    y_at: int,
    h_at: int,
    w_at: int,
    b_at: int,
    offset: float,
    rows: int,
    cols: int,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    start: int,
    stop: int,
) -> None:
    # add_norm_rows: x and y (rows, cols) of x_like's type, residual and h of r_like's (x's,
    # or float32 beside half x: a float32 stream); h written unless h_like is None (then h_at
    # is not read); the others as in layer_norm_rows_at.
    x = carray(_pointer(x_at), (rows, cols), x_like.dtype)
    r = carray(_pointer(r_at), (rows, cols), r_like.dtype)
    y = carray(_pointer(y_at), (rows, cols), x_like.dtype)
    w = parameter(carray(_pointer(w_at), cols, p_like.dtype), w_like, offset)
    b = parameter(carray(_pointer(b_at), cols, p_like.dtype), w_like, 0.0)
    if h_like is None:
        add_norm_rows(x, r, y, None, w, b, eps, mean, rstd, centre, start, stop)
    else:
        h = carray(_pointer(h_at), (rows, cols), r_like.dtype)
        add_norm_rows(x, r, y, h, w, b, eps, mean, rstd, centre, start, stop)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def layer_norm_rows_parallel_at(
    x_like: Any,
    w_like: Any,
    p_like: Any,
    x_at: int,
    y_at: int,
    w_at: int,
    b_at: int,
    offset: float,
    rows: int,
    cols: int,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    chunks: int,
) -> None:
    # layer_norm_rows_at over all rows, split into `chunks` equal ranges that run in parallel
    # on numba's threads (as numba_forward.layer_norm_rows_parallel; chunks: the thread count).
    x = carray(_pointer(x_at), (rows, cols), x_like.dtype)
    y = carray(_pointer(y_at), (rows, cols), x_like.dtype)
    w = parameter(carray(_pointer(w_at), cols, p_like.dtype), w_like, offset)
    b = parameter(carray(_pointer(b_at), cols, p_like.dtype), w_like, 0.0)
    for c in prange(chunks):
        start, stop = rows * c // chunks, rows * (c + 1) // chunks
        layer_norm_rows(x, y, w, b, eps, mean, rstd, centre, start, stop)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def add_norm_rows_parallel_at(
    x_like: Any,
    w_like: Any,
    p_like: Any,
    r_like: Any,
    h_like: Any,
    x_at: int,
    r_at: int,
    y_at: int,
    h_at: int,
    w_at: int,
    b_at: int,
    offset: float,
    rows: int,
    cols: int,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    chunks: int,
) -> None:
    # add_norm_rows_at over all rows in `chunks` parallel ranges (as layer_norm_rows_parallel_at).
    x = carray(_pointer(x_at), (rows, cols), x_like.dtype)
    r = carray(_pointer(r_at), (rows, cols), r_like.dtype)
    y = carray(_pointer(y_at), (rows, cols), x_like.dtype)
    w = parameter(carray(_pointer(w_at), cols, p_like.dtype), w_like, offset)
    b = parameter(carray(_pointer(b_at), cols, p_like.dtype), w_like, 0.0)
    if h_like is None:
        for c in prange(chunks):
            start, stop = rows * c // chunks, rows * (c + 1) // chunks
            add_norm_rows(x, r, y, None, w, b, eps, mean, rstd, centre, start, stop)
    else:
        h = carray(_pointer(h_at), (rows, cols), r_like.dtype)
        for c in prange(chunks):
            start, stop = rows * c // chunks, rows * (c + 1) // chunks
            add_norm_rows(x, r, y, h, w, b, eps, mean, rstd, centre, start, stop)
