"""The Numba backend: fused, parallel JIT kernels for NumPy arrays (and CPU tensors, zero-copy).

This module holds the backend's entry points and its thread pool; the kernels are in
:mod:`normlab.backends.numba_forward` and :mod:`normlab.backends.numba_backward` (which import
nothing of this module). ``layer_norm`` and ``rms_norm`` run the same forward kernels, RMSNorm
without the centring; so do their backward ops with the backward kernels. This module turns a call
into kernel arguments, :data:`normlab.constants.ROW_CHUNK` included. ``x`` and ``out`` are passed
as they are, with any strides (no copy); float16 and bfloat16 arrays as views of their bit patterns
(``int16`` and ``uint16``). Weight and bias are converted to the compute dtype (float32, or float64
for float64 x): two arrays of ``cols`` elements. An absent one is a cached array of ones or zeros:
``cols`` long for short rows, one segment (:data:`~normlab.backends.numba_forward.SEGMENT`) long
for long rows, whose kernels reuse it for every segment; so a call without weight or bias allocates
no row-sized stand-in. An ``out`` that is ``x``'s very memory is normalized in place. Rows of more
than :data:`~normlab.backends.numba_forward.LONG_ROW_BYTES` take the segmented one-pass form.

Threads (:class:`Pool`): inputs of fewer than :data:`SERIAL_ELEMENTS` elements run on the
calling thread, larger ones on ``numba.get_num_threads()`` threads (a contiguous range of rows,
or of row segments for long rows, each) — unless another thread is inside the parallel kernels
at that moment, or this process is a child forked after its parent went parallel: then on the
calling thread. The results are the same bits either way.

Torch CPU tensors (a zero-copy family: chosen by cost, or named) are read and written in place;
the results are tensors. A small C-contiguous one (a call on the calling thread, without ``out``)
goes to the serial kernels by address (:mod:`normlab.backends.numba_addressed`); others through
``Tensor.numpy()`` views of the same memory. The kernels record
no autograd graph (the record claims no ``autograd``): for tensors that require grad the core
runs this backend through normlab's torch custom ops (:mod:`normlab.autograd`), which call it
with tensors that do not; a tensor that requires grad reaching it is refused
(:class:`BackendError`), never detached.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numba
import numpy as np

from normlab.backends import (
    compile_notices,
    half_bits,
    numba_addressed,
    numba_backward,
    numba_cache,
    numba_forward,
    numba_fused,
    output_pool,
)
from normlab.backends.numba_addressed import add_norm_rows_at, layer_norm_rows_at
from normlab.backends.numba_backward import backward_chunks, backward_chunks_parallel, sum_chunks
from normlab.backends.numba_forward import (
    LONG_ROW_BYTES,
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
from normlab.constants import ROW_CHUNK
from normlab.errors import BackendError
from normlab.hookspecs import Plan

__all__ = [
    "POOL",
    "SERIAL_ELEMENTS",
    "Pool",
    "add_layer_norm",
    "add_rms_norm",
    "from_numpy",
    "layer_norm",
    "layer_norm_backward",
    "load_serial_first",
    "prepare",
    "rms_norm",
    "rms_norm_backward",
    "threading_layer",
    "to_numpy",
]

numba_cache.adopt(half_bits, numba_forward, numba_backward, numba_fused, numba_addressed)

#: Below this many elements (rows * cols) a call runs on the calling thread: there the thread
#: pool saves under a fifth of the time, and a busy machine can delay its wake-up by
#: milliseconds (measured on 2 cores; see docs/numba.md: at 32 x 768, 2^14.6 elements, two
#: threads saved 5-10% on a lightly loaded machine and cost 100 times the call on a busy one).
SERIAL_ELEMENTS: Final = 1 << 15

#: The integer type whose values are a half type's bit patterns, as the kernels read them.
_BITS: Final = {"float16": np.int16, "bfloat16": np.uint16}
#: Weight and bias as the address entries take them: (weight's address, bias's, an empty array
#: of the type they are stored in); see :func:`_tensor_params`.
_Params = tuple[int, int, np.ndarray]


class Pool:
    """Who may start numba's parallel kernels: at most one call at a time, never a forked child.

    :meth:`acquire` answers the number of threads a call runs on: 1 (the serial kernels, on the
    calling thread) or ``numba.get_num_threads()``, in which case the call holds the pool until
    :meth:`release`. It answers 1 for small inputs, while another thread holds the pool (the
    ``workqueue`` layer aborts the process when two threads enter parallel kernels at once;
    ``omp`` and ``tbb`` accept it but would run callers x threads on the cores), and in a child
    forked after this process started parallel kernels (GNU OpenMP kills such a child, and a
    thread pool does not survive ``fork()`` whatever the layer). Results do not depend on it:
    the kernels give the same bits on any number of threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False  # this process (or the parent it was forked from) went parallel
        self._forked = False  # a child forked after that: serial kernels only

    def acquire(self, elements: int) -> int:
        """The threads a call of ``elements`` elements runs on; hold the pool when above 1."""
        if elements < SERIAL_ELEMENTS or self._forked:
            return 1
        if not self._lock.acquire(blocking=False):
            return 1
        threads = numba.get_num_threads()
        if threads == 1:
            self._lock.release()
            return 1
        self._started = True
        return int(threads)

    def release(self, threads: int) -> None:
        """Give the pool back after a call that :meth:`acquire` gave ``threads``."""
        if threads > 1:
            self._lock.release()

    def after_fork_in_child(self) -> None:
        """In a forked child: serial kernels only if the parent had started the thread pool."""
        self._lock = threading.Lock()  # another thread of the parent may have held it
        self._forked = self._forked or self._started


compile_notices.watch_numba_compiles()  # a slow first call says that it is compiling

#: The one pool of this process (numba has one set of worker threads per process).
POOL: Final = Pool()
os.register_at_fork(after_in_child=POOL.after_fork_in_child)

#: Parallel drivers, with their arguments' types, whose serial kernels are loaded.
_SERIAL_LOADED: set[tuple[Any, ...]] = set()


def _numba_type_key(a: Any) -> Any:
    """What numba's type of ``a`` depends on: an array's dtype, dimensions, layout, mutability
    and alignment; the type of anything else."""
    if isinstance(a, np.ndarray):
        f = a.flags
        return a.dtype, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned
    return type(a)


def load_serial_first(
    driver: Any, args: tuple[Any, ...], *serial: tuple[Any, tuple[Any, ...]]
) -> None:
    """Before the parallel ``driver`` runs on ``args``' types for the first time in this process,
    load the serial kernels it calls: ``serial`` holds ``(kernel, arguments)`` pairs, each a
    call that does no work (an empty range of rows).

    Numba puts a copy of every kernel a driver calls into the driver's own machine code, and of
    the copies of one kernel a process runs the one it loaded first. In the process that
    compiles them that is the serial kernel's own (numba compiles a callee before its caller).
    A driver loaded from the on-disk cache before its serial kernels would run its copy instead,
    optimized in the driver's context, whose fast-math sums round differently: rows 1 ulp apart
    from the serial path's (38 of 64 rows of a (64, 1024) float32 batch), so results would
    depend on the thread count and on the other rows in every process but the first.
    """
    load_first((driver, *map(_numba_type_key, args)), *serial)


def load_first(key: tuple[Any, ...], *serial: tuple[Any, tuple[Any, ...]]) -> None:
    """:func:`load_serial_first` for a driver whose arguments' types ``key`` stands for."""
    if key in _SERIAL_LOADED:
        return
    for kernel, arguments in serial:
        kernel(*arguments)
    _SERIAL_LOADED.add(key)


#: The arguments of the forward kernels, without a row range or thread count:
#: ``(x, y, w, b, eps, mean, rstd, centre)`` (see ``numba_forward.layer_norm_rows``).
RowArgs = tuple[Any, Any, Any, Any, float, Any, Any, bool]


def _rows_parallel(args: RowArgs, threads: int) -> None:
    """``layer_norm_rows_parallel`` on ``args`` (those of ``layer_norm_rows`` without the range)."""
    load_serial_first(layer_norm_rows_parallel, args, (layer_norm_rows, (*args, 0, 0)))
    layer_norm_rows_parallel(*args, threads)


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


def threading_layer(start: bool = False) -> str:
    """The threading layer of numba's parallel kernels: ``"omp"``, ``"tbb"`` or ``"workqueue"``.

    Known once a parallel kernel has run in this process; ``start=True`` runs a tiny one first
    if none has (unless this is a forked child, which stays serial). Before that, the answer
    names the layer requested (``NUMBA_THREADING_LAYER``, "default" if unset).
    """
    if start:
        tiny = np.zeros((2, 1), np.float32)
        threads = POOL.acquire(SERIAL_ELEMENTS)
        try:
            if threads > 1:
                w, b = _constant(1, np.float32, 1.0), _constant(1, np.float32, 0.0)
                empty = _no_stats(np.float32)
                _rows_parallel((tiny, None, w, b, 1e-5, empty, empty, True), 2)
        finally:
            POOL.release(threads)
    from numba.np.ufunc import parallel

    try:
        return str(parallel.threading_layer())  # type: ignore[no-untyped-call]
    except ValueError:  # no parallel kernel has run in this process
        requested = os.environ.get("NUMBA_THREADING_LAYER", "default")
        return f"not started (requested: {requested})"


def layer_norm(x: Any, weight: Any, bias: Any, *, plan: Plan, out: Any) -> tuple[Any, Any, Any]:
    """Normalize each row of the 2-D ``x`` (any strides); see :mod:`normlab.hookspecs`.

    ``x`` is a NumPy array, or a CPU torch tensor when the caller named this backend; ``y``,
    ``mean`` and ``rstd`` are of the same family. ``out`` may be ``x``'s very memory.
    """
    return _normalize(x, weight, bias, plan, out, centre=True)


def rms_norm(x: Any, weight: Any, bias: None, *, plan: Plan, out: Any) -> tuple[Any, None, Any]:
    """RMS-normalize each row of the 2-D ``x``: ``x / sqrt(mean(x^2) + eps) * weight``.

    As :func:`layer_norm` (same kernels, without the centring); returns ``(y, None, rstd)``.
    """
    y, _, rstd = _normalize(x, weight, None, plan, out, centre=False)
    return y, None, rstd


def prepare(op: str, plan: Plan) -> Callable[..., Any] | None:
    """The direct route's function of ``plan`` (see :mod:`normlab.hookspecs`): for a call that
    runs on the calling thread (:func:`_serial`) without grad, the serial kernel with the plan's
    work done once; else None. It hands the op's function any call whose arguments it does not
    read as the kernel does (a weight to convert, a misaligned or strided tensor)."""
    if op not in _PREPARED or plan.requires_grad:
        return None
    k = _kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    if not _serial(plan, k) or plan.rows * plan.cols * k.element.itemsize >= output_pool.MIN_BYTES:
        return None  # threads, or outputs the pool would give
    make = _PREPARED[op].get(plan.family)
    return None if make is None else make(plan, k, op in ("layer_norm", "add_layer_norm"))


def _prepared_array_rows(plan: Plan, k: _KernelTypes, centre: bool) -> Callable[..., Any]:
    """:func:`prepare` of the norms for NumPy arrays: :func:`_normalize` of a serial call
    without out or statistics, the same kernel on the same arguments."""
    function = layer_norm if centre else rms_norm
    compute, bits, shape = k.compute, k.bits, (plan.rows, plan.cols)
    tail: tuple[Any, ...] = (plan.eps, k.no_stats, k.no_stats, centre, 0, plan.rows)

    def normalize_rows(x: Any, weight: Any, bias: Any) -> tuple[Any, None, None]:
        params = _array_params(weight, bias, k, compute)
        if params is None:
            return function(x, weight, bias, plan=plan, out=None)
        y = np.empty(shape, x.dtype)
        if bits is None:
            layer_norm_rows(x, y, *params, *tail)
        else:
            layer_norm_rows(x.view(bits), y.view(bits), *params, *tail)
        return y, None, None

    return normalize_rows


def _prepared_array_add_rows(plan: Plan, k: _KernelTypes, centre: bool) -> Callable[..., Any]:
    """:func:`prepare` of the fused ops for NumPy arrays: :func:`_add_normalize` of a serial
    call without outputs given or statistics, the same kernel on the same arguments."""
    function = add_layer_norm if centre else add_rms_norm
    compute, bits, shape, keep_h = k.compute, k.bits, (plan.rows, plan.cols), plan.return_residual
    tail: tuple[Any, ...] = (plan.eps, k.no_stats, k.no_stats, centre, 0, plan.rows)

    def add_normalize_rows(x: Any, residual: Any, weight: Any, bias: Any) -> tuple[Any, ...]:
        params = _array_params(weight, bias, k, compute)
        if params is None:
            return function(x, residual, weight, bias, plan=plan, out=None, residual_out=None)
        y = np.empty(shape, x.dtype)
        h = np.empty(shape, x.dtype) if keep_h else None
        if bits is None:
            add_norm_rows(x, residual, y, h, *params, *tail)
        else:
            h_bits: Any = None if h is None else h.view(bits)
            add_norm_rows(x.view(bits), residual.view(bits), y.view(bits), h_bits, *params, *tail)
        return y, h, None, None

    return add_normalize_rows


def _array_params(weight: Any, bias: Any, k: _KernelTypes, compute: Any) -> tuple[Any, Any] | None:
    """Weight and bias as the serial kernels read them (the stand-ins for absent ones), or None
    when one must be converted first (:func:`_parameter`: another dtype, not C-contiguous)."""
    if weight is None:
        weight = k.ones
    elif not (weight.dtype == compute and weight.flags.c_contiguous):
        return None
    if bias is None:
        bias = k.zeros
    elif not (bias.dtype == compute and bias.flags.c_contiguous):
        return None
    return weight, bias


def _prepared_tensor_rows(plan: Plan, k: _KernelTypes, centre: bool) -> Callable[..., Any]:
    """:func:`prepare` of the norms for CPU tensors: :func:`_normalize_at` without out or
    statistics, for C-contiguous aligned tensors and weights as :func:`_tensor_params` reads
    them."""
    function = layer_norm if centre else rms_norm
    empty_like, itemsize = _torch().empty_like, k.element.itemsize
    element, compute_like, compute = k.element, k.compute_like, _torch_compute(k.compute)
    tail = (plan.rows, plan.cols, float(plan.eps), k.no_stats, k.no_stats, centre, 0, plan.rows)
    name = "layer_norm_rows_at"
    entry, half_entry = k.entries.get(name), k.entries.get(_entry_name(name, k, element))

    def normalize_rows(x: Any, weight: Any, bias: Any) -> tuple[Any, None, None]:
        nonlocal entry, half_entry
        x_at = x.data_ptr()
        params = _tensor_params(weight, bias, k, compute, x)
        run = None if params is None else entry if params[2] is compute_like else half_entry
        if run is None or x_at % itemsize or not x.is_contiguous():
            result = function(x, weight, bias, plan=plan, out=None)  # compiles the entry
            entry, half_entry = k.entries.get(name), k.entries.get(_entry_name(name, k, element))
            return result
        w_at, b_at, p_like = params  # type: ignore[misc]
        y = empty_like(x)
        run(element, compute_like, p_like, x_at, y.data_ptr(), w_at, b_at, *tail)
        return y, None, None

    return normalize_rows


def _prepared_tensor_add_rows(plan: Plan, k: _KernelTypes, centre: bool) -> Callable[..., Any]:
    """:func:`prepare` of the fused ops for CPU tensors: :func:`_add_normalize_at` without
    outputs given or statistics, for C-contiguous aligned tensors and weights as
    :func:`_tensor_params` reads them."""
    function = add_layer_norm if centre else add_rms_norm
    empty_like, itemsize, keep_h = _torch().empty_like, k.element.itemsize, plan.return_residual
    element, compute_like, compute = k.element, k.compute_like, _torch_compute(k.compute)
    h_like = element if keep_h else None
    tail = (plan.rows, plan.cols, float(plan.eps), k.no_stats, k.no_stats, centre, 0, plan.rows)
    name = "add_norm_rows_at with h" if keep_h else "add_norm_rows_at"
    entry, half_entry = k.entries.get(name), k.entries.get(_entry_name(name, k, element))

    def add_normalize_rows(x: Any, residual: Any, weight: Any, bias: Any) -> tuple[Any, ...]:
        nonlocal entry, half_entry
        x_at, r_at = x.data_ptr(), residual.data_ptr()
        params = _tensor_params(weight, bias, k, compute, x)
        run = None if params is None else entry if params[2] is compute_like else half_entry
        if (
            run is None
            or (x_at | r_at) % itemsize  # itemsize is a power of two
            or not x.is_contiguous()
            or not residual.is_contiguous()
        ):
            result = function(x, residual, weight, bias, plan=plan, out=None, residual_out=None)
            entry, half_entry = k.entries.get(name), k.entries.get(_entry_name(name, k, element))
            return result
        w_at, b_at, p_like = params  # type: ignore[misc]
        y = empty_like(x)
        h = empty_like(x) if keep_h else None
        h_at = 0 if h is None else h.data_ptr()
        run(
            element, compute_like, p_like, h_like, x_at, r_at, y.data_ptr(), h_at, w_at, b_at, *tail
        )
        return y, h, None, None

    return add_normalize_rows


def _tensor_params(weight: Any, bias: Any, k: _KernelTypes, compute: Any, x: Any) -> _Params | None:
    """Weight and bias as the address entries read them: their addresses (the stand-ins' for
    absent ones) and an empty array of the type they are stored in (``p_like``): the compute
    dtype (``compute``, a torch dtype), or x's half dtype, which the entries widen
    themselves. None when one must be converted first (:func:`_converted_params`: another
    dtype, the two stored differently, strided, misaligned)."""
    if weight is not None:
        stored = weight.dtype
    elif bias is not None:
        stored = bias.dtype
    else:
        return k.ones_at, k.zeros_at, k.compute_like
    if stored is compute:
        like, w_at, b_at = k.compute_like, k.ones_at, k.zeros_at
    elif k.bits is not None and stored is x.dtype:
        like, w_at, b_at = k.element, k.half_ones_at, k.half_zeros_at
    else:
        return None
    size = like.itemsize
    if weight is not None:
        w_at = weight.data_ptr()
        if w_at % size or not weight.is_contiguous():
            return None
    if bias is not None:
        b_at = bias.data_ptr()
        if bias.dtype is not stored or b_at % size or not bias.is_contiguous():
            return None
    return w_at, b_at, like


def _converted_params(weight: Any, bias: Any, k: _KernelTypes) -> tuple[_Params, Any]:
    """:func:`_tensor_params` of weight and bias converted to contiguous compute-dtype tensors
    where needed, with the converted copies to keep alive while the kernel runs."""
    w_at, w_kept = _tensor_address(weight, k, k.ones_at)
    b_at, b_kept = _tensor_address(bias, k, k.zeros_at)
    return (w_at, b_at, k.compute_like), (w_kept, b_kept)


def _entry_name(name: str, k: _KernelTypes, p_like: Any) -> str:
    """The key in ``k.entries`` of the address entry ``name`` for parameters stored as
    ``p_like``: those stored in x's half dtype make another specialization."""
    return name if p_like is k.compute_like else f"{name}, half parameters"


#: The functions :func:`prepare` makes, by op and family (``centre`` tells the two norms apart).
_PREPARED: Final[dict[str, dict[str, Callable[[Plan, _KernelTypes, bool], Any]]]] = {
    "layer_norm": {"numpy": _prepared_array_rows, "torch": _prepared_tensor_rows},
    "rms_norm": {"numpy": _prepared_array_rows, "torch": _prepared_tensor_rows},
    "add_layer_norm": {"numpy": _prepared_array_add_rows, "torch": _prepared_tensor_add_rows},
    "add_rms_norm": {"numpy": _prepared_array_add_rows, "torch": _prepared_tensor_add_rows},
}


def _normalize(
    x: Any, weight: Any, bias: Any, plan: Plan, out: Any, centre: bool
) -> tuple[Any, Any, Any]:
    """Both ops: ``centre`` subtracts the row mean (LayerNorm), else none (RMSNorm)."""
    k = _kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    torch_family = plan.family == "torch"
    if torch_family:
        _refuse_graph(plan)
        n = k.element.itemsize
        if (
            _serial(plan, k)
            and _addressable(x, n)
            # out: separate memory (the core passes x's very memory or none of it), as the
            # kernels write y beside x; in place goes through the views, which pass no y
            and (out is None or (_addressable(out, n) and out.data_ptr() != x.data_ptr()))
        ):
            return _normalize_at(x, weight, bias, plan, k, centre, out)
        bfloat16 = plan.dtype == "bfloat16"
        x_np = _tensor_as_numpy(x, bfloat16)
        out_np = None if out is None else _tensor_as_numpy(out, bfloat16)
        weight = _tensor_parameter(weight, k.compute)
        bias = _tensor_parameter(bias, k.compute)
    else:
        x_np, out_np = x, out
    w = k.ones if weight is None else _parameter(weight, k.compute)
    b = k.zeros if bias is None else _parameter(bias, k.compute)
    mean = np.empty(plan.rows, k.stats) if plan.return_stats and centre else k.no_stats
    rstd = np.empty(plan.rows, k.stats) if plan.return_stats else k.no_stats
    y_np = output_pool.POOL.empty((plan.rows, plan.cols), x_np.dtype) if out_np is None else out_np
    in_place = out_np is not None and _same_memory(x_np, y_np)
    x_bits = x_np if k.bits is None else x_np.view(k.bits)
    y_bits = None if in_place else y_np if k.bits is None else y_np.view(k.bits)
    args = (x_bits, y_bits, w, b, plan.eps, mean, rstd, centre)
    # one short row runs on one thread: it does not take the pool from another caller
    threads = POOL.acquire(plan.rows * plan.cols if k.long or plan.rows > 1 else 0)
    try:
        if k.long and threads > 1:
            _long_rows_parallel(args, threads)
        elif k.long:
            _long_rows(args)
        elif threads > 1:
            _rows_parallel(args, threads)
        else:
            layer_norm_rows(*args, 0, plan.rows)
    finally:
        POOL.release(threads)
    mean_out = mean if plan.return_stats and centre else None
    rstd_out = rstd if plan.return_stats else None
    if not torch_family:
        return y_np, mean_out, rstd_out
    import torch

    y = out if out is not None else _numpy_as_tensor(y_np, plan.dtype)
    return (
        y,
        None if mean_out is None else torch.from_numpy(mean_out),
        None if rstd_out is None else torch.from_numpy(rstd_out),
    )


def add_layer_norm(
    x: Any, residual: Any, weight: Any, bias: Any, *, plan: Plan, out: Any, residual_out: Any
) -> tuple[Any, Any, Any, Any]:
    """``h = x + residual`` (rounded to x's dtype), then LayerNorm of ``h``, in one pass over
    each row (:mod:`normlab.backends.numba_fused`); see :mod:`normlab.hookspecs`.

    ``x``, ``residual``, ``out`` and ``residual_out``: 2-D, any strides, NumPy arrays or (the
    caller named this backend) CPU tensors. ``out`` may be the memory of x or residual, and
    ``residual_out`` that of residual or x. Returns ``(y, h, mean, rstd)``, h None unless
    ``plan.return_residual``.
    """
    return _add_normalize(x, residual, weight, bias, plan, out, residual_out, centre=True)


def add_rms_norm(
    x: Any, residual: Any, weight: Any, bias: None, *, plan: Plan, out: Any, residual_out: Any
) -> tuple[Any, Any, None, Any]:
    """``h = x + residual``, then RMSNorm of ``h``: as :func:`add_layer_norm` without the
    centring; returns ``(y, h, None, rstd)``."""
    y, h, _, rstd = _add_normalize(x, residual, weight, None, plan, out, residual_out, False)
    return y, h, None, rstd


def _add_normalize(
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    plan: Plan,
    out: Any,
    residual_out: Any,
    centre: bool,
) -> tuple[Any, Any, Any, Any]:
    """Both fused ops: ``centre`` subtracts the row mean (LayerNorm), else none (RMSNorm)."""
    k = _kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    long = k.long
    torch_family = plan.family == "torch"
    if torch_family:
        _refuse_graph(plan)
        n = k.element.itemsize
        if (  # the fused kernels write y and h over x or residual themselves (in place)
            _serial(plan, k)
            and _addressable(x, n)
            and _addressable(residual, n)
            and (out is None or _addressable(out, n))
            and (residual_out is None or _addressable(residual_out, n))
        ):
            return _add_normalize_at(x, residual, weight, bias, plan, k, centre, out, residual_out)
        bfloat16 = plan.dtype == "bfloat16"
        x_np, r_np = _tensor_as_numpy(x, bfloat16), _tensor_as_numpy(residual, bfloat16)
        out_np = None if out is None else _tensor_as_numpy(out, bfloat16)
        h_out_np = None if residual_out is None else _tensor_as_numpy(residual_out, bfloat16)
        weight = _tensor_parameter(weight, k.compute)
        bias = _tensor_parameter(bias, k.compute)
    else:
        x_np, r_np, out_np, h_out_np = x, residual, out, residual_out
    w = k.ones if weight is None else _parameter(weight, k.compute)
    b = k.zeros if bias is None else _parameter(bias, k.compute)
    mean = np.empty(plan.rows, k.stats) if plan.return_stats and centre else k.no_stats
    rstd = np.empty(plan.rows, k.stats) if plan.return_stats else k.no_stats
    shape = (plan.rows, plan.cols)
    y_np = output_pool.POOL.empty(shape, x_np.dtype) if out_np is None else out_np
    h_np = None
    if plan.return_residual:
        h_np = output_pool.POOL.empty(shape, x_np.dtype) if h_out_np is None else h_out_np
    if k.bits is None:
        x_bits, r_bits, y_bits, h_bits = x_np, r_np, y_np, h_np
    else:
        x_bits, r_bits, y_bits = x_np.view(k.bits), r_np.view(k.bits), y_np.view(k.bits)
        h_bits = None if h_np is None else h_np.view(k.bits)
    threads = POOL.acquire(plan.rows * plan.cols if long or plan.rows > 1 else 0)
    try:
        if long:
            # not fused: h into its output (or, not returned, into y), then normalized from there
            h_target = y_bits if h_bits is None else h_bits
            _add_rows((x_bits, r_bits, h_target), threads)
            in_place = None if h_bits is None else y_bits
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
    if not torch_family:
        return y_np, h_np, mean_out, rstd_out
    import torch

    y = out if out is not None else _numpy_as_tensor(y_np, plan.dtype)
    h = None
    if h_np is not None:
        h = residual_out if residual_out is not None else _numpy_as_tensor(h_np, plan.dtype)
    return (
        y,
        h,
        None if mean_out is None else torch.from_numpy(mean_out),
        None if rstd_out is None else torch.from_numpy(rstd_out),
    )


def _add_rows(args: tuple[np.ndarray, np.ndarray, np.ndarray], threads: int) -> None:
    """``h = x + residual`` of every row (``args``: x, residual, h) on ``threads`` threads."""
    if threads > 1:
        load_serial_first(add_rows_parallel, args, (add_rows, (*args, 0, 0)))
        add_rows_parallel(*args, threads)
    else:
        add_rows(*args, 0, args[0].shape[0])


@dataclass(frozen=True, slots=True)
class _KernelTypes:
    """What the forward kernels take for one (dtype, stats dtype, cols): the compute dtype, the
    integer type of half bit patterns (None: x's own), the stand-ins of an absent weight and
    bias and their addresses, the empty statistics array, whether rows take the segmented
    (long) form, and empty arrays of the kernels' element type of x (``element``) and of the
    compute dtype (``compute_like``): the types of :mod:`numba_addressed`'s entries, with the
    entry points of those already run (``entries``, by name; see :func:`_entry_point`; their
    serial kernels were loaded first, see :func:`load_serial_first`)."""

    compute: np.dtype[Any]
    bits: type | None
    stats: np.dtype[Any]
    long: bool
    ones: np.ndarray
    zeros: np.ndarray
    no_stats: np.ndarray
    element: np.ndarray
    compute_like: np.ndarray
    ones_at: int
    zeros_at: int
    half_ones: np.ndarray | None
    half_zeros: np.ndarray | None
    half_ones_at: int
    half_zeros_at: int
    entries: dict[str, Any]


@functools.lru_cache(maxsize=16)
def _kernel_types(dtype: str, stats_dtype: str, cols: int) -> _KernelTypes:
    """The :class:`_KernelTypes` of a call (cached: a repeated call reads one entry). The 16
    entries keep at most 32 stand-ins alive besides :func:`_constant`'s: 32 MiB at most."""
    compute: type = np.float64 if dtype == "float64" else np.float32
    stats: type = np.float64 if stats_dtype == "float64" else np.float32
    long = cols * np.dtype(compute).itemsize > LONG_ROW_BYTES
    stand_in = SEGMENT if long else cols  # the length of an absent weight or bias
    bits = _BITS.get(dtype)
    ones, zeros = _constant(stand_in, compute, 1.0), _constant(stand_in, compute, 0.0)
    half_ones = None if bits is None else _half_constant(stand_in, dtype, 1.0)
    half_zeros = None if bits is None else _half_constant(stand_in, dtype, 0.0)
    return _KernelTypes(
        compute=np.dtype(compute),
        bits=bits,
        stats=np.dtype(stats),
        long=long,
        ones=ones,
        zeros=zeros,
        no_stats=_no_stats(stats),
        element=np.empty((0, 0), bits or np.dtype(dtype)),
        compute_like=np.empty(0, compute),
        ones_at=ones.ctypes.data,
        zeros_at=zeros.ctypes.data,
        half_ones=half_ones,
        half_zeros=half_zeros,
        half_ones_at=0 if half_ones is None else half_ones.ctypes.data,
        half_zeros_at=0 if half_zeros is None else half_zeros.ctypes.data,
        entries={},
    )


def to_numpy(a: np.ndarray) -> np.ndarray:
    """NumPy arrays are already NumPy."""
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    """A NumPy copy of ``a`` (numba serves NumPy arrays; tests may mutate the copy freely)."""
    return np.array(a, copy=True)


def _as_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` itself, or a view of its bit patterns for float16/bfloat16 (any strides)."""
    bits = _BITS.get(dtype)
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


def _parameter(p: Any, compute: Any) -> np.ndarray:
    """A weight or bias as a contiguous compute-dtype array (``p`` itself when it is one)."""
    if p.dtype == compute and p.flags.c_contiguous:
        return p  # type: ignore[no-any-return]
    return np.ascontiguousarray(p, dtype=compute)


@functools.lru_cache(maxsize=32)
def _constant(length: int, compute: type, fill: float) -> np.ndarray:
    """A cached array of ``length`` times ``fill`` (the weight or bias of a call without one):
    at most LONG_ROW_BYTES each, so the cache holds at most 32 MiB."""
    return np.full(length, fill, dtype=compute)


@functools.lru_cache(maxsize=32)
def _half_constant(length: int, dtype: str, fill: float) -> np.ndarray:
    """:func:`_constant` in the bit patterns of the half ``dtype`` (``fill`` is exact in it)."""
    wide = np.full(length, fill, np.float32)
    if dtype == "float16":
        return wide.astype(np.float16).view(np.int16)
    return (wide.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: float32's upper half


@functools.lru_cache(maxsize=2)
def _no_stats(dtype: type) -> np.ndarray:
    """An empty statistics array: the kernels skip writing statistics into it."""
    return np.empty(0, dtype)


def layer_norm_backward(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, *, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any, Any]:
    """LayerNorm's gradients of the 2-D ``x`` (any strides); see :mod:`normlab.backward`."""
    if plan.family == "torch":
        return _tensors(dy, x, mean, rstd, weight, plan, needs)
    return _backward(dy, x, mean, rstd, weight, plan, needs)


def rms_norm_backward(
    dy: Any, x: Any, rstd: Any, weight: Any, *, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any]:
    """RMSNorm's gradients of the 2-D ``x`` (any strides); see :mod:`normlab.backward`."""
    if plan.family == "torch":
        dx, dweight, _ = _tensors(dy, x, None, rstd, weight, plan, needs - {"bias"})
    else:
        dx, dweight, _ = _backward(dy, x, None, rstd, weight, plan, needs - {"bias"})
    return dx, dweight


def _backward(
    dy: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray | None,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Both ops on NumPy arrays (``mean`` None: RMSNorm); weight already in the compute dtype
    when it comes from a tensor."""
    compute = np.float64 if plan.compute_dtype == "float64" else np.float32
    rows, cols = plan.rows, plan.cols
    chunks = -(-rows // ROW_CHUNK)
    w = None if weight is None else _parameter(weight, compute)
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


def _tensors(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any, Any]:
    """CPU tensors: zero-copy NumPy views in, tensors out (none may require grad)."""
    import torch

    _refuse_grad(dy, x, mean, rstd, weight)
    compute = np.float64 if plan.compute_dtype == "float64" else np.float32
    dx, dweight, dbias = _backward(
        _tensor_as_numpy(dy, plan.dtype == "bfloat16"),
        _tensor_as_numpy(x, plan.dtype == "bfloat16"),
        None if mean is None else mean.numpy(),
        rstd.numpy(),
        _tensor_parameter(weight, compute),
        plan,
        needs,
    )
    return (
        None if dx is None else _numpy_as_tensor(dx, plan.dtype),
        None if dweight is None else torch.from_numpy(dweight),
        None if dbias is None else torch.from_numpy(dbias),
    )


# --------------------------------------------------------------------------------------------
# Torch CPU tensors, served zero-copy when the caller names this backend.


def _serial(plan: Plan, k: _KernelTypes) -> bool:
    """Whether a call runs on the calling thread whatever the pool's state (short rows, and
    one row or fewer than :data:`SERIAL_ELEMENTS` elements): the case of the address entries."""
    return not k.long and (plan.rows == 1 or plan.rows * plan.cols < SERIAL_ELEMENTS)


def _normalize_at(
    x: Any, weight: Any, bias: Any, plan: Plan, k: _KernelTypes, centre: bool, out: Any
) -> tuple[Any, Any, Any]:
    """:func:`_normalize` of a C-contiguous tensor ``x`` on the calling thread, without NumPy
    views: the tensors' addresses go to :func:`numba_addressed.layer_norm_rows_at`. ``y`` is
    ``out`` (C-contiguous, separate from x) or a fresh tensor; the statistics are NumPy arrays
    the kernel writes, returned as tensors."""
    params, kept = _tensor_params(weight, bias, k, _torch_compute(k.compute), x), None
    if params is None:
        params, kept = _converted_params(weight, bias, k)
    w_at, b_at, p_like = params
    y = _torch().empty_like(x) if out is None else out
    return_stats = plan.return_stats
    mean = np.empty(plan.rows, k.stats) if return_stats and centre else k.no_stats
    rstd = np.empty(plan.rows, k.stats) if return_stats else k.no_stats
    e = k.element
    args = (
        e, k.compute_like, p_like, x.data_ptr(), y.data_ptr(), w_at, b_at,
        plan.rows, plan.cols, float(plan.eps), mean, rstd, centre, 0, plan.rows,
    )  # fmt: skip
    name = _entry_name("layer_norm_rows_at", k, p_like)
    entry = k.entries.get(name)
    if entry is not None:
        entry(*args)
    else:  # see load_serial_first: the kernel's own copy runs
        layer_norm_rows(e, e, k.ones, k.zeros, 0.0, k.no_stats, k.no_stats, centre, 0, 0)
        k.entries[name] = _entry_point(layer_norm_rows_at, args)
    del kept  # converted weight and bias lived until the kernel returned
    if not return_stats:
        return y, None, None
    return y, _torch().from_numpy(mean) if centre else None, _torch().from_numpy(rstd)


def _add_normalize_at(
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    plan: Plan,
    k: _KernelTypes,
    centre: bool,
    out: Any,
    residual_out: Any,
) -> tuple[Any, Any, Any, Any]:
    """:func:`_add_normalize` of C-contiguous tensors ``x`` and ``residual`` on the calling
    thread, without NumPy views (as :func:`_normalize_at`, with
    :func:`numba_addressed.add_norm_rows_at`); ``y`` is ``out`` and ``h`` ``residual_out``
    (C-contiguous; the memory of an input or separate), else fresh tensors."""
    params, kept = _tensor_params(weight, bias, k, _torch_compute(k.compute), x), None
    if params is None:
        params, kept = _converted_params(weight, bias, k)
    w_at, b_at, p_like = params
    empty_like = _torch().empty_like
    y = empty_like(x) if out is None else out
    h = residual_out
    if h is None and plan.return_residual:
        h = empty_like(x)
    mean = np.empty(plan.rows, k.stats) if plan.return_stats and centre else k.no_stats
    rstd = np.empty(plan.rows, k.stats) if plan.return_stats else k.no_stats
    e = k.element
    h_like = None if h is None else e
    args = (
        e, k.compute_like, p_like, h_like, x.data_ptr(), residual.data_ptr(), y.data_ptr(),
        0 if h is None else h.data_ptr(), w_at, b_at, plan.rows, plan.cols, float(plan.eps),
        mean, rstd, centre, 0, plan.rows,
    )  # fmt: skip
    name = _entry_name("add_norm_rows_at" if h is None else "add_norm_rows_at with h", k, p_like)
    entry = k.entries.get(name)
    if entry is not None:
        entry(*args)
    else:  # see load_serial_first: the kernel's own copy runs
        add_norm_rows(e, e, e, h_like, k.ones, k.zeros, 0.0, k.no_stats, k.no_stats, centre, 0, 0)
        k.entries[name] = _entry_point(add_norm_rows_at, args)
    del kept  # converted weight and bias lived until the kernel returned
    if not plan.return_stats:
        return y, h, None, None
    torch = _torch()
    return y, h, torch.from_numpy(mean) if centre else None, torch.from_numpy(rstd)


def _tensor_address(p: Any, k: _KernelTypes, absent: int) -> tuple[int, Any]:
    """The address of a weight or bias tensor as ``cols`` contiguous compute-dtype elements
    (``absent`` when ``p`` is None), and the converted copy to keep alive while the kernel
    runs (None when ``p`` is read in place)."""
    if p is None:
        return absent, None
    if p.dtype is _torch_compute(k.compute) and p.is_contiguous():
        address = p.data_ptr()
        if address % k.compute.itemsize == 0:
            return address, None
    # Tensor.float() / .double(): half the time of .to(dtype); a no-op on the target dtype
    kept = p.float() if k.compute.itemsize == 4 else p.double()
    if not _addressable(kept, k.compute.itemsize):  # strided or misaligned
        kept = kept.clone(memory_format=_torch().contiguous_format)
    return kept.data_ptr(), kept


def _entry_point(kernel: Any, args: tuple[Any, ...]) -> Any:
    """Run ``kernel`` on ``args`` through numba's dispatcher (which compiles or loads the
    signature of their types) and return that signature's entry point: the compiled function
    itself, without the dispatcher's typing of every argument (about a third of a µs of 14).

    Only for the address entries, where every array argument is the backend's own (the
    kernel-type stand-ins, the statistics: each of one fixed numba type per
    :class:`_KernelTypes`), the caller's memory travels as integers and eps as a float: the
    types of a later call's arguments are those of ``args``, so numba's dispatch would pick
    this very entry."""
    kernel(*args)
    return kernel.get_overload(tuple(kernel.typeof_pyval(a) for a in args))


def _addressable(t: Any, itemsize: int) -> bool:
    """Whether the tensor ``t`` is C-contiguous memory aligned to ``itemsize``, as
    :mod:`numba_addressed` reads it."""
    return t.is_contiguous() and t.data_ptr() % itemsize == 0  # type: ignore[no-any-return]


def _refuse_graph(plan: Plan) -> None:
    """A forward call whose tensors require grad, in grad mode, never reaches the kernels (the
    core runs such calls through normlab's custom ops, with detached tensors): refused, never
    detached."""
    if plan.requires_grad and _torch().is_grad_enabled():
        raise BackendError(_NO_GRAPH)


def _refuse_grad(*tensors: Any) -> None:
    """:func:`_refuse_graph` of a backward call, from its tensors."""
    import torch

    needs_graph = tensors[0].requires_grad
    if not needs_graph and torch.is_grad_enabled():
        for t in tensors[1:]:  # a loop: any() over a generator costs a third of a µs more
            if t is not None and t.requires_grad:
                needs_graph = True
                break
    if needs_graph:
        raise BackendError(_NO_GRAPH)


_NO_GRAPH: Final = (
    "the numba backend does not record autograd graphs, and a tensor of this call requires "
    "grad; call normlab's functions (which keep the graph through normlab's custom ops), use "
    "backend='torch', or pass detached tensors"
)


#: torch's dtype of each NumPy compute dtype, filled on the first tensor call (an import
#: statement per call costs more than the lookup).
_TORCH_COMPUTE: dict[np.dtype[Any], Any] = {}


def _tensor_parameter(p: Any, compute: Any) -> np.ndarray | None:
    """A weight or bias tensor as a compute-dtype NumPy array (``cols`` elements; a copy only
    when its dtype differs). Detaching is safe here: grad mode is off if ``p`` requires grad."""
    if p is None:
        return None
    target = _torch_compute(compute)
    if p.dtype is target and not p.requires_grad:
        return p.numpy()  # type: ignore[no-any-return]
    return np.asarray(p.detach().to(target).numpy())


def _torch_compute(compute: np.dtype[Any]) -> Any:
    """torch's dtype of the NumPy compute dtype ``compute``."""
    target = _TORCH_COMPUTE.get(compute)
    if target is None:
        torch = _torch()
        target = _TORCH_COMPUTE[compute] = torch.float64 if compute == np.float64 else torch.float32
    return target


def _torch() -> Any:
    """The torch module (imported by the caller: these arguments are tensors)."""
    return sys.modules["torch"]


def _tensor_as_numpy(t: Any, bfloat16: bool) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory, strides kept; a ``bfloat16`` tensor (the plan's
    dtype says which) as uint16 bit patterns."""
    if bfloat16:
        import torch

        return np.asarray(t.view(torch.int16).numpy()).view(np.uint16)
    return t.numpy()  # type: ignore[no-any-return]


def _numpy_as_tensor(a: np.ndarray, dtype: str) -> Any:
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
