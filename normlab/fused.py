"""The fused ops: ``add_layer_norm`` and ``add_rms_norm`` run on the chosen backend.

``h = x + residual`` rounded to x's dtype (bitwise the unfused add), then the base op
(:data:`normlab.ops.Op.base`) of that rounded ``h``. A backend that provides the fused op does
both in one pass over the rows; one that provides only the base op (JAX, Dask, third parties) is
served by the core's composition: the family's own add, then the backend's base op through
:func:`normlab.layout.run` (:func:`normlab.explain` says "composed"). Empty inputs are always
composed: no kernel is launched.

The layout rules are those of :mod:`normlab.layout`, for two x-like inputs (``x``,
``residual``) and two x-like outputs (``y`` into ``out``, ``h`` into ``residual_out``): rows
without a copy where the backend reads them, outputs written directly where it writes them,
else through a temporary copied in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from normlab import arrays, autograd, dispatch, layout, spec
from normlab.dispatch import Choice
from normlab.errors import NormlabError
from normlab.hookspecs import Plan
from normlab.ops import OPS
from normlab.spec import Aliasing, Layout

__all__ = ["FusedRoute", "choose", "route", "run"]


@dataclass(frozen=True, slots=True)
class FusedRoute:
    """How one backend runs one fused call: which inputs are copied (the reason, or None) and
    which outputs it writes itself."""

    function: Any
    direct: bool  # 2-D rows as given, no outputs: the backend's (prepared) function alone
    direct_out: bool  # likewise with out and/or residual_out, which the backend writes itself
    prepared: Any  # the backend's prepared function of the direct route, or None
    copies: dict[str, str | None]
    out_direct: bool
    residual_out_direct: bool
    inplace_ok: bool


def run(
    op: str,
    x: Any,
    residual: Any,
    normalized_shape: Any,
    weight: Any,
    bias: Any,
    eps: Any,
    axis: Any,
    named: str | None,
    return_stats: Any,
    return_residual: Any,
    out: Any,
    residual_out: Any,
) -> Any:
    """Validate, choose and run a fused call; returns what ``add_layer_norm`` returns."""
    call = spec.validated_fused(
        op, x, residual, normalized_shape, weight, bias, eps, axis, return_stats,
        return_residual, out, residual_out,
    )  # fmt: skip
    plan = call.plan
    choice, composed = choose(call, named)
    aliasing: Aliasing = "separate"
    if out is not None or residual_out is not None:
        out_y, out_mean, out_rstd = spec.split_out(op, out)
        aliasing = spec.output_aliasing(
            op,
            {"x": x, "residual": residual, "weight": weight, "bias": bias},
            {"y": out_y, "h": residual_out, "mean": out_mean, "rstd": out_rstd},
        )
    if composed or plan.empty:
        return _composed(call, choice, x, residual, weight, bias, out, residual_out)
    if choice.records_no_graph:  # torch tensors on a backend that records no autograd graph
        choice = autograd.through_graph(plan, choice)
    r = call.routes.get(choice.backend)
    try:
        if r is not None and r.direct:  # 2-D rows readable as they are: no views to make
            if r.prepared is not None:
                y, h, _, _ = r.prepared(x, residual, weight, bias)
            else:
                y, h, _, _ = r.function(
                    x, residual, weight, bias, plan=plan, out=None, residual_out=None
                )
            return (y, h) if plan.return_residual else y
        if r is not None and r.direct_out and layout.writes_direct(aliasing, r.inplace_ok):
            y, h, _, _ = r.function(
                x, residual, weight, bias, plan=plan, out=out, residual_out=residual_out
            )
            y = _written(out, y)
            return (y, _written(residual_out, h)) if plan.return_residual else y
        return _run(call, choice, aliasing, x, residual, weight, bias, out, residual_out)
    except NormlabError:
        raise
    except (Exception, SystemExit) as exc:  # a kernel's sys.exit() must not end the caller
        raise layout.kernel_failure(choice.backend, op, exc) from exc


def base_plan(plan: Plan) -> Plan:
    """The plan of the base op on ``h`` (same rows, dtypes, eps and statistics)."""
    base = OPS[plan.op].base
    assert base is not None, plan.op
    return dataclasses.replace(plan, op=base, return_residual=False)


def choose(call: Layout, named: str | None) -> tuple[Choice, bool]:
    """The backend for a fused call, and whether the core composes it: a backend providing the
    fused op, else (``True``) one providing the base op (:func:`normlab.dispatch.choose` decides
    and caches both). A backend that cannot serve even the base op raises the base op's
    :class:`~normlab.errors.BackendError`."""
    choice = dispatch.choose(call.plan, named)
    return choice, choice.composed


def route(call: Layout, choice: Choice) -> FusedRoute:
    """The :class:`FusedRoute` of a fused ``call`` on the chosen backend (cached on the
    Layout)."""
    backend = choice.backend
    cached = call.routes.get(backend)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    plan = call.plan
    caps = backend.capabilities
    copies = {name: layout.copy_reason(name, call, backend) for name in ("x", "residual")}
    writes = "out" in caps and not plan.requires_grad  # else the core copies (autograd records)
    rows_as_given = (
        not any(copies.values())
        and call.permutation is None
        and len(plan.axes) == 1
        and plan.shape == (plan.rows, plan.cols)
        and not plan.return_stats
        and not plan.empty
        and not call.non_native
    )
    direct = rows_as_given and not call.has_out and not call.has_residual_out
    out_direct = call.has_out and writes and layout.reads(caps, call.out_strides, plan)
    residual_out_direct = (
        call.has_residual_out and writes and layout.reads(caps, call.residual_out_strides, plan)
    )
    result = FusedRoute(
        function=backend.function(plan.op),
        direct=direct,
        direct_out=(
            rows_as_given
            and not direct
            and out_direct == call.has_out
            and residual_out_direct == call.has_residual_out
        ),
        prepared=backend.prepared(plan.op, plan) if direct else None,
        copies=copies,
        out_direct=out_direct,
        residual_out_direct=residual_out_direct,
        inplace_ok="inplace" in caps,
    )
    call.routes[backend] = result
    return result


def _run(
    call: Layout,
    choice: Choice,
    aliasing: Aliasing,
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    out: Any,
    residual_out: Any,
) -> Any:
    """The general path of :func:`run`: views, copies, ``out``, ``residual_out``, statistics."""
    plan = call.plan
    r = route(call, choice)
    out_y, out_mean, out_rstd = spec.split_out(plan.op, out)
    if call.non_native:  # x and residual themselves are copied by the route
        weight, bias = layout.native(weight), layout.native(bias)
    writes_direct = layout.writes_direct(aliasing, r.inplace_ok)
    backend_out = backend_h = None
    if out_y is not None and r.out_direct and writes_direct:
        backend_out = layout.rows(out_y, call, copy=False)
    if residual_out is not None and r.residual_out_direct and writes_direct:
        backend_h = layout.rows(residual_out, call, copy=False)
    y2, h2, mean1, rstd1 = r.function(
        layout.rows(x, call, copy=r.copies["x"] is not None),
        layout.rows(residual, call, copy=r.copies["residual"] is not None),
        layout.flat(weight, plan),
        layout.flat(bias, plan),
        plan=plan,
        out=backend_out,
        residual_out=backend_h,
    )
    y = _placed(call, y2, out_y, backend_out is not None)
    h = _placed(call, h2, residual_out, backend_h is not None) if plan.return_residual else None
    stats: tuple[Any, ...] = ()
    if plan.return_stats:
        shape = tuple(plan.shape[a] for a in plan.batch_axes) + (1,) * len(plan.axes)
        rstd = _stat(layout.from_rows(rstd1, shape, call.inverse), out_rstd)
        if "mean" in OPS[plan.op].stats_outputs:
            stats = (_stat(layout.from_rows(mean1, shape, call.inverse), out_mean), rstd)
        else:
            stats = (rstd,)
    return _returned(plan, y, h, stats)


def _written(target: Any, result: Any) -> Any:
    """The direct route's output: ``target`` (written by the backend; its library is told)
    when given, else the backend's ``result``."""
    if target is None:
        return result
    arrays.mark_written(target)
    return target


def _placed(call: Layout, result: Any, target: Any, written: bool) -> Any:
    """A backend's 2-D output in the caller's axes: ``target`` itself when given (written by the
    backend, or copied into now), else the rows reshaped."""
    if target is None:
        return layout.from_rows(result, call.permuted_shape, call.inverse)
    if written:
        arrays.mark_written(target)
    else:
        arrays.copy_into(target, layout.from_rows(result, call.permuted_shape, call.inverse))
    return target


def _stat(value: Any, target: Any) -> Any:
    if target is None:
        return value
    arrays.copy_into(target, value)
    return target


def _returned(plan: Plan, y: Any, h: Any, stats: tuple[Any, ...]) -> Any:
    """``y``, ``(y, h)``, ``(y, *stats)`` or ``(y, h, *stats)``: the fused ops' return forms."""
    head = (y, h) if plan.return_residual else (y,)
    if plan.return_stats:
        return (*head, *stats)
    return head if plan.return_residual else y


def _composed(
    call: Layout,
    choice: Choice,
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    out: Any,
    residual_out: Any,
) -> Any:
    """The fused call as the family's add, then the base op of ``h`` on the chosen backend
    (for a backend without the fused op, and for empty inputs)."""
    plan = call.plan
    h = x + residual  # the unfused add itself: rounded to x's dtype by x's library
    if residual_out is not None:
        arrays.copy_into(residual_out, h)
        h = residual_out
    base = spec.validated(
        base_plan(plan).op, h, None, weight, bias, plan.eps, plan.axes, plan.return_stats, out
    )
    base_choice = autograd.through_graph(base.plan, choice)
    result = layout.run(base, base_choice, h, weight, bias, out)
    if not plan.return_stats:
        return _returned(plan, result, h if plan.return_residual else None, ())
    return _returned(plan, result[0], h if plan.return_residual else None, tuple(result[1:]))
