"""Memory layout: from the caller's array to the 2-D rows a backend reads, and back.

A backend sees ``x`` as a 2-D ``(rows, cols)`` array: batch axes first, normalized axes last.
That view is made without a copy whenever the batch axes collapse into one stride and the
normalized axes into another, and the backend reads such strides (its ``strided`` or
``row_strided`` capability). Otherwise — and only then — ``x`` is copied to C order, and
:func:`normlab.explain` says so. ``out`` is written in place: directly when the backend writes
``out`` views of its layout, else through one temporary. The result is restored to ``x``'s shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from normlab import arrays
from normlab.dispatch import Choice
from normlab.errors import BackendError, NormlabError
from normlab.registry import Backend
from normlab.spec import Aliasing, Plan, output_aliasing, split_out

__all__ = ["Route", "native", "route", "run"]


@dataclass(frozen=True, slots=True)
class Route:
    """How one backend runs one plan: which copies happen and how ``out`` is written."""

    function: Any
    direct: bool
    copy_x: str | None
    out_direct: bool
    inplace_ok: bool
    inverse: tuple[int, ...] | None
    permuted_shape: tuple[int, ...]
    stats_permuted_shape: tuple[int, ...]


def _reads(capabilities: frozenset[str], strides: tuple[int, int] | None, plan: Plan) -> bool:
    if strides is None:
        return False
    row, col = strides
    if "strided" in capabilities:
        return True
    unit_cols = col == 1 or plan.cols == 1
    if "row_strided" in capabilities:
        return unit_cols
    return unit_cols and (row == plan.cols or plan.rows == 1)


def route(plan: Plan, choice: Choice) -> Route:
    """The :class:`Route` of ``plan`` on the chosen backend (cached on the plan)."""
    backend = choice.backend
    cached = plan.routes.get(backend)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    caps = backend.capabilities
    copy_x = None
    if plan.family in ("numpy", "cupy", "torch"):
        if not plan.x_native:
            copy_x = "x has non-native byte order"
        elif plan.x_strides is None:
            copy_x = "x's batch or normalized axes cannot be viewed as 2-D rows without a copy"
        elif not _reads(caps, plan.x_strides, plan):
            copy_x = f"backend {backend.name!r} reads only C-contiguous rows"
    order = plan.permutation
    inverse = None if order is None else tuple(order.index(a) for a in range(len(order)))
    permuted = plan.shape if order is None else tuple(plan.shape[a] for a in order)
    result = Route(
        function=backend.function(plan.op),
        direct=(
            copy_x is None
            and order is None
            and len(plan.axes) == 1
            and plan.shape == (plan.rows, plan.cols)
            and not plan.has_out
            and not plan.return_stats
            and not plan.empty
            and not plan.non_native
        ),
        copy_x=copy_x,
        # with an input that requires grad, the core copies the result into out (recorded by
        # autograd): a backend writing out itself would leave the graph
        out_direct=(
            plan.has_out
            and not plan.requires_grad
            and "out" in caps
            and _reads(caps, plan.out_strides, plan)
        ),
        inplace_ok="inplace" in caps,
        inverse=inverse,
        permuted_shape=permuted,
        stats_permuted_shape=tuple(plan.shape[a] for a in plan.batch_axes) + (1,) * len(plan.axes),
    )
    plan.routes[backend] = result
    return result


# --------------------------------------------------------------------------------------------
# Rows of the caller's arrays (the family operations live in normlab.arrays).


def native(a: Any) -> Any:
    """``a`` in native byte order: a converted copy when its dtype is byte-swapped, else ``a``
    itself. Called for the inputs that :func:`normlab.spec.non_native` names."""
    if a is None or getattr(a.dtype, "isnative", True):
        return a
    return a.astype(a.dtype.newbyteorder("="))


def _to_rows(a: Any, plan: Plan, r: Route, copy: bool) -> Any:
    if plan.permutation is not None:
        a = arrays.permute(a, plan.permutation)
    if copy:
        a = arrays.contiguous(a)
    return arrays.reshape(a, (plan.rows, plan.cols))


def _from_rows(a: Any, plan: Plan, r: Route, shape: tuple[int, ...]) -> Any:
    a = arrays.reshape(a, shape)
    if r.inverse is not None:
        a = arrays.permute(a, r.inverse)
    return a


def _flat(p: Any, plan: Plan) -> Any:
    if p is None or len(plan.normalized_shape) == 1:
        return p
    return arrays.reshape(arrays.contiguous(p), (plan.cols,))


# --------------------------------------------------------------------------------------------


def run(plan: Plan, choice: Choice, x: Any, weight: Any, bias: Any, out: Any) -> Any:
    """Run the chosen backend on ``x`` and return what ``layer_norm`` returns."""
    r = plan.routes.get(choice.backend)
    try:
        if r is not None and r.direct:  # 2-D rows readable as they are: no views to make
            return r.function(x, weight, bias, plan=plan, out=None)[0]
        return _run(plan, choice, r, x, weight, bias, out)
    except NormlabError:
        raise
    except (Exception, SystemExit) as exc:  # a kernel's sys.exit() must not end the caller
        raise kernel_failure(choice.backend, plan.op, exc) from exc


def kernel_failure(backend: Backend, op: str, exc: BaseException) -> BackendError:
    """The error a caller sees when ``backend``'s ``op`` raised ``exc``."""
    return BackendError(
        f"backend {backend.name!r} (from {backend.provided_by}) failed in {op}: "
        f"{type(exc).__name__}: {exc}"
    )


def _run(
    plan: Plan, choice: Choice, r: Route | None, x: Any, weight: Any, bias: Any, out: Any
) -> Any:
    """The general path of :func:`run`: views, copies, ``out``, statistics."""
    out_y, out_mean, out_rstd = split_out(plan.op, out)
    aliasing: Aliasing = "separate"
    if out is not None:
        aliasing = output_aliasing(
            plan.op,
            {"x": x, "weight": weight, "bias": bias},
            {"y": out_y, "mean": out_mean, "rstd": out_rstd},
        )
    if plan.non_native:  # x itself is copied by the route (copy_x)
        weight, bias = native(weight), native(bias)
    if plan.empty:
        y, mean, rstd = _empty_result(plan, x, weight, bias, out_y)
    else:
        r = r or route(plan, choice)
        x2 = _to_rows(x, plan, r, copy=r.copy_x is not None)
        backend_out = None
        if out_y is not None and r.out_direct and aliasing != "temporary":
            in_place = aliasing == "in_place" and r.copy_x is None
            if not in_place or r.inplace_ok:
                backend_out = _to_rows(out_y, plan, r, copy=False)
        y2, mean1, rstd1 = r.function(
            x2, _flat(weight, plan), _flat(bias, plan), plan=plan, out=backend_out
        )
        if out_y is not None and backend_out is None:
            arrays.copy_into(out_y, _from_rows(y2, plan, r, r.permuted_shape))
            y = out_y
        elif out_y is not None:
            arrays.mark_written(out_y)
            y = out_y
        else:
            y = _from_rows(y2, plan, r, r.permuted_shape)
        if not plan.return_stats:
            return y
        mean = None if mean1 is None else _from_rows(mean1, plan, r, r.stats_permuted_shape)
        rstd = _from_rows(rstd1, plan, r, r.stats_permuted_shape)
    if not plan.return_stats:
        return y
    if out_mean is not None:
        arrays.copy_into(out_mean, mean)
        mean = out_mean
    if out_rstd is not None:
        arrays.copy_into(out_rstd, rstd)
        rstd = out_rstd
    if plan.op == "rms_norm":
        return y, rstd
    return y, mean, rstd


def _empty_result(plan: Plan, x: Any, weight: Any, bias: Any, out_y: Any) -> tuple[Any, Any, Any]:
    """No rows or no columns: an empty ``y`` (in the autograd graph when an input requires
    grad) and statistics of NaN (a mean over no column); no kernel is launched."""
    import array_api_compat

    xp = array_api_compat.array_namespace(x)
    if plan.requires_grad:
        y = _empty_in_graph(x, weight, bias)
        if out_y is not None:
            y = out_y.copy_(y)
    else:
        y = out_y if out_y is not None else xp.empty_like(x)
    if not plan.return_stats:
        return y, None, None
    dtype = getattr(xp, plan.stats_dtype)
    device = array_api_compat.device(x)
    mean = None
    if plan.op != "rms_norm":
        mean = xp.full(plan.stats_shape, float("nan"), dtype=dtype, device=device)
    rstd = xp.full(plan.stats_shape, float("nan"), dtype=dtype, device=device)
    return y, mean, rstd


def _empty_in_graph(x: Any, weight: Any, bias: Any) -> Any:
    """An empty tensor like ``x`` recorded by autograd as a function of every input that
    requires grad, so that ``backward()`` gives an empty ``dx`` and zero ``dweight``/``dbias``
    (as torch's own layer_norm does). Only torch tensors require grad."""
    y = x * 0 if x.requires_grad else x.new_empty(x.shape)
    for p in (weight, bias):
        if p is not None and p.requires_grad:
            y = y + p.sum() * 0  # a 0-d term: it keeps y's shape and dtype
    return y
