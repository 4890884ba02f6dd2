"""The backward ops: gradients of layer_norm and rms_norm, validated and dispatched as the forward.

Per row, over the normalized axes, with ``x̂ = (x - mean) * rstd`` (RMSNorm: ``x̂ = x * rstd``)
and ``g = dy * weight`` (``g = dy`` without weight)::

    dx      = rstd * (g - mean(g) - x̂ * mean(g * x̂))     RMSNorm: rstd * (g - x̂ * mean(g * x̂))
    dweight = sum over rows of dy * x̂
    dbias   = sum over rows of dy                         (layer_norm only)

``mean`` and ``rstd`` are the statistics the forward returned (``return_stats=True``). Backends
refine ``mean`` by the row's residual ``mean(x - mean)``, which removes the rounding of a float32
mean on rows with a large offset. float16/bfloat16 are computed in float32 and ``dx`` is rounded
once. ``dweight``/``dbias`` are reduced deterministically: no atomics, no locks, and an order
that depends on the shape alone (never on the thread count), so repeated runs are bitwise equal.

:func:`normlab.spec.validated_backward` validates a call from the op table (:mod:`normlab.ops`) into
a :class:`~normlab.spec.Layout`; :func:`gradients` runs it on the backend that
:func:`normlab.dispatch.choose` picks, exactly as the forward ops are chosen (op names
``layer_norm_backward`` and ``rms_norm_backward``).

A backend module that lists these ops in its record defines::

    def layer_norm_backward(dy, x, mean, rstd, weight, *, plan, needs):
        '''dy, x: 2-D (plan.rows, plan.cols) arrays of the backend's family, read as the record's
        capabilities allow (a C-contiguous copy is made otherwise); mean, rstd: 1-D (plan.rows,)
        in plan.stats_dtype; weight: 1-D (plan.cols,) contiguous, or None; needs: a frozenset of
        "x", "weight", "bias". Returns (dx, dweight, dbias): dx 2-D in x's dtype, dweight and
        dbias 1-D (plan.cols,) in plan.compute_dtype; None for what is not in needs.'''

    def rms_norm_backward(dy, x, rstd, weight, *, plan, needs):
        '''The same without mean and dbias; returns (dx, dweight).'''
"""

from __future__ import annotations

from typing import Any, Final

from normlab import arrays, autograd, dispatch, layout, spec
from normlab.ops import BACKWARD_OPS, OPS
from normlab.spec import Layout, Plan

__all__ = ["GRADIENTS", "gradients", "run"]

#: The gradients each backward op can return, in the order it returns them.
GRADIENTS: Final = {op: OPS[op].gradients for op in BACKWARD_OPS}


def run(
    op: str,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    normalized_shape: Any,
    axis: Any,
    backend: str | None,
    needs: Any,
) -> tuple[Any, Any, Any]:
    """What the public backward functions return: ``(dx, dweight, dbias)``, with dweight and
    dbias in weight's dtype (x's dtype without weight); None for what is not in ``needs``."""
    call = spec.validated_backward(op, dy, x, mean, rstd, weight, normalized_shape, axis, needs)
    dx, dweight, dbias = gradients(call, dy, x, mean, rstd, weight, backend)
    like = x if weight is None else weight
    return dx, _cast(dweight, like), _cast(dbias, like)


def gradients(
    call: Layout, dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, backend: str | None
) -> tuple[Any, Any, Any]:
    """Run the backward ``call`` on the backend chosen for it (``backend``: a name, strict, or
    None).

    Returns ``(dx, dweight, dbias)``: dx in x's shape and dtype; dweight and dbias of the
    normalized shape in ``plan.compute_dtype``; None for what is not in ``call.needs``.
    """
    p = call.plan
    choice = autograd.through_graph(p, dispatch.choose(p, backend))
    if not call.needs:
        return None, None, None
    if p.empty:
        return _empty(call, x)
    if call.non_native:  # dy and x are copied to rows below
        mean, rstd, weight = layout.native(mean), layout.native(rstd), layout.native(weight)
    copy_dy = layout.copy_reason("dy", call, choice.backend)
    copy_x = layout.copy_reason("x", call, choice.backend)
    dy2 = layout.rows(dy, call, copy=copy_dy is not None)
    x2 = layout.rows(x, call, copy=copy_x is not None)
    rstd1 = arrays.reshape(rstd, (p.rows,))
    weight1 = layout.flat(weight, p)
    function = choice.backend.function(p.op)
    try:
        if p.op == "rms_norm_backward":
            dx2, dweight = function(dy2, x2, rstd1, weight1, plan=p, needs=call.needs)
            dbias = None
        else:
            dx2, dweight, dbias = function(
                dy2, x2, arrays.reshape(mean, (p.rows,)), rstd1, weight1, plan=p, needs=call.needs
            )
    except SystemExit as exc:  # a kernel's sys.exit() must not end the caller
        raise layout.kernel_failure(choice.backend, p.op, exc) from exc
    dx = None
    if dx2 is not None:
        dx = layout.from_rows(dx2, call.permuted_shape, call.inverse)
    return dx, _unflat(dweight, p), _unflat(dbias, p)


def _unflat(g: Any, p: Plan) -> Any:
    if g is None or len(p.normalized_shape) == 1:
        return g
    return arrays.reshape(g, p.normalized_shape)


def _cast(g: Any, like: Any) -> Any:
    """``g`` in the dtype of the array ``like`` (no copy when it already is)."""
    if g is None or g.dtype == like.dtype:
        return g
    return arrays.astype(g, like.dtype)


def _empty(call: Layout, x: Any) -> tuple[Any, Any, Any]:
    """No rows or no columns: an empty dx and zero sums; no kernel is launched."""
    import array_api_compat

    p = call.plan
    xp = array_api_compat.array_namespace(x)
    device = array_api_compat.device(x)
    dtype = getattr(xp, p.compute_dtype)
    dx = xp.empty_like(x) if "x" in call.needs else None
    dweight, dbias = (
        xp.zeros(p.normalized_shape, dtype=dtype, device=device) if name in call.needs else None
        for name in ("weight", "bias")
    )
    return dx, dweight, None if p.op == "rms_norm_backward" else dbias
