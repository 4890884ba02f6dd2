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

:func:`plan` validates a call into a :class:`BackwardPlan` (cached by the arguments' metadata);
:func:`gradients` runs it on the backend that :func:`normlab.dispatch.choose` picks, exactly as
the forward ops are chosen (op names ``layer_norm_backward`` and ``rms_norm_backward``).

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

import math
from dataclasses import dataclass
from typing import Any, Final

from normlab import arrays, dispatch, layout, spec
from normlab.errors import ArgumentError, DeviceError, DtypeError, ShapeError
from normlab.spec import Plan

__all__ = ["BackwardPlan", "clear_cache", "gradients", "plan", "run"]

#: The gradients each backward op can return, in the order it returns them.
GRADIENTS: Final = {
    "layer_norm_backward": ("x", "weight", "bias"),
    "rms_norm_backward": ("x", "weight"),
}
_PLAN_CACHE_SIZE: Final = 1024


@dataclass(frozen=True, slots=True)
class BackwardPlan:
    """A validated backward call: the :class:`~normlab.spec.Plan` a backend sees (``op`` is the
    backward op; ``eps`` is unused), ``dy``'s layout, and the gradients asked for."""

    plan: Plan
    dy_strides: tuple[int, int] | None
    needs: frozenset[str]
    permuted_shape: tuple[int, ...]
    inverse: tuple[int, ...] | None


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
    bplan = plan(op, dy, x, mean, rstd, weight, normalized_shape, axis, needs)
    dx, dweight, dbias = gradients(bplan, dy, x, mean, rstd, weight, backend)
    like = x if weight is None else weight
    return dx, _cast(dweight, like), _cast(dbias, like)


def gradients(
    bplan: BackwardPlan, dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, backend: str | None
) -> tuple[Any, Any, Any]:
    """Run ``bplan`` on the backend chosen for it (``backend``: a name, strict, or None).

    Returns ``(dx, dweight, dbias)``: dx in x's shape and dtype; dweight and dbias of the
    normalized shape in ``plan.compute_dtype``; None for what is not in ``bplan.needs``.
    """
    p = bplan.plan
    choice = dispatch.choose(p, backend)
    if not bplan.needs:
        return None, None, None
    if p.empty:
        return _empty(bplan, x)
    caps = choice.backend.capabilities
    if p.non_native:  # dy and x are copied by _rows
        mean, rstd, weight = layout.native(mean), layout.native(rstd), layout.native(weight)
    dy2 = _rows(dy, p, bplan.dy_strides, "dy" not in p.non_native, caps)
    x2 = _rows(x, p, p.x_strides, "x" not in p.non_native, caps)
    rstd1 = arrays.reshape(rstd, (p.rows,))
    weight1 = layout._flat(weight, p)
    function = choice.backend.function(p.op)
    try:
        if p.op == "rms_norm_backward":
            dx2, dweight = function(dy2, x2, rstd1, weight1, plan=p, needs=bplan.needs)
            dbias = None
        else:
            dx2, dweight, dbias = function(
                dy2, x2, arrays.reshape(mean, (p.rows,)), rstd1, weight1, plan=p, needs=bplan.needs
            )
    except SystemExit as exc:  # a kernel's sys.exit() must not end the caller
        raise layout.kernel_failure(choice.backend, p.op, exc) from exc
    dx = None
    if dx2 is not None:
        dx = arrays.reshape(dx2, bplan.permuted_shape)
        if bplan.inverse is not None:
            dx = arrays.permute(dx, bplan.inverse)
    return dx, _unflat(dweight, p), _unflat(dbias, p)


def _rows(
    a: Any, p: Plan, strides: tuple[int, int] | None, native: bool, caps: frozenset[str]
) -> Any:
    """``a`` as 2-D rows; a C-contiguous copy only when the backend cannot read its layout."""
    if p.permutation is not None:
        a = arrays.permute(a, p.permutation)
    if not native or not layout._reads(caps, strides, p):
        a = arrays.contiguous(a)
    return arrays.reshape(a, (p.rows, p.cols))


def _unflat(g: Any, p: Plan) -> Any:
    if g is None or len(p.normalized_shape) == 1:
        return g
    return arrays.reshape(g, p.normalized_shape)


def _cast(g: Any, like: Any) -> Any:
    """``g`` in the dtype of the array ``like`` (no copy when it already is)."""
    if g is None or g.dtype == like.dtype:
        return g
    return arrays.astype(g, like.dtype)


def _empty(bplan: BackwardPlan, x: Any) -> tuple[Any, Any, Any]:
    """No rows or no columns: an empty dx and zero sums; no kernel is launched."""
    import array_api_compat

    p = bplan.plan
    xp = array_api_compat.array_namespace(x)
    device = array_api_compat.device(x)
    dtype = getattr(xp, p.compute_dtype)
    dx = xp.empty_like(x) if "x" in bplan.needs else None
    dweight, dbias = (
        xp.zeros(p.normalized_shape, dtype=dtype, device=device) if name in bplan.needs else None
        for name in ("weight", "bias")
    )
    return dx, dweight, None if p.op == "rms_norm_backward" else dbias


# --------------------------------------------------------------------------------------------
# Validation. Cached by metadata, as spec.plan is; only a cache miss reaches the rules.

_cache: dict[tuple[Any, ...], BackwardPlan] = {}


def plan(
    op: str,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    normalized_shape: Any,
    axis: Any,
    needs: Any,
) -> BackwardPlan:
    """Validate a backward call and return its :class:`BackwardPlan`."""
    key: tuple[Any, ...] | None
    try:
        key = (
            op,
            *(None if a is None else spec._param_key(a) for a in (dy, x, mean, rstd, weight)),
            spec._dims_key(normalized_shape) if normalized_shape is not None else None,
            spec._dims_key(axis) if axis is not None else None,
            type(needs),
            tuple(needs) if isinstance(needs, (tuple, list)) else needs,
        )
        cached = _cache.get(key)
    except Exception:  # unhashable, not an array, or an odd tensor: validate the slow way
        key, cached = None, None
    if cached is not None:
        return cached
    result = _validate(op, dy, x, mean, rstd, weight, normalized_shape, axis, needs)
    if key is not None:
        if len(_cache) >= _PLAN_CACHE_SIZE:
            _cache.clear()
        _cache[key] = result
    return result


def clear_cache() -> None:
    """Forget every cached backward plan."""
    _cache.clear()


def _validate(
    op: str,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    normalized_shape: Any,
    axis: Any,
    needs: Any,
) -> BackwardPlan:
    if op not in GRADIENTS:
        raise ArgumentError(f"unknown op {op!r}; normlab provides {', '.join(GRADIENTS)}")
    wanted = _check_needs(op, needs)
    xi = spec._array_info("x", x)
    spec._check_float("x", xi)
    if xi.ndim == 0:
        raise ShapeError("x is 0-d (a scalar); the backward needs at least one normalized axis")
    axes = spec._normalized_axes(xi.shape, normalized_shape, axis)
    batch_axes = tuple(a for a in range(xi.ndim) if a not in axes)
    norm_shape = tuple(xi.shape[a] for a in axes)
    compute = spec.stats_dtype_for(xi.dtype)
    dyi = _check_like("dy", dy, xi, xi.shape, xi.dtype)
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(xi.shape))
    stats = [("rstd", rstd)] if op == "rms_norm_backward" else [("mean", mean), ("rstd", rstd)]
    infos = [_check_like(name, s, xi, stats_shape, compute) for name, s in stats]
    weight_dtype = spec._check_param("weight", weight, xi, norm_shape)
    requires_grad = any(i.requires_grad for i in (xi, dyi, *infos)) or (
        weight is not None and arrays.info(weight).requires_grad
    )
    order = batch_axes + axes
    permutation = None if order == tuple(range(xi.ndim)) else order
    p = Plan(
        op=op,
        family=xi.family,
        device=xi.device,
        device_kind=xi.device_kind,
        dtype=xi.dtype,
        shape=xi.shape,
        axes=axes,
        batch_axes=batch_axes,
        normalized_shape=norm_shape,
        rows=math.prod(xi.shape[a] for a in batch_axes),
        cols=math.prod(norm_shape),
        compute_dtype=compute,
        stats_dtype=compute,
        weight_dtype=weight_dtype,
        bias_dtype=None,
        eps=0.0,
        return_stats=False,
        requires_grad=requires_grad,
        permutation=permutation,
        x_strides=spec.row_view_strides(xi.shape, xi.strides, batch_axes, axes),
        x_native=xi.native_byte_order,
        has_out=False,
        out_strides=None,
        out_stats=(False, False),
        dispatch_key=(op, xi.family, xi.device_kind, xi.dtype, requires_grad),
        non_native=spec.non_native(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight),
    )
    return BackwardPlan(
        plan=p,
        dy_strides=spec.row_view_strides(dyi.shape, dyi.strides, batch_axes, axes),
        needs=wanted,
        permuted_shape=tuple(xi.shape[a] for a in order),
        inverse=None if permutation is None else tuple(order.index(a) for a in range(xi.ndim)),
    )


def _check_needs(op: str, needs: Any) -> frozenset[str]:
    known = GRADIENTS[op]
    if isinstance(needs, str) or not isinstance(needs, (tuple, list, set, frozenset)):
        raise ArgumentError(
            f"needs must be a tuple of gradient names ({', '.join(map(repr, known))}), "
            f"got {needs!r}"
        )
    unknown = [n for n in needs if n not in known]
    if unknown:
        raise ArgumentError(
            f"needs names {', '.join(map(repr, unknown))}; {op} returns gradients for "
            f"{', '.join(map(repr, known))}"
        )
    return frozenset(needs)


def _check_like(
    name: str, a: Any, xi: arrays.ArrayInfo, shape: tuple[int, ...], dtype: str
) -> arrays.ArrayInfo:
    """``a`` must be an array of x's library and device, with this shape and dtype."""
    ai = spec._array_info(name, a)
    if ai.family != xi.family:
        raise DeviceError(
            f"{name} is a {ai.type_name} but x is a {xi.type_name}; pass {name} from the same "
            f"array library as x (normlab never converts between libraries)"
        )
    if ai.device != xi.device:
        raise DeviceError(f"{name} is on device {ai.device} but x is on {xi.device}")
    if ai.masked or ai.dtype != dtype:
        kind = "a masked array" if ai.masked else f"dtype {ai.dtype}"
        raise DtypeError(f"{name} has {kind}; for x of dtype {xi.dtype} it must be {dtype}")
    if ai.shape != shape:
        what = "x's shape" if shape == xi.shape else "x's shape with 1 on the normalized axes"
        raise ShapeError(
            f"{name} has shape {ai.shape}; it must be {shape} ({what}; x has shape {xi.shape})"
        )
    return ai
