"""One route for every op: from the caller's arrays to the chosen backend's function, and back.

For a validated call (:class:`~normlab.spec.Call`) and the backend chosen for it, :func:`route`
decides once — cached per call and backend — what happens to each array the op table
(:mod:`normlab.ops`) names:

- x-like inputs (x, residual, dy) become 2-D ``(rows, cols)`` views, copied to C order only when
  the backend cannot read them as they are (:func:`copy_reason`; :func:`normlab.explain` says
  why); statistics inputs become 1-D ``(rows,)``, per-feature arrays 1-D ``(cols,)``; inputs in
  non-native byte order are converted once;
- x-like outputs the caller gave (y into ``out``, h into ``residual_out``) are written by the
  backend itself where its record says it writes such a view (and no input it reads is that
  memory, unless it computes in place), else through a temporary copied in;
- the backend's results come back in the caller's axes: x-like ones reshaped and permuted,
  statistics keepdims-shaped, parameter gradients of the normalized shape (in the compute
  dtype), each written into the output the caller gave for it.

A call whose rows the backend reads as given, without statistics or outputs, takes the direct
route: the backend's function (or the one it prepared for the call's plan) on the caller's
arrays, nothing else; with outputs the backend writes itself, the direct route checks their
overlaps first. :func:`run` runs a call; :func:`describe` says how, for :func:`normlab.explain`.
A backend that raises is reported the same way for every op (:func:`kernel_failure`).
"""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from normlab import arrays, layout
from normlab.dispatch import Choice
from normlab.errors import BackendError, NormlabError
from normlab.ops import Op
from normlab.registry import Backend
from normlab.spec import Call
from normlab.spec.aliasing import Aliasing, output_aliasing

__all__ = [
    "Route",
    "copy_reason",
    "describe",
    "kernel_failure",
    "passes_through",
    "reraise",
    "route",
    "run",
]

#: torch's exceptions that steer its own machinery through a call, raised from a hook or mode
#: while a backend runs (non-reentrant activation checkpointing stops the recomputation from a
#: saved-tensor hook; fake tensors and symbolic shapes stop at a value they cannot know): they
#: pass through normlab unwrapped, by (module, class name), looked up only where torch loaded
#: the module.
_TORCH_CONTROL_FLOW: Final = (
    ("torch.utils.checkpoint", "_StopRecomputationError"),
    ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
    ("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
    ("torch.fx.experimental.symbolic_shapes", "GuardOnDataDependentSymNode"),
)


@dataclass(frozen=True, slots=True)
class Route:
    """How one backend runs one validated call.

    ``copies``: for each x-like input, why it is copied to C-contiguous rows (None: read as
    given). ``writes``: the x-like outputs given that the backend writes itself (the others go
    through a temporary). ``direct``: for a call whose rows the backend reads as given, without
    statistics to return or outputs, the function of the kernel arrays alone (None otherwise),
    which ``invoke(args, direct)`` calls on the op's arguments and whose results it returns as
    the op does; ``prepared``: ``direct`` is the function the backend prepared for the call's
    plan (its optional ``prepare``), not its op function with the plan bound.
    ``direct_out``: rows as given, with outputs the backend writes itself. ``arrays`` and
    ``returns`` are what the backend's function takes and returns, in its record's kernel form
    (:meth:`normlab.ops.Op.kernel_arrays_of`); ``gather`` takes those arrays out of the op's
    arguments; ``pick`` what the op returns out of the kernel's results (for ``direct_out``).
    """

    backend: Backend
    function: Callable[..., Any]
    direct: Callable[..., Any] | None
    invoke: Callable[[tuple[Any, ...], Callable[..., Any]], Any] | None
    prepared: bool
    direct_out: bool
    copies: dict[str, str | None]
    writes: frozenset[str]
    inplace_ok: bool
    arrays: tuple[str, ...]
    returns: tuple[str, ...]
    gather: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    pick: Callable[[tuple[Any, ...]], Any]


def copy_reason(name: str, call: Call, backend: Backend) -> str | None:
    """Why the x-like input ``name`` (x, residual, dy) must be copied to C-contiguous rows for
    ``backend``, or None when the backend reads it as it is (families without strides: never)."""
    plan = call.plan
    if plan.family not in ("numpy", "cupy", "torch"):
        return None
    strides = call.strides[name]
    if name in call.non_native:
        return f"{name} has non-native byte order"
    if strides is None:
        return f"{name}'s batch or normalized axes cannot be viewed as 2-D rows without a copy"
    if not layout.reads(backend.capabilities, strides, plan.rows, plan.cols):
        return f"backend {backend.name!r} reads only C-contiguous rows"
    return None


def route(call: Call, choice: Choice) -> Route:
    """The :class:`Route` of ``call`` on the chosen backend (cached on the call)."""
    backend = choice.backend
    cached = call.routes.get(backend)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    op, plan = call.op, call.plan
    caps = backend.capabilities
    copies = {name: copy_reason(name, call, backend) for name in op.like_x}
    # with an input that requires grad, the core copies the results into the outputs (recorded
    # by autograd): a backend writing them itself would leave the graph
    may_write = "out" in caps and not plan.requires_grad
    writes = frozenset(
        name
        for name in call.outputs & {"y", "h"}
        if may_write and layout.reads(caps, call.strides[name], plan.rows, plan.cols)
    )
    rows_as_given = _rows_as_given(call, copies)
    function = backend.function(plan.op)
    direct = prepared = invoke = None
    arrays_taken, returned = backend.kernel_arrays(op), backend.kernel_returns(op)
    if rows_as_given and not call.outputs and (call.needs or not op.gradients):
        prepared = backend.prepared(plan.op, plan)
        keywords = {"needs": call.needs} if op.gradients else dict.fromkeys(op.output_arguments)
        direct = prepared or functools.partial(function, plan=plan, **keywords)
        invoke = _invoker(op, arrays_taken, returned, plan.return_residual, plan.rows)
    given_rows = call.outputs & {"y", "h"}
    result = Route(
        backend=backend,
        function=function,
        direct=direct,
        invoke=invoke,
        prepared=prepared is not None,
        direct_out=rows_as_given and bool(call.outputs) and call.outputs == given_rows == writes,
        copies=copies,
        writes=writes,
        inplace_ok="inplace" in caps,
        arrays=arrays_taken,
        returns=returned,
        gather=_gatherer(op, arrays_taken),
        pick=_picker(op, returned, plan.return_residual),
    )
    call.routes[backend] = result
    return result


def _rows_as_given(call: Call, copies: dict[str, str | None]) -> bool:
    """Whether the backend reads the caller's arrays as they are: 2-D rows (one normalized
    axis, the last), none copied, no statistics to shape, not empty, native byte order."""
    plan = call.plan
    return (
        not any(copies.values())
        and call.permutation is None
        and len(plan.axes) == 1
        and plan.shape == (plan.rows, plan.cols)
        and not plan.return_stats
        and not plan.empty
        and not call.non_native
    )


def _invoker(
    op: Op, taken: tuple[str, ...], returned: tuple[str, ...], return_residual: bool, rows: int
) -> Callable[[tuple[Any, ...], Callable[..., Any]], Any]:
    """``invoke(args, f)`` for the direct route of ``op``: ``f`` (the backend's function of
    the kernel arrays ``taken``, returning ``returned``) called on the op's arguments ``args`` —
    arrays the op does not take (rms_norm's bias in kernel form 1) None, statistics as the 1-D
    rows a backend reads — and what the op returns taken out of its results. Generated
    straight-line (no loop, no star-arguments): this runs on every call of the direct route."""
    arguments = []
    for name in taken:
        if name not in op.index:
            arguments.append("None")
        elif name in op.stats:
            arguments.append(f"reshape(args[{op.index[name]}], rows)")
        else:
            arguments.append(f"args[{op.index[name]}]")
    call = f"f({', '.join(arguments)})"
    names = op.returned(return_stats=False, return_residual=return_residual)
    picked = [f"r[{returned.index(name)}]" for name in names]
    if op.bare and len(names) == 1:
        body = f"    return {call}{picked[0][1:]}\n"
    else:
        body = f"    r = {call}\n    return ({', '.join(picked)},)\n"
    source = f"def invoke(args, f):\n{body}"
    namespace: dict[str, Any] = {"reshape": arrays.reshape, "rows": (rows,)}
    exec(compile(source, f"<normlab.route: {op.name}>", "exec"), namespace)
    return namespace["invoke"]  # type: ignore[no-any-return]


def _gatherer(op: Op, taken: tuple[str, ...]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """The function taking the kernel arrays ``taken`` out of ``op``'s arguments, in order;
    arrays the op does not take (rms_norm's bias in kernel form 1) are None, and come last."""
    present = [op.index[name] for name in taken if name in op.index]
    absent = (None,) * (len(taken) - len(present))
    assert all(name in op.index for name in taken[: len(present)]), op.name
    getter = operator.itemgetter(*present)
    if len(present) == 1:
        return lambda args: (getter(args), *absent)
    if absent:
        return lambda args: getter(args) + absent
    return getter


def _picker(
    op: Op, returned: tuple[str, ...], return_residual: bool
) -> Callable[[tuple[Any, ...]], Any]:
    """The function taking what ``op`` returns without statistics out of its kernel's results
    ``returned`` (the direct routes'): the result itself when one, else the tuple."""
    names = op.returned(return_stats=False, return_residual=return_residual)
    return operator.itemgetter(*(returned.index(name) for name in names))


# --------------------------------------------------------------------------------------------


def run(call: Call, choice: Choice, args: tuple[Any, ...]) -> Any:
    """Run ``call`` (the op's arguments ``args``) on the chosen backend and return what the op's
    function returns."""
    r = call.routes.get(choice.backend)
    try:
        if r is not None and r.invoke is not None:  # rows readable as they are: nothing to make
            return r.invoke(args, r.direct)
        if r is not None and r.direct_out:  # rows as given, outputs written by the backend
            outputs = call.given_outputs(args)
            aliasing = output_aliasing(call.op, _inputs(call.op, args), outputs)
            if _writes_direct(aliasing, r.inplace_ok):
                results = r.function(*r.gather(args), plan=call.plan, **_keywords(call, outputs))
                return r.pick(
                    tuple(
                        result if outputs.get(name) is None else _written(outputs[name])
                        for name, result in zip(r.returns, results, strict=True)
                    )
                )
        return _run(call, r or route(call, choice), args)
    except (Exception, SystemExit) as exc:  # a kernel's sys.exit() must not end the caller
        reraise(choice.backend, call.plan.op, exc)


def kernel_failure(backend: Backend, op: str, exc: BaseException) -> BackendError:
    """The error a caller sees when ``backend``'s ``op`` raised ``exc``."""
    return BackendError(
        f"backend {backend.name!r} (from {backend.provided_by}) failed in {op}: "
        f"{type(exc).__name__}: {exc}"
    )


def reraise(backend: Backend, op: str, exc: BaseException) -> NoReturn:
    """Raise what a caller sees when ``backend``'s ``op`` raised ``exc``: ``exc`` itself when
    it is a NormlabError or passes through (:func:`passes_through`), else
    :func:`kernel_failure`."""
    if isinstance(exc, NormlabError) or passes_through(exc):
        raise exc
    raise kernel_failure(backend, op, exc) from exc


def passes_through(exc: BaseException) -> bool:
    """Whether ``exc`` is one of torch's control-flow exceptions (:data:`_TORCH_CONTROL_FLOW`),
    which the machinery that raised it catches again: normlab re-raises it as it is."""
    for module, name in _TORCH_CONTROL_FLOW:
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(exc, kind):
            return True
    return False


def _inputs(op: Op, args: tuple[Any, ...]) -> dict[str, Any]:
    return {name: args[op.index[name]] for name in op.arrays}


def _writes_direct(aliasing: Aliasing, inplace_ok: bool) -> bool:
    """Whether a backend may write the outputs itself: none is the memory of an input it reads,
    or the backend computes in place (``inplace_ok``)."""
    return aliasing == "separate" or (aliasing == "in_place" and inplace_ok)


def _keywords(call: Call, outputs: dict[str, Any]) -> dict[str, Any]:
    """The backend function's keyword arguments besides ``plan``: the output arrays it writes
    (``out``, ``residual_out``; None: it allocates) or a backward call's ``needs``."""
    keywords = {argument: outputs.get(name) for argument, name in call.op.output_arguments.items()}
    if call.op.gradients:
        keywords["needs"] = call.needs
    return keywords


def _written(target: Any) -> Any:
    """An output the backend wrote through its memory (its library is told), or None."""
    if target is not None:
        arrays.mark_written(target)
    return target


def _run(call: Call, r: Route, args: tuple[Any, ...]) -> Any:
    """The general route: views, copies, conversions, outputs, statistics, gradients."""
    op, plan = call.op, call.plan
    given = dict(zip(op.arguments, args, strict=True))
    if op.gradients and not call.needs:
        return (None,) * len(op.outputs)
    outputs = call.given_outputs(args) if call.outputs else {}
    aliasing: Aliasing = "separate"
    if outputs:
        aliasing = output_aliasing(op, {name: given[name] for name in op.arrays}, outputs)
    if call.non_native:  # the x-like inputs are copied by the route (copies)
        for name in (*op.stats, *op.per_feature):
            given[name] = layout.native(given[name])
    if plan.empty:
        return _returned(op, plan, _empty_results(call, given, outputs))
    # the backend writes an output itself unless it may be the memory of an input it reads:
    # where every x-like input is copied, none is
    inplace_ok = r.inplace_ok or all(r.copies.values())
    backend_outputs = {
        name: _rows(call, target, copy=False)
        for name, target in outputs.items()
        if name in r.writes and _writes_direct(aliasing, inplace_ok)
    }
    kernel_args: list[Any] = []
    for name in r.arrays:
        a = given.get(name)
        if a is None:
            kernel_args.append(None)
        elif name in r.copies:
            kernel_args.append(_rows(call, a, copy=r.copies[name] is not None))
        elif name in op.stats:
            kernel_args.append(arrays.reshape(a, (plan.rows,)))
        else:
            kernel_args.append(layout.flat(a, plan.normalized_shape))
    results = r.function(*kernel_args, plan=plan, **_keywords(call, backend_outputs))
    kernel = dict(zip(r.returns, results, strict=True))
    placed: dict[str, Any] = {}
    for name in op.returned(plan.return_stats, plan.return_residual):
        value, target = kernel[name], outputs.get(name)
        if value is None:
            placed[name] = None
        elif name in op.stats_outputs:
            placed[name] = _into(target, layout.from_rows(value, call.stats_shape, call.inverse))
        elif name in op.per_feature_outputs:
            placed[name] = _unflat(value, plan.normalized_shape)
        elif name in backend_outputs:
            placed[name] = _written(target)
        else:
            placed[name] = _into(target, layout.from_rows(value, call.permuted_shape, call.inverse))
    return _returned(op, plan, placed)


def _rows(call: Call, a: Any, copy: bool) -> Any:
    """The x-like array ``a`` as the backend's 2-D rows (itself when it already is they)."""
    plan = call.plan
    if not copy and call.permutation is None and plan.shape == (plan.rows, plan.cols):
        return a  # 2-D rows already: a reshape would only make a view (a tensor's costs 1 µs)
    return layout.to_rows(a, call.permutation, plan.rows, plan.cols, copy)


def _into(target: Any, value: Any) -> Any:
    """``value``, copied into ``target`` when the caller gave one (then ``target``)."""
    if target is None:
        return value
    arrays.copy_into(target, value)
    return target


def _unflat(g: Any, normalized_shape: tuple[int, ...]) -> Any:
    """A parameter gradient (1-D) in the normalized shape."""
    return g if len(normalized_shape) == 1 else arrays.reshape(g, normalized_shape)


def _returned(op: Op, plan: Any, results: dict[str, Any]) -> Any:
    """What the op's function returns: its results in the table's order, a single one bare
    (forward and fused ops), a backward op's gradients always as a tuple."""
    names = op.returned(plan.return_stats, plan.return_residual)
    if op.bare and len(names) == 1:
        return results[names[0]]
    return tuple(results[name] for name in names)


def _empty_results(call: Call, given: dict[str, Any], outputs: dict[str, Any]) -> dict[str, Any]:
    """No rows or no columns: no kernel is launched. Empty x-like results (in the autograd graph
    when an input requires grad), statistics of NaN (a mean over no column), zero parameter
    gradients (in the compute dtype); None for a gradient not needed."""
    import array_api_compat

    op, plan = call.op, call.plan
    x = given["x"]
    xp = array_api_compat.array_namespace(x)
    device = array_api_compat.device(x)
    stats_dtype = getattr(xp, plan.stats_dtype)
    results: dict[str, Any] = {}
    for name in op.outputs:
        if op.gradients and op.gradients[op.outputs.index(name)] not in call.needs:
            results[name] = None
        elif name in op.per_feature_outputs:
            results[name] = xp.zeros(plan.normalized_shape, dtype=stats_dtype, device=device)
        elif plan.requires_grad and not op.gradients:
            y = _empty_in_graph(x, [given[n] for n in op.per_feature])
            target = outputs.get(name)
            results[name] = y if target is None else target.copy_(y)
        else:
            target = outputs.get(name)
            results[name] = target if target is not None else xp.empty_like(x)
    for name in op.stats_outputs:
        stats = xp.full(plan.stats_shape, float("nan"), dtype=stats_dtype, device=device)
        results[name] = _into(outputs.get(name), stats)
    return results


def _empty_in_graph(x: Any, parameters: list[Any]) -> Any:
    """An empty tensor like ``x`` recorded by autograd as a function of every input that
    requires grad, so that ``backward()`` gives an empty ``dx`` and zero parameter gradients
    (as torch's own layer_norm does). Only torch tensors require grad."""
    y = x * 0 if x.requires_grad else x.new_empty(x.shape)
    for p in parameters:
        if p is not None and p.requires_grad:
            y = y + p.sum() * 0  # a 0-d term: it keeps y's shape and dtype
    return y


# --------------------------------------------------------------------------------------------


def describe(call: Call, choice: Choice) -> list[str]:
    """How ``call`` runs on the chosen backend, a line each (for :func:`normlab.explain`): which
    x-like inputs are copied and why, which inputs are converted to native byte order, how each
    output given is written."""
    r = route(call, choice)
    lines = [
        f"layout: {f'copy of {name} — ' + reason if reason else f'no copy of {name}'}"
        for name, reason in r.copies.items()
    ]
    converted = ", ".join(sorted(call.non_native - r.copies.keys()))
    if converted:
        lines.append(f"byte order: a native copy of {converted} (non-native byte order)")
    for argument, name in call.op.output_arguments.items():
        if name in call.outputs:
            how = "directly" if name in r.writes else "through a temporary"
            lines.append(f"{argument}: written {how}")
    return lines
