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
from normlab.spec import Aliasing, Layout, Plan, output_aliasing, split_out

__all__ = [
    "Route",
    "copy_reason",
    "flat",
    "from_rows",
    "kernel_failure",
    "native",
    "reads",
    "route",
    "rows",
    "run",
]


@dataclass(frozen=True, slots=True)
class Route:
    """How one backend runs one plan: which copies happen and how ``out`` is written."""

    function: Any
    direct: bool  # 2-D rows as given, no out: the backend's (prepared) function alone
    direct_out: bool  # likewise with out, which the backend writes itself
    prepared: Any  # the backend's prepared function of the direct route, or None
    copy_x: str | None
    out_direct: bool
    inplace_ok: bool
    inverse: tuple[int, ...] | None
    permuted_shape: tuple[int, ...]
    stats_permuted_shape: tuple[int, ...]


def reads(capabilities: frozenset[str], strides: tuple[int, int] | None, plan: Plan) -> bool:
    """Whether a backend with ``capabilities`` reads (or writes) a 2-D view of ``strides``."""
    if strides is None:
        return False
    row, col = strides
    if "strided" in capabilities:
        return True
    unit_cols = col == 1 or plan.cols == 1
    if "row_strided" in capabilities:
        return unit_cols
    return unit_cols and (row == plan.cols or plan.rows == 1)


def copy_reason(name: str, call: Layout, backend: Backend) -> str | None:
    """Why the x-like input ``name`` (x, dy, …) must be copied to C-contiguous rows for
    ``backend``, or None when the backend reads it as it is (families without strides: never)."""
    plan = call.plan
    if plan.family not in ("numpy", "cupy", "torch"):
        return None
    strides = call.strides[name]
    if name in call.non_native:
        return f"{name} has non-native byte order"
    if strides is None:
        return f"{name}'s batch or normalized axes cannot be viewed as 2-D rows without a copy"
    if not reads(backend.capabilities, strides, plan):
        return f"backend {backend.name!r} reads only C-contiguous rows"
    return None


def route(call: Layout, choice: Choice) -> Route:
    """The :class:`Route` of ``call`` on the chosen backend (cached on the Layout)."""
    backend = choice.backend
    cached = call.routes.get(backend)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    plan = call.plan
    caps = backend.capabilities
    copy_x = copy_reason("x", call, backend)
    rows_as_given = (
        copy_x is None
        and call.permutation is None
        and len(plan.axes) == 1
        and plan.shape == (plan.rows, plan.cols)
        and not plan.return_stats
        and not plan.empty
        and not call.non_native
    )
    direct = rows_as_given and not call.has_out
    # with an input that requires grad, the core copies the result into out (recorded by
    # autograd): a backend writing out itself would leave the graph
    out_direct = (
        call.has_out
        and not plan.requires_grad
        and "out" in caps
        and reads(caps, call.out_strides, plan)
    )
    result = Route(
        function=backend.function(plan.op),
        direct=direct,
        direct_out=rows_as_given and out_direct,
        prepared=backend.prepared(plan.op, plan) if direct else None,
        copy_x=copy_x,
        out_direct=out_direct,
        inplace_ok="inplace" in caps,
        inverse=call.inverse,
        permuted_shape=call.permuted_shape,
        stats_permuted_shape=tuple(plan.shape[a] for a in plan.batch_axes) + (1,) * len(plan.axes),
    )
    call.routes[backend] = result
    return result


# --------------------------------------------------------------------------------------------
# Rows of the caller's arrays (the family operations live in normlab.arrays).


def native(a: Any) -> Any:
    """``a`` in native byte order: a converted copy when its dtype is byte-swapped, else ``a``
    itself. Called for the inputs that :func:`normlab.spec.non_native` names."""
    if a is None or getattr(a.dtype, "isnative", True):
        return a
    return a.astype(a.dtype.newbyteorder("="))


def rows(a: Any, call: Layout, copy: bool) -> Any:
    """The x-like array ``a`` (x, dy, out, …) as the 2-D ``(rows, cols)`` view a backend reads:
    batch axes first; a C-contiguous copy when ``copy`` (see :func:`copy_reason`)."""
    plan = call.plan
    if call.permutation is not None:
        a = arrays.permute(a, call.permutation)
    elif not copy and plan.shape == (plan.rows, plan.cols):
        return a  # 2-D rows already: a reshape would only make a view (a tensor's costs 1 µs)
    if copy:
        a = arrays.contiguous(a)
    return arrays.reshape(a, (plan.rows, plan.cols))


def from_rows(a: Any, shape: tuple[int, ...], inverse: tuple[int, ...] | None) -> Any:
    """A backend's 2-D result back in the caller's axes: reshaped to ``shape`` (the permuted
    shape) and permuted by ``inverse``."""
    a = arrays.reshape(a, shape)
    if inverse is not None:
        a = arrays.permute(a, inverse)
    return a


def flat(p: Any, plan: Plan) -> Any:
    """A per-feature array (weight, bias) as the 1-D ``(cols,)`` array a backend reads."""
    if p is None or len(plan.normalized_shape) == 1:
        return p
    return arrays.reshape(arrays.contiguous(p), (plan.cols,))


# --------------------------------------------------------------------------------------------


def run(call: Layout, choice: Choice, x: Any, weight: Any, bias: Any, out: Any) -> Any:
    """Run the chosen backend on ``x`` and return what ``layer_norm`` returns."""
    r = call.routes.get(choice.backend)
    try:
        if r is not None and r.direct:  # 2-D rows readable as they are: no views to make
            if r.prepared is not None:
                return r.prepared(x, weight, bias)[0]
            return r.function(x, weight, bias, plan=call.plan, out=None)[0]
        if r is not None and r.direct_out:  # rows as given, out written by the backend
            aliasing = output_aliasing(
                call.plan.op, {"x": x, "weight": weight, "bias": bias}, {"y": out}
            )
            if writes_direct(aliasing, r.inplace_ok):
                r.function(x, weight, bias, plan=call.plan, out=out)
                arrays.mark_written(out)
                return out
        return _run(call, choice, r, x, weight, bias, out)
    except NormlabError:
        raise
    except (Exception, SystemExit) as exc:  # a kernel's sys.exit() must not end the caller
        raise kernel_failure(choice.backend, call.plan.op, exc) from exc


def writes_direct(aliasing: Aliasing, inplace_ok: bool) -> bool:
    """Whether a backend may write the outputs itself: none is the memory of an input, or the
    backend computes in place (``inplace_ok``)."""
    return aliasing == "separate" or (aliasing == "in_place" and inplace_ok)


def kernel_failure(backend: Backend, op: str, exc: BaseException) -> BackendError:
    """The error a caller sees when ``backend``'s ``op`` raised ``exc``."""
    return BackendError(
        f"backend {backend.name!r} (from {backend.provided_by}) failed in {op}: "
        f"{type(exc).__name__}: {exc}"
    )


def _run(
    call: Layout, choice: Choice, r: Route | None, x: Any, weight: Any, bias: Any, out: Any
) -> Any:
    """The general path of :func:`run`: views, copies, ``out``, statistics."""
    plan = call.plan
    out_y, out_mean, out_rstd = split_out(plan.op, out)
    aliasing: Aliasing = "separate"
    if out is not None:
        aliasing = output_aliasing(
            plan.op,
            {"x": x, "weight": weight, "bias": bias},
            {"y": out_y, "mean": out_mean, "rstd": out_rstd},
        )
    if call.non_native:  # x itself is copied by the route (copy_x)
        weight, bias = native(weight), native(bias)
    if plan.empty:
        y, mean, rstd = _empty_result(plan, x, weight, bias, out_y)
    else:
        r = r or route(call, choice)
        x2 = rows(x, call, copy=r.copy_x is not None)
        backend_out = None
        if out_y is not None and r.out_direct and aliasing != "temporary":
            in_place = aliasing == "in_place" and r.copy_x is None
            if not in_place or r.inplace_ok:
                backend_out = rows(out_y, call, copy=False)
        y2, mean1, rstd1 = r.function(
            x2, flat(weight, plan), flat(bias, plan), plan=plan, out=backend_out
        )
        if out_y is not None and backend_out is None:
            arrays.copy_into(out_y, from_rows(y2, r.permuted_shape, r.inverse))
            y = out_y
        elif out_y is not None:
            arrays.mark_written(out_y)
            y = out_y
        else:
            y = from_rows(y2, r.permuted_shape, r.inverse)
        if not plan.return_stats:
            return y
        mean = None if mean1 is None else from_rows(mean1, r.stats_permuted_shape, r.inverse)
        rstd = from_rows(rstd1, r.stats_permuted_shape, r.inverse)
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
