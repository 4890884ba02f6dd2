"""normlab's torch custom ops: a backend that records no autograd graph, run inside torch's graph.

The ops ``normlab::layer_norm``, ``normlab::rms_norm``, their ``*_backward`` and the fused
``normlab::add_layer_norm``/``normlab::add_rms_norm``
(``torch.library.custom_op``, with fake implementations for tracing and a registered autograd
formula) take 2-D rows, scalars and the name of a backend. Each rebuilds the backend's row
:class:`~normlab.hookspecs.Plan` from those (cached) and calls that backend's op function
directly, on detached tensors: validation and dispatch ran once, in the caller's call, before.
The forward ops save what their backward op needs; ``mean`` and ``rstd`` are not differentiable,
and the backward ops have no formula of their own (no double backward: torch says so). A fused
op always computes ``h`` (its gradient needs it) and its gradient is the base op's backward plus
the gradient arriving at ``h``: ``dx = dresidual = dh + dx_norm``.

The core reaches them through :func:`in_graph` (see :mod:`normlab.autograd`): the chosen backend
as a :class:`~normlab.registry.Backend` whose op functions are these ops. ``torch.compile`` and
``torch.export`` see one opaque op per call. Importing this module imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Final

import torch

from normlab import registry
from normlab.constants import stats_dtype_for
from normlab.dispatch import Choice
from normlab.hookspecs import Plan
from normlab.registry import Backend

__all__ = ["InGraph", "in_graph", "row_plan"]

Tensor = torch.Tensor

#: Row plans kept by :func:`row_plan` (one per op, dtype, device, size and eps).
_ROW_PLANS: Final = 1024


# --------------------------------------------------------------------------------------------
# The row plan a backend receives inside an op, rebuilt from the op's arguments.


def _dtype(t: Tensor | None) -> str | None:
    return None if t is None else str(t.dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=_ROW_PLANS)
def _cached_row_plan(
    op: str,
    dtype: str,
    device: str,
    device_kind: str,
    rows: int,
    cols: int,
    weight_dtype: str | None,
    bias_dtype: str | None,
    eps: float,
) -> Plan:
    compute = stats_dtype_for(dtype)
    return Plan(
        op=op,
        family="torch",
        device=device,
        device_kind=device_kind,
        dtype=dtype,
        shape=(rows, cols),
        axes=(1,),
        batch_axes=(0,),
        normalized_shape=(cols,),
        rows=rows,
        cols=cols,
        compute_dtype=compute,
        stats_dtype=compute,
        weight_dtype=weight_dtype,
        bias_dtype=bias_dtype,
        eps=eps,
        return_stats=not op.endswith("_backward"),  # the backward op needs mean and rstd
        requires_grad=False,  # the backend sees detached tensors
        return_residual=op.startswith("add_"),  # a fused op's gradient needs h
    )


def row_plan(
    op: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 0.0
) -> Plan:
    """The :class:`~normlab.hookspecs.Plan` of ``op`` on the 2-D rows ``x`` (validated already:
    by the caller's call, which the op is part of). Forward plans return statistics."""
    rows, cols = x.shape
    return _cached_row_plan(
        op,
        str(x.dtype).removeprefix("torch."),
        str(x.device),
        x.device.type,
        rows,
        cols,
        _dtype(weight),
        _dtype(bias),
        eps,
    )


def _readable(a: Tensor, backend: Backend) -> Tensor:
    """``a`` (2-D rows, detached) as ``backend`` reads it: itself, or a C-contiguous copy when
    the record claims neither ``strided`` nor, for unit column stride, ``row_strided``.
    (A gradient arriving in the backward may be any view: an expanded one, for ``y.sum()``.)"""
    a = a.detach()
    caps = backend.capabilities
    if "strided" in caps or ("row_strided" in caps and a.stride(1) == 1):
        return a
    return a.contiguous()


def _detached(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().contiguous()


def _stats_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# Forward ops


def _forward(
    op: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``op`` of the 2-D rows ``x`` by ``backend``'s own function: ``(y, mean, rstd)``."""
    served = registry.get(backend)
    x = _readable(x, served)
    weight, bias = _detached(weight), _detached(bias)
    plan = row_plan(op, x, weight, bias, eps)
    y, mean, rstd = served.function(op)(x, weight, bias, plan=plan, out=None)
    return y, mean, rstd


@torch.library.custom_op(
    "normlab::layer_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor? weight, Tensor? bias, float eps, str backend) "
    "-> (Tensor, Tensor, Tensor)",
)
def _layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` of the rows of the 2-D ``x`` (mean, rstd: 1-D) on ``backend``."""
    y, mean, rstd = _forward("layer_norm", x, weight, bias, eps, backend)
    assert mean is not None  # a forward row plan returns statistics
    return y, mean, rstd


@_layer_norm.register_fake
def _layer_norm_fake(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    rows = x.shape[0]
    stats = _stats_dtype(x)
    return x.new_empty(x.shape), x.new_empty(rows, dtype=stats), x.new_empty(rows, dtype=stats)


def _layer_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    x, weight, bias, _, backend = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.backend = backend
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_grad(ctx: Any, dy: Tensor, _dmean: Tensor, _drstd: Tensor) -> tuple[Any, ...]:
    x, weight, mean, rstd = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    dx, dweight, dbias = _layer_norm_backward(
        dy, x, mean, rstd, weight, need_x, need_weight, need_bias, ctx.backend
    )
    return (
        dx if need_x else None,
        dweight.to(weight.dtype) if need_weight else None,
        dbias.to(ctx.bias_dtype) if need_bias else None,
        None,
        None,
    )


_layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


@torch.library.custom_op(
    "normlab::rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor? weight, float eps, str backend) -> (Tensor, Tensor)",
)
def _rms_norm(x: Tensor, weight: Tensor | None, eps: float, backend: str) -> tuple[Tensor, Tensor]:
    """``(y, rstd)`` of the rows of the 2-D ``x`` (rstd: 1-D) on ``backend``."""
    y, _, rstd = _forward("rms_norm", x, weight, None, eps, backend)
    return y, rstd


@_rms_norm.register_fake
def _rms_norm_fake(
    x: Tensor, weight: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape[0], dtype=_stats_dtype(x))


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    x, weight, _, backend = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.backend = backend
    ctx.mark_non_differentiable(rstd)


def _rms_norm_grad(ctx: Any, dy: Tensor, _drstd: Tensor) -> tuple[Any, ...]:
    x, weight, rstd = ctx.saved_tensors
    need_x, need_weight = ctx.needs_input_grad[:2]
    dx, dweight = _rms_norm_backward(dy, x, rstd, weight, need_x, need_weight, ctx.backend)
    return dx if need_x else None, dweight.to(weight.dtype) if need_weight else None, None, None


_rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# --------------------------------------------------------------------------------------------
# Fused forward ops: h = x + residual, then the base op of h


def _fused(
    op: str,
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """``op`` of the 2-D rows ``x`` and ``residual`` by ``backend``'s own function:
    ``(y, h, mean, rstd)``."""
    served = registry.get(backend)
    x, residual = _readable(x, served), _readable(residual, served)
    weight, bias = _detached(weight), _detached(bias)
    plan = row_plan(op, x, weight, bias, eps)
    y, h, mean, rstd = served.function(op)(
        x, residual, weight, bias, plan=plan, out=None, residual_out=None
    )
    return y, h, mean, rstd


@torch.library.custom_op(
    "normlab::add_layer_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, str backend) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _add_layer_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y, h, mean, rstd)`` of the 2-D rows ``x + residual`` on ``backend``."""
    y, h, mean, rstd = _fused("add_layer_norm", x, residual, weight, bias, eps, backend)
    assert mean is not None  # a forward row plan returns statistics
    return y, h, mean, rstd


@_add_layer_norm.register_fake
def _add_layer_norm_fake(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, mean, rstd = _layer_norm_fake(x, weight, bias, eps, backend)
    return y, x.new_empty(x.shape), mean, rstd


def _add_layer_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    _, _, weight, bias, _, backend = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h, weight, mean, rstd)
    ctx.backend = backend
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _with_residual_grad(dh: Tensor | None, dx: Tensor, need_x: bool, need_residual: bool) -> Any:
    """``dh + dx``: the gradient of both x and residual (h = x + residual)."""
    if not (need_x or need_residual):
        return None, None
    total = dx if dh is None else dx + dh
    return (total if need_x else None), (total if need_residual else None)


def _add_layer_norm_grad(
    ctx: Any, dy: Tensor, dh: Tensor, _dmean: Tensor, _drstd: Tensor
) -> tuple[Any, ...]:
    h, weight, mean, rstd = ctx.saved_tensors
    need_x, need_residual, need_weight, need_bias = ctx.needs_input_grad[:4]
    dx, dweight, dbias = _layer_norm_backward(
        dy, h, mean, rstd, weight, need_x or need_residual, need_weight, need_bias, ctx.backend
    )
    return (
        *_with_residual_grad(dh, dx, need_x, need_residual),
        dweight.to(weight.dtype) if need_weight else None,
        dbias.to(ctx.bias_dtype) if need_bias else None,
        None,
        None,
    )


_add_layer_norm.register_autograd(_add_layer_norm_grad, setup_context=_add_layer_norm_setup)


@torch.library.custom_op(
    "normlab::add_rms_norm",
    mutates_args=(),
    schema="(Tensor x, Tensor residual, Tensor? weight, float eps, str backend) "
    "-> (Tensor, Tensor, Tensor)",
)
def _add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, h, rstd)`` of the 2-D rows ``x + residual`` on ``backend``."""
    y, h, _, rstd = _fused("add_rms_norm", x, residual, weight, None, eps, backend)
    return y, h, rstd


@_add_rms_norm.register_fake
def _add_rms_norm_fake(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    y, rstd = _rms_norm_fake(x, weight, eps, backend)
    return y, x.new_empty(x.shape), rstd


def _add_rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    _, _, weight, _, backend = inputs
    _, h, rstd = output
    ctx.save_for_backward(h, weight, rstd)
    ctx.backend = backend
    ctx.mark_non_differentiable(rstd)


def _add_rms_norm_grad(ctx: Any, dy: Tensor, dh: Tensor, _drstd: Tensor) -> tuple[Any, ...]:
    h, weight, rstd = ctx.saved_tensors
    need_x, need_residual, need_weight = ctx.needs_input_grad[:3]
    dx, dweight = _rms_norm_backward(
        dy, h, rstd, weight, need_x or need_residual, need_weight, ctx.backend
    )
    return (
        *_with_residual_grad(dh, dx, need_x, need_residual),
        dweight.to(weight.dtype) if need_weight else None,
        None,
        None,
    )


_add_rms_norm.register_autograd(_add_rms_norm_grad, setup_context=_add_rms_norm_setup)


# --------------------------------------------------------------------------------------------
# Backward ops


def _gradients(
    op: str,
    dy: Tensor,
    x: Tensor,
    mean: Tensor | None,
    rstd: Tensor,
    weight: Tensor | None,
    needs: frozenset[str],
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward ``op`` of 2-D rows by ``backend``'s own function; an empty tensor for a
    gradient not in ``needs`` (dweight and dbias in the compute dtype)."""
    served = registry.get(backend)
    stats = _stats_dtype(x)
    dx = dweight = dbias = None
    if needs and x.numel() > 0:
        dy, x = _readable(dy, served), _readable(x, served)
        weight = _detached(weight)
        rstd = rstd.detach().contiguous()
        plan = row_plan(op, x, weight, None)
        function = served.function(op)
        if mean is None:
            dx, dweight = function(dy, x, rstd, weight, plan=plan, needs=needs)
        else:
            mean = mean.detach().contiguous()
            dx, dweight, dbias = function(dy, x, mean, rstd, weight, plan=plan, needs=needs)
    elif needs:  # no rows or no columns: no kernel; an empty dx and zero sums
        cols = x.shape[1]
        dx = x.new_empty(x.shape) if "x" in needs else None
        dweight = x.new_zeros(cols, dtype=stats) if "weight" in needs else None
        dbias = x.new_zeros(cols, dtype=stats) if "bias" in needs else None
    return (  # outputs of a custom op may not alias one another: one empty tensor each
        x.new_empty(0) if dx is None else dx,
        x.new_empty(0, dtype=stats) if dweight is None else dweight,
        x.new_empty(0, dtype=stats) if dbias is None else dbias,
    )


def _needs(need_x: bool, need_weight: bool, need_bias: bool) -> frozenset[str]:
    flags = (("x", need_x), ("weight", need_weight), ("bias", need_bias))
    return frozenset(name for name, needed in flags if needed)


def _fake_gradients(
    x: Tensor, need_x: bool, need_weight: bool, need_bias: bool
) -> tuple[Tensor, Tensor, Tensor]:
    stats = _stats_dtype(x)
    cols = x.shape[1]
    return (
        x.new_empty(x.shape if need_x else (0,)),
        x.new_empty(cols if need_weight else 0, dtype=stats),
        x.new_empty(cols if need_bias else 0, dtype=stats),
    )


@torch.library.custom_op(
    "normlab::layer_norm_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, bool need_x, "
    "bool need_weight, bool need_bias, str backend) -> (Tensor, Tensor, Tensor)",
)
def _layer_norm_backward(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    need_x: bool,
    need_weight: bool,
    need_bias: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` of 2-D rows on ``backend``: dweight and dbias in the compute
    dtype; a gradient not needed is an empty 1-D tensor."""
    needs = _needs(need_x, need_weight, need_bias)
    return _gradients("layer_norm_backward", dy, x, mean, rstd, weight, needs, backend)


@_layer_norm_backward.register_fake
def _layer_norm_backward_fake(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    need_x: bool,
    need_weight: bool,
    need_bias: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_gradients(x, need_x, need_weight, need_bias)


@torch.library.custom_op(
    "normlab::rms_norm_backward",
    mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor rstd, Tensor? weight, bool need_x, bool need_weight, "
    "str backend) -> (Tensor, Tensor)",
)
def _rms_norm_backward(
    dy: Tensor,
    x: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    need_x: bool,
    need_weight: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of 2-D rows on ``backend``, as ``normlab::layer_norm_backward``."""
    needs = _needs(need_x, need_weight, False)
    dx, dweight, _ = _gradients("rms_norm_backward", dy, x, None, rstd, weight, needs, backend)
    return dx, dweight


@_rms_norm_backward.register_fake
def _rms_norm_backward_fake(
    dy: Tensor,
    x: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    need_x: bool,
    need_weight: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    dx, dweight, _ = _fake_gradients(x, need_x, need_weight, False)
    return dx, dweight


# --------------------------------------------------------------------------------------------
# The backend op contract (normlab.hookspecs, normlab.backward) through the ops: what the core
# runs in place of the chosen backend's own functions.


def _layer_norm_in_graph(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, *, plan: Plan, out: None, backend: str
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    y, mean, rstd = _layer_norm(x, weight, bias, plan.eps, backend)
    return (y, mean, rstd) if plan.return_stats else (y, None, None)


def _rms_norm_in_graph(
    x: Tensor, weight: Tensor | None, bias: None, *, plan: Plan, out: None, backend: str
) -> tuple[Tensor, None, Tensor | None]:
    y, rstd = _rms_norm(x, weight, plan.eps, backend)
    return (y, None, rstd) if plan.return_stats else (y, None, None)


def _add_layer_norm_in_graph(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    *,
    plan: Plan,
    out: None,
    residual_out: None,
    backend: str,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    y, h, mean, rstd = _add_layer_norm(x, residual, weight, bias, plan.eps, backend)
    h_or_none = h if plan.return_residual else None
    return (y, h_or_none, mean, rstd) if plan.return_stats else (y, h_or_none, None, None)


def _add_rms_norm_in_graph(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: None,
    *,
    plan: Plan,
    out: None,
    residual_out: None,
    backend: str,
) -> tuple[Tensor, Tensor | None, None, Tensor | None]:
    y, h, rstd = _add_rms_norm(x, residual, weight, plan.eps, backend)
    h_or_none = h if plan.return_residual else None
    return (y, h_or_none, None, rstd) if plan.return_stats else (y, h_or_none, None, None)


def _layer_norm_backward_in_graph(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    *,
    plan: Plan,
    needs: frozenset[str],
    backend: str,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    flags = ("x" in needs, "weight" in needs, "bias" in needs)
    dx, dweight, dbias = _layer_norm_backward(dy, x, mean, rstd, weight, *flags, backend)
    return (
        dx if flags[0] else None,
        dweight if flags[1] else None,
        dbias if flags[2] else None,
    )


def _rms_norm_backward_in_graph(
    dy: Tensor,
    x: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    *,
    plan: Plan,
    needs: frozenset[str],
    backend: str,
) -> tuple[Tensor | None, Tensor | None]:
    flags = ("x" in needs, "weight" in needs)
    dx, dweight = _rms_norm_backward(dy, x, rstd, weight, *flags, backend)
    return dx if flags[0] else None, dweight if flags[1] else None


_IN_GRAPH: Final[dict[str, Callable[..., Any]]] = {
    "layer_norm": _layer_norm_in_graph,
    "rms_norm": _rms_norm_in_graph,
    "add_layer_norm": _add_layer_norm_in_graph,
    "add_rms_norm": _add_rms_norm_in_graph,
    "layer_norm_backward": _layer_norm_backward_in_graph,
    "rms_norm_backward": _rms_norm_backward_in_graph,
}


class InGraph(Backend):
    """A backend that records no autograd graph, as the core runs it on torch tensors that
    require grad or inside a torch trace: its record without ``out`` and ``inplace`` (the core
    copies the result into ``out``, recorded by torch), each op through its custom op."""

    def __init__(self, served: Backend) -> None:
        capabilities = served.capabilities - {"out", "inplace"}
        super().__init__(dataclasses.replace(served.record, capabilities=capabilities),
                         served.provided_by)  # fmt: skip
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
        return functools.partial(_IN_GRAPH[op], backend=self.name)

    def prepared(self, op: str, plan: Any) -> None:
        """None: every call goes through the custom op (the served backend's prepared
        functions would leave the graph)."""
        return None


_wrapped: dict[Choice, Choice] = {}


def in_graph(choice: Choice) -> Choice:
    """``choice`` with its backend run through the custom ops (cached: one :class:`InGraph` per
    choice, so the routes that layout caches per backend stay few)."""
    wrapped = _wrapped.get(choice)
    if wrapped is None:
        if len(_wrapped) >= _ROW_PLANS:  # choices of backends registered since: start afresh
            _wrapped.clear()
        how = f"{choice.how}; run through normlab's custom op (it records no autograd graph)"
        wrapped = _wrapped[choice] = Choice(InGraph(choice.backend), how, choice.notes)
    return wrapped
