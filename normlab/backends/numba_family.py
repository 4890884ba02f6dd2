"""The adapter of one array family for the numba backend: :class:`Family`.

The backend's entries (:mod:`normlab.backends.numba_backend`) are written once, for every
family: each computes the call's :class:`~normlab.backends.numba_kernel_types.KernelTypes` and
hands the call to the adapter of ``plan.family``, which turns that family's arrays into the
kernels' arguments and the kernels' results into that family's arrays. Two adapters exist:
:data:`normlab.backends.numba_arrays.ARRAYS` (NumPy arrays, which the kernels read as they are)
and :data:`normlab.backends.numba_tensors.TENSORS` (CPU torch tensors: by address, else through
NumPy views of their memory).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from normlab.backends.numba_kernel_types import KernelTypes
    from normlab.hookspecs import Plan

__all__ = ["Family"]


@dataclass(frozen=True, slots=True)
class Family:
    """How the kernels read one family's arrays and give it results (no call checks anything
    that :mod:`normlab.spec` settled; ``k`` is the call's kernel types, ``centre`` tells
    LayerNorm from RMSNorm):

    - ``normalize(x, weight, bias, plan, k, out, centre) -> (y, mean, rstd)``: the norms of the
      2-D ``x`` (any strides; ``out`` None, separate, or x's very memory), statistics None
      unless ``plan.return_stats`` (mean None without ``centre``);
    - ``add_normalize(x, residual, weight, bias, plan, k, out, residual_out, centre) ->
      (y, h, mean, rstd)``: the fused ops (h None unless ``plan.return_residual``);
    - ``backward(dy, x, mean, rstd, weight, plan, needs) -> (dx, dweight, dbias)``: both
      backward ops (``mean`` None: RMSNorm), a gradient None unless ``needs`` names it;
    - ``serial_rows(plan, k, centre) -> run`` and ``serial_add_rows(plan, k, centre) -> run``,
      for the direct route's prepared functions of a plan that runs on the calling thread
      without outputs given or statistics: ``run(x, weight, bias)`` (``run(x, residual,
      weight, bias)``; bias None without ``centre``) runs the serial kernel with the plan's
      work done once and returns what the op's function returns in kernel form 2 (``(y,
      None, None)``, RMSNorm ``(y, None)``; the fused ops with h after y), or None, without
      running anything, for arguments it does not read as they are (a weight to convert, a
      misaligned tensor, a kernel not compiled yet).
    """

    normalize: Callable[[Any, Any, Any, Plan, KernelTypes, Any, bool], tuple[Any, Any, Any]]
    add_normalize: Callable[
        [Any, Any, Any, Any, Plan, KernelTypes, Any, Any, bool], tuple[Any, Any, Any, Any]
    ]
    backward: Callable[[Any, Any, Any, Any, Any, Plan, frozenset[str]], tuple[Any, Any, Any]]
    serial_rows: Callable[[Plan, KernelTypes, bool], Callable[[Any, Any, Any], Any]]
    serial_add_rows: Callable[[Plan, KernelTypes, bool], Callable[[Any, Any, Any, Any], Any]]
