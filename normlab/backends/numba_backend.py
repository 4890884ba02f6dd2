"""The Numba backend: fused, parallel JIT kernels for NumPy arrays (and CPU tensors, zero-copy).

This is the module the registry loads: the backend's functions (see :mod:`normlab.hookspecs`),
each written once for every array family. An entry computes the call's kernel types
(:mod:`normlab.backends.numba_kernel_types`) and hands the call to the adapter of
``plan.family`` (:class:`~normlab.backends.numba_family.Family`): NumPy arrays
(:mod:`normlab.backends.numba_arrays`), or CPU torch tensors when the caller named this backend
or the dispatcher chose it for them (:mod:`normlab.backends.numba_tensors`: by address, else
through NumPy views; the results are tensors). ``layer_norm`` and ``rms_norm`` run the same
forward kernels (:mod:`normlab.backends.numba_forward`), RMSNorm without the centring; so do
their backward ops with the backward kernels (:mod:`normlab.backends.numba_backward`) and the
fused ops with theirs (:mod:`normlab.backends.numba_fused`). :func:`prepare` makes the direct
route's function of a plan that runs on the calling thread.

Threads (:mod:`normlab.backends.numba_pool`, whose :data:`POOL`, :class:`Pool`,
:data:`SERIAL_ELEMENTS`, :data:`FORWARD_SERIAL_ELEMENTS` and :func:`load_serial_first` this
module names too): inputs of fewer than :data:`SERIAL_ELEMENTS` elements run on the calling
thread, larger ones on ``numba.get_num_threads()`` threads (a contiguous range of rows, or of
row segments for long rows, each) — unless another thread is inside the parallel kernels at
that moment, or this process is a child forked after its parent went parallel: then on the
calling thread. The results are the same bits either way.

Importing this module sets numba up for the kernels: the installed distributions' numba
extensions are read once (a broken one is a warning, not a failed call), a slow compile says so
(:mod:`normlab.backends.compile_notices`), and every kernel module is adopted into normlab's
on-disk cache (:mod:`normlab.backends.numba_cache`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from normlab.backends import (
    compile_notices,
    half_bits,
    numba_addressed,
    numba_backward,
    numba_cache,
    numba_forward,
    numba_fused,
    numba_quantize,
    output_pool,
)
from normlab.backends.numba_arrays import ARRAYS, rows_parallel
from normlab.backends.numba_family import Family
from normlab.backends.numba_kernel_types import constant, kernel_types, no_stats
from normlab.backends.numba_pool import (
    FORWARD_SERIAL_ELEMENTS,
    POOL,
    SERIAL_ELEMENTS,
    Pool,
    always_serial,
    load_serial_first,
)
from normlab.backends.numba_quantized import quantized
from normlab.backends.numba_tensors import TENSORS
from normlab.errors import NormlabWarning
from normlab.hookspecs import Plan
from normlab.ops import OPS

__all__ = [
    "FORWARD_SERIAL_ELEMENTS",
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
    "quantized",
    "rms_norm",
    "rms_norm_backward",
    "threading_layer",
    "to_numpy",
]

numba_cache.adopt(
    half_bits, numba_forward, numba_backward, numba_fused, numba_addressed, numba_quantize
)


def _init_numba_extensions() -> None:
    """numba reads every installed distribution's entry points before its first compile, to
    load its extensions; a distribution with broken metadata anywhere makes that raise, and
    numba would raise it from the first kernel compile. Run it now, where a failure is said once
    (numba does not try again) instead of failing a call."""
    from numba.core import entrypoints

    try:
        entrypoints.init_all()  # type: ignore[no-untyped-call]
    except Exception as exc:
        warnings.warn(
            f"numba could not read the installed distributions' entry points ({type(exc).__name__}:"
            f" {exc}); numba extensions are not loaded, normlab's kernels are unaffected",
            NormlabWarning,
            stacklevel=2,
        )


_init_numba_extensions()
compile_notices.watch_numba_compiles()  # a slow first call says that it is compiling

#: Each array family's adapter, by ``plan.family``.
_FAMILIES: Final[dict[str, Family]] = {"numpy": ARRAYS, "torch": TENSORS}


def layer_norm(x: Any, weight: Any, bias: Any, *, plan: Plan, out: Any) -> tuple[Any, Any, Any]:
    """Normalize each row of the 2-D ``x`` (any strides); see :mod:`normlab.hookspecs`.

    ``x`` is a NumPy array, or a CPU torch tensor; ``y``, ``mean`` and ``rstd`` are of the same
    family. ``out`` may be ``x``'s very memory.
    """
    k = kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    return _FAMILIES[plan.family].normalize(x, weight, bias, plan, k, out, True)


def rms_norm(x: Any, weight: Any, *, plan: Plan, out: Any) -> tuple[Any, Any]:
    """RMS-normalize each row of the 2-D ``x``: ``x / sqrt(mean(x^2) + eps) * weight``.

    As :func:`layer_norm` (same kernels, without the centring); returns ``(y, rstd)``.
    """
    k = kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    y, _, rstd = _FAMILIES[plan.family].normalize(x, weight, None, plan, k, out, False)
    return y, rstd


def add_layer_norm(
    x: Any, residual: Any, weight: Any, bias: Any, *, plan: Plan, out: Any, residual_out: Any
) -> tuple[Any, Any, Any, Any]:
    """``h = x + residual`` (rounded to x's dtype), then LayerNorm of ``h``, in one pass over
    each row (:mod:`normlab.backends.numba_fused`); see :mod:`normlab.hookspecs`.

    ``x``, ``residual``, ``out`` and ``residual_out``: 2-D, any strides, NumPy arrays or CPU
    tensors. ``out`` may be the memory of x or residual, and ``residual_out`` that of residual
    or x. Returns ``(y, h, mean, rstd)``, h None unless ``plan.return_residual``.
    """
    k = kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    family = _FAMILIES[plan.family]
    return family.add_normalize(x, residual, weight, bias, plan, k, out, residual_out, True)


def add_rms_norm(
    x: Any, residual: Any, weight: Any, *, plan: Plan, out: Any, residual_out: Any
) -> tuple[Any, Any, Any]:
    """``h = x + residual``, then RMSNorm of ``h``: as :func:`add_layer_norm` without the
    centring; returns ``(y, h, rstd)``."""
    k = kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    family = _FAMILIES[plan.family]
    y, h, _, rstd = family.add_normalize(
        x, residual, weight, None, plan, k, out, residual_out, False
    )
    return y, h, rstd


def layer_norm_backward(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, *, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any, Any]:
    """LayerNorm's gradients of the 2-D ``x`` (any strides); see :mod:`normlab.hookspecs`."""
    return _FAMILIES[plan.family].backward(dy, x, mean, rstd, weight, plan, needs)


def rms_norm_backward(
    dy: Any, x: Any, rstd: Any, weight: Any, *, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any]:
    """RMSNorm's gradients of the 2-D ``x`` (any strides); see :mod:`normlab.hookspecs`."""
    family = _FAMILIES[plan.family]
    dx, dweight, _ = family.backward(dy, x, None, rstd, weight, plan, needs - {"bias"})
    return dx, dweight


# --------------------------------------------------------------------------------------------
# The direct route's prepared functions


def prepare(op: str, plan: Plan) -> Callable[..., Any] | None:
    """The direct route's function of ``plan`` (see :mod:`normlab.hookspecs`): for a forward
    call that runs on the calling thread (:func:`~normlab.backends.numba_pool.always_serial`)
    without grad, the family's serial kernel with the plan's work done once; else None. It
    hands the op's function any call whose arguments it does not read as the kernel does (a
    weight to convert, a misaligned or strided tensor)."""
    arithmetic = OPS[op].arithmetic
    if arithmetic.direction != "forward" or plan.requires_grad:
        return None
    k = kernel_types(plan.dtype, plan.stats_dtype, plan.cols)
    if (
        not always_serial(plan, k)
        or plan.rows * plan.cols * k.element.itemsize >= output_pool.MIN_BYTES
    ):
        return None  # threads, or outputs the pool would give
    family = _FAMILIES.get(plan.family)
    if family is None:
        return None
    centre = arithmetic.centred
    if arithmetic.residual_add:
        add_rows = family.serial_add_rows(plan, k, centre)
        return (_prepared_add_rows if centre else _prepared_rms_add_rows)(plan, add_rows)
    rows = family.serial_rows(plan, k, centre)
    return (_prepared_rows if centre else _prepared_rms_rows)(plan, rows)


# The prepared functions of each op: ``run`` (the family's serial kernel of ``plan``, which
# returns in the op's kernel form), or the op's function where ``run`` does not read the
# arguments as they are.


def _prepared_rows(plan: Plan, run: Callable[..., Any]) -> Callable[..., Any]:
    def normalize_rows(x: Any, weight: Any, bias: Any) -> Any:
        result = run(x, weight, bias)
        if result is None:
            return layer_norm(x, weight, bias, plan=plan, out=None)
        return result

    return normalize_rows


def _prepared_rms_rows(plan: Plan, run: Callable[..., Any]) -> Callable[..., Any]:
    def rms_rows(x: Any, weight: Any) -> Any:
        result = run(x, weight, None)
        if result is None:
            return rms_norm(x, weight, plan=plan, out=None)
        return result

    return rms_rows


def _prepared_add_rows(plan: Plan, run: Callable[..., Any]) -> Callable[..., Any]:
    def add_normalize_rows(x: Any, residual: Any, weight: Any, bias: Any) -> Any:
        result = run(x, residual, weight, bias)
        if result is None:
            return add_layer_norm(x, residual, weight, bias, plan=plan, out=None, residual_out=None)
        return result

    return add_normalize_rows


def _prepared_rms_add_rows(plan: Plan, run: Callable[..., Any]) -> Callable[..., Any]:
    def add_rms_rows(x: Any, residual: Any, weight: Any) -> Any:
        result = run(x, residual, weight, None)
        if result is None:
            return add_rms_norm(x, residual, weight, plan=plan, out=None, residual_out=None)
        return result

    return add_rms_rows


# --------------------------------------------------------------------------------------------


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
                w, b = constant(1, np.float32, 1.0), constant(1, np.float32, 0.0)
                empty = no_stats(np.float32)
                rows_parallel((tiny, None, w, b, 1e-5, empty, empty, True), 2)
        finally:
            POOL.release(threads)
    from numba.np.ufunc import parallel

    requested = os.environ.get("NUMBA_THREADING_LAYER", "default")
    if POOL.unstartable is not None:
        return f"cannot start (requested: {requested}): {POOL.unstartable}; calls run serially"
    try:
        return str(parallel.threading_layer())  # type: ignore[no-untyped-call]
    except ValueError:  # no parallel kernel has run in this process
        return f"not started (requested: {requested})"


def to_numpy(a: np.ndarray) -> np.ndarray:
    """NumPy arrays are already NumPy."""
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    """A NumPy copy of ``a`` (numba serves NumPy arrays; tests may mutate the copy freely)."""
    return np.array(a, copy=True)
