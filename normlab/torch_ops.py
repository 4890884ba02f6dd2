"""normlab's torch custom ops: a backend that records no autograd graph, run inside torch's graph.

Every op of the table (:mod:`normlab.ops`) has a custom op ``normlab::<op>``
(``torch.library.custom_op``), made here from its table entry: its schema, its fake
implementation for tracing, and for a forward or fused op its autograd formula. An op takes the
2-D rows the core made of the call's arrays (its ``kernel_arrays`` that the op takes; 1-D
statistics), ``eps`` when the op takes one, a ``need_<gradient>`` flag per gradient of a
backward op, and the backend's name (a torch op's arguments are tensors and scalars, so the
backend travels as its name: an exported program names it). Forward ops return their outputs
and statistics (a fused op always returns ``h``: its gradient needs it), backward ops their
gradients (an empty tensor for one not needed).

Inside, an op runs its rows through the same route as any call (:func:`normlab.route.run`) on
the named backend, with tensors detached: validation and dispatch ran once, for the caller's
arguments; the rows are a call of their own without rules (:func:`normlab.spec.row_call`,
cached: an op may run at another row count than the call it was traced from).
The forward ops save what their backward op needs; statistics are not differentiable, and the
backward ops have no formula of their own (no double backward: torch says so). A fused op's
gradient is its base op's backward plus the gradient arriving at ``h``:
``dx = dresidual = dh + dx_norm``.

The core reaches them through :func:`in_graph` (see :mod:`normlab.autograd`): the chosen backend
as a :class:`~normlab.registry.Backend` whose op functions are these ops. ``torch.compile`` and
``torch.export`` see one opaque op per call. Importing this module imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final

import torch

from normlab import pipeline, registry, route, spec
from normlab.constants import stats_dtype_for
from normlab.dispatch import Choice
from normlab.hookspecs import Plan
from normlab.ops import OPS, Op
from normlab.registry import Backend

__all__ = ["InGraph", "in_graph"]

Tensor = torch.Tensor

#: Choices wrapped by :func:`in_graph` (one per choice, made once).
_WRAPPED_CHOICES: Final = 1024
#: How the backend of a custom op was chosen: by the call the op is part of.
_SERVED: Final = "named by normlab's custom op"


def _takes(op: Op) -> tuple[str, ...]:
    """The arrays a custom op takes: the op's kernel arrays that the op itself takes."""
    return tuple(name for name in op.kernel_arrays if name in op.index)


def _returns(op: Op) -> tuple[str, ...]:
    """What a custom op returns: a backward op's gradients, else the outputs and statistics."""
    return op.outputs if op.gradients else (*op.outputs, *op.stats_outputs)


def _schema(op: Op) -> str:
    """The torch schema of ``op``'s custom op, from its table entry."""
    arrays = [f"Tensor{'?' if name in op.per_feature else ''} {name}" for name in _takes(op)]
    scalars = ["float eps"] if op.takes_eps else []
    flags = [f"bool need_{name}" for name in op.gradients]
    returns = ", ".join("Tensor" for _ in _returns(op))
    return f"({', '.join([*arrays, *scalars, *flags, 'str backend'])}) -> ({returns})"


# --------------------------------------------------------------------------------------------
# The ops' implementations: the rows through the route, on the named backend


def _implementation(op: Op) -> Callable[..., tuple[Tensor, ...]]:
    """The function of ``op``'s custom op: its rows validated and routed as a call of ``op`` on
    the backend named by its last argument."""
    takes = _takes(op)

    def implementation(*args: Any) -> tuple[Tensor, ...]:
        given = dict(zip(takes, args, strict=False))
        rest = args[len(takes) : -1]
        values: dict[str, Any] = {
            name: None if t is None else t.detach() for name, t in given.items()
        }
        x: Tensor = values["x"]
        eps, flags = (rest[0], rest[1:]) if op.takes_eps else (0.0, rest)
        needs = frozenset(g for g, need in zip(op.gradients, flags, strict=True) if need)
        weight, bias = values.get("weight"), values.get("bias")
        call = spec.row_call(
            op,
            "torch",
            _dtype_name(x),
            str(x.device),
            x.device.type,
            x.shape[0],
            x.shape[1],
            None if weight is None else _dtype_name(weight),
            None if bias is None else _dtype_name(bias),
            eps,
            tuple(tuple(values[name].stride()) for name in op.like_x),
            needs,
        )
        choice = Choice(registry.get(args[-1]), _SERVED, ())
        result = route.run(call, choice, tuple(values.get(name) for name in op.arguments))
        if op.gradients:  # outputs of a custom op may not alias one another: one empty each
            return tuple(
                _empty_gradient(x, name in op.per_feature_outputs) if g is None else g
                for name, g in zip(op.outputs, result, strict=True)
            )
        return tuple(result)

    return implementation


def _dtype_name(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _empty_gradient(x: Tensor, per_feature: bool) -> Tensor:
    return x.new_empty(0, dtype=_stats_dtype(x)) if per_feature else x.new_empty(0)


def _stats_dtype(x: Tensor) -> torch.dtype:
    """The statistics' (and parameter gradients') dtype of rows of ``x``'s dtype."""
    return getattr(torch, stats_dtype_for(_dtype_name(x)))  # type: ignore[no-any-return]


def _fake(op: Op) -> Callable[..., tuple[Tensor, ...]]:
    """The fake implementation of ``op``'s custom op: empty results of the right shapes and
    dtypes, for tracing."""
    takes = _takes(op)

    def fake(*args: Any) -> tuple[Tensor, ...]:
        x = args[takes.index("x")]
        rows, cols = x.shape
        stats = _stats_dtype(x)
        if not op.gradients:
            return tuple(
                x.new_empty(rows, dtype=stats) if name in op.stats_outputs else x.new_empty(x.shape)
                for name in _returns(op)
            )
        needs = dict(zip(op.gradients, args[len(takes) : -1], strict=True))
        return tuple(
            x.new_empty(cols if need else 0, dtype=stats)
            if name in op.per_feature_outputs
            else x.new_empty(x.shape if need else (0,))
            for name, need in zip(op.outputs, needs.values(), strict=True)
        )

    return fake


# --------------------------------------------------------------------------------------------
# The forward ops' autograd formulas: the backward op of the base op


def _register_autograd(op: Op, custom: Any) -> None:
    """``op``'s gradient, from its table row: the custom op of its backward op (its base op's,
    for a fused op) on what the forward saved, and to each input that requires grad, in the
    input's dtype, the gradient ``op.gradient_map`` gives it. When the normalized input is also
    an output (a fused op's ``h = x + residual``), the gradient arriving at it joins the
    backward op's gradient of its ``x``: ``dx = dresidual = dh + dx_norm``."""
    assert op.gradient_op is not None, op.name
    backward = OPS[op.gradient_op]
    takes, returns = _takes(op), _returns(op)
    gradient_of = dict(op.gradient_map)
    normalized = "h" if op.arithmetic.residual_add else "x"  # the array the norm normalized
    backward_takes = _takes(backward)
    saved = tuple(name for name in backward_takes if name != "dy")  # x, stats, parameters

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        given = dict(zip(takes, inputs, strict=False))
        results = dict(zip(returns, output, strict=True))
        arrays = {**given, **results}
        arrays["x"] = arrays[normalized]  # the backward op's x: what the norm normalized
        ctx.save_for_backward(*(arrays.get(name) for name in saved))
        ctx.backend = inputs[-1]
        ctx.dtypes = {name: None if t is None else t.dtype for name, t in given.items()}
        ctx.mark_non_differentiable(*(results[s] for s in op.stats_outputs))

    def gradient(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        arriving = dict(zip(returns, grads, strict=True))
        need = dict(zip(takes, ctx.needs_input_grad, strict=False))
        wanted = {
            g: any(need[name] for name in takes if gradient_of.get(name) == g)
            for g in backward.gradients
        }
        arrays = {"dy": arriving["y"], **dict(zip(saved, ctx.saved_tensors, strict=True))}
        computed = dict(
            zip(
                backward.gradients,
                _CUSTOM[backward.name](
                    *(arrays[name] for name in backward_takes),
                    *wanted.values(),
                    ctx.backend,
                ),
                strict=True,
            )
        )
        if normalized != "x" and arriving.get(normalized) is not None and wanted["x"]:
            computed["x"] = computed["x"] + arriving[normalized]
        scalars = len(ctx.needs_input_grad) - len(takes)
        return (
            *(
                computed[gradient_of[name]].to(ctx.dtypes[name]) if need[name] else None
                for name in takes
            ),
            *(None,) * scalars,
        )

    custom.register_autograd(gradient, setup_context=setup_context)


def _custom_op(op: Op) -> Any:
    """``op``'s custom op: its function, its fake and (a forward or fused op) its gradient, all
    from its table row."""
    custom = torch.library.custom_op(
        f"normlab::{op.name}", _implementation(op), mutates_args=(), schema=_schema(op)
    )
    custom.register_fake(_fake(op))
    if op.gradient_op is not None:
        _register_autograd(op, custom)
    return custom


#: Each op's custom op, by name (a gradient looks up its backward op's here when it runs).
_CUSTOM: Final[dict[str, Any]] = {name: _custom_op(op) for name, op in OPS.items()}


def _custom(op: Op) -> Any:
    """``op``'s custom op (made now for an op added to the table since this module loaded)."""
    custom = _CUSTOM.get(op.name)
    if custom is None:
        custom = _CUSTOM[op.name] = _custom_op(op)
    return custom


# --------------------------------------------------------------------------------------------
# The backend op contract (normlab.hookspecs) through the custom ops: what the core runs in
# place of the chosen backend's own functions.


def _in_graph_function(op: Op, backend: str) -> Callable[..., tuple[Any, ...]]:
    """A function with the signature of a backend's ``op`` function that runs ``op``'s custom op
    for ``backend``: kernel arrays, then ``plan`` and the outputs (None) or ``needs``."""
    custom = _custom(op)
    takes = _takes(op)
    positions = [op.kernel_arrays.index(name) for name in takes]

    def function(
        *arrays: Any, plan: Plan, needs: frozenset[str] = frozenset(), **outputs: None
    ) -> tuple[Any, ...]:
        scalars = (plan.eps,) if op.takes_eps else ()
        flags = tuple(g in needs for g in op.gradients)
        results = dict(
            zip(
                _returns(op),
                custom(*(arrays[i] for i in positions), *scalars, *flags, backend),
                strict=True,
            )
        )
        if op.gradients:
            return tuple(
                results[name] if g in needs else None
                for name, g in zip(op.outputs, op.gradients, strict=True)
            )
        if not plan.return_stats:
            results.update(dict.fromkeys(op.stats_outputs))
        if not plan.return_residual:
            results.pop("h", None)
        return tuple(results.get(name) for name in op.kernel_returns)

    return function


#: What a backend's record claims that its custom ops do not: writing into outputs, and
#: serving any option natively (the core composes every option in torch's ops).
_NOT_IN_GRAPH: Final = frozenset({"out", "inplace"}) | pipeline.CAPABILITIES


class InGraph(Backend):
    """A backend that records no autograd graph, as the core runs it on torch tensors that
    require grad or inside a torch trace: its record in kernel form 2 (the custom ops' own
    functions; the served backend is run in its own form), without ``out`` and ``inplace`` (the
    core copies the results into the outputs, recorded by torch) and without ``weight_offset``,
    ``parameter_dtypes``, ``residual_stream`` and ``quantize`` (the core forms those in torch's
    ops, so that autograd and torch's tracing see them: :mod:`normlab.parameters`,
    :mod:`normlab.residual_stream`, :mod:`normlab.quantize`), each op through its custom op."""

    def __init__(self, served: Backend) -> None:
        capabilities = served.capabilities - _NOT_IN_GRAPH
        record = dataclasses.replace(served.record, capabilities=capabilities, kernel_form=2)
        super().__init__(record, served.provided_by)
        self.served = served

    @property
    def reason(self) -> str | None:
        return self.served.reason

    @property
    def module(self) -> Any:
        return self.served.module

    def function(self, op: str) -> Any:
        """The custom op of ``op``, with the backend op signature, for the served backend."""
        self.served.function(op)  # the backend must define it: the op calls it
        return _in_graph_function(OPS[op], self.name)

    def prepared(self, op: str, plan: Any) -> None:
        """None: every call goes through the custom op (the served backend's prepared
        functions would leave the graph)."""
        return None


_wrapped: dict[Choice, Choice] = {}


def in_graph(choice: Choice) -> Choice:
    """``choice`` with its backend run through the custom ops (cached: one :class:`InGraph` per
    choice, so the routes cached per backend stay few)."""
    wrapped = _wrapped.get(choice)
    if wrapped is None:
        if len(_wrapped) >= _WRAPPED_CHOICES:  # choices of backends registered since: afresh
            _wrapped.clear()
        how = f"{choice.how}; run through normlab's custom op (it records no autograd graph)"
        wrapped = _wrapped[choice] = Choice(InGraph(choice.backend), how, choice.notes)
    return wrapped
