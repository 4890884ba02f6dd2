"""PyTorch integration: normlab's kernels inside autograd, ``torch.compile`` and ``torch.export``.

* :class:`LayerNorm` and :class:`RMSNorm`: drop-in subclasses of ``torch.nn.LayerNorm`` and
  ``torch.nn.RMSNorm`` (same constructor, parameters and ``state_dict`` keys) that compute with
  :func:`normlab.layer_norm` / :func:`normlab.rms_norm`, plus ``backend=``;
  :func:`replace_layer_norms` swaps them into a model, keeping its parameters.
* The custom ops ``normlab::layer_norm``, ``normlab::rms_norm`` and their ``*_backward``
  (``torch.library.custom_op``, with fake implementations for tracing and a registered autograd
  formula). A backend that computes outside torch (numba, on CPU tensors) sends tensors that
  require grad through them, so its results stay in the graph and ``torch.compile`` and
  ``torch.export`` see one opaque op; the gradients come from the same backend's backward
  kernels (:mod:`normlab.backward`). ``mean`` and ``rstd`` are not differentiable, and the
  backward ops have no autograd formula of their own (no double backward: torch says so when
  asked).

Importing this module imports torch and registers the ops; ``import normlab`` does not import it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import normlab
from normlab import backward, registry, spec
from normlab.spec import Plan

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "backward_with_autograd",
    "layer_norm_with_autograd",
    "replace_layer_norms",
    "rms_norm_with_autograd",
]

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# Custom ops. Each takes 2-D rows (the view the core hands a backend) and the name of the
# backend that computes it; the op runs that backend on detached tensors.


def _detached(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()


def _stats_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


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
    y, mean, rstd = normlab.layer_norm(
        x.detach(), x.shape[1], _detached(weight), _detached(bias), eps,
        backend=backend, return_stats=True,
    )  # fmt: skip
    return y, mean.reshape(-1), rstd.reshape(-1)


@_layer_norm.register_fake
def _layer_norm_fake(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    rows = x.shape[0]
    stats = _stats_dtype(x)
    return x.new_empty(x.shape), x.new_empty(rows, dtype=stats), x.new_empty(rows, dtype=stats)


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
    y, rstd = normlab.rms_norm(
        x.detach(), x.shape[1], _detached(weight), eps, backend=backend, return_stats=True
    )
    return y, rstd.reshape(-1)


@_rms_norm.register_fake
def _rms_norm_fake(
    x: Tensor, weight: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape[0], dtype=_stats_dtype(x))


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


def _needs(need_x: bool, need_weight: bool, need_bias: bool) -> tuple[str, ...]:
    flags = (("x", need_x), ("weight", need_weight), ("bias", need_bias))
    return tuple(name for name, needed in flags if needed)


def _gradients(
    op: str,
    dy: Tensor,
    x: Tensor,
    mean: Tensor | None,
    rstd: Tensor,
    weight: Tensor | None,
    needs: tuple[str, ...],
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward op of 2-D rows on ``backend``; an empty tensor for a gradient not needed."""
    dy, x, weight = dy.detach(), x.detach(), _detached(weight)
    rstd2 = rstd.detach()[:, None]
    mean2 = None if mean is None else mean.detach()[:, None]
    call = spec.validated_backward(op, dy, x, mean2, rstd2, weight, None, None, needs)
    dx, dweight, dbias = backward.gradients(call, dy, x, mean2, rstd2, weight, backend)
    stats = _stats_dtype(x)
    return (  # outputs of a custom op may not alias one another: one empty tensor each
        x.new_empty(0) if dx is None else dx,
        x.new_empty(0, dtype=stats) if dweight is None else dweight,
        x.new_empty(0, dtype=stats) if dbias is None else dbias,
    )


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


# --------------------------------------------------------------------------------------------
# Entry points for backends: the backend op contract (see normlab.hookspecs), through the
# custom ops. A backend calls these for tensors that require grad.


def layer_norm_with_autograd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, *, plan: Plan, backend: str
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``layer_norm`` of the 2-D ``x`` by ``backend``, recorded by autograd as one op."""
    y, mean, rstd = _layer_norm(x, weight, bias, plan.eps, backend)
    return (y, mean, rstd) if plan.return_stats else (y, None, None)


def rms_norm_with_autograd(
    x: Tensor, weight: Tensor | None, bias: None, *, plan: Plan, backend: str
) -> tuple[Tensor, None, Tensor | None]:
    """``rms_norm`` of the 2-D ``x`` by ``backend``, recorded by autograd as one op."""
    y, rstd = _rms_norm(x, weight, plan.eps, backend)
    return (y, None, rstd) if plan.return_stats else (y, None, None)


def backward_with_autograd(
    dy: Tensor,
    x: Tensor,
    mean: Tensor | None,
    rstd: Tensor,
    weight: Tensor | None,
    *,
    needs: frozenset[str],
    backend: str,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """A backward op (2-D rows, ``mean`` None for RMSNorm) by ``backend`` through its custom op:
    the result stays in the graph, and differentiating it raises torch's error."""
    flags = ("x" in needs, "weight" in needs, "bias" in needs)
    if mean is None:
        dx, dweight = _rms_norm_backward(dy, x, rstd, weight, *flags[:2], backend)
        dbias = None
    else:
        dx, dweight, dbias = _layer_norm_backward(dy, x, mean, rstd, weight, *flags, backend)
    return (
        dx if flags[0] else None,
        dweight if flags[1] else None,
        dbias if flags[2] else None,
    )


# --------------------------------------------------------------------------------------------
# Modules


# The modules call normlab through these two functions, which torch.compile keeps as single
# nodes (allow_in_graph): dynamo does not trace normlab's validation and dispatch, and
# AOTAutograd runs them on fake tensors, which reach the custom ops above (or torch's own
# ops). The route is fixed when a graph is compiled. ``eps`` may arrive as a symbolic float.
# Dynamo matches these functions by identity: they are registered when a module is built.


def _layer_norm_node(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    backend: str | None,
) -> Tensor:
    y: Tensor = normlab.layer_norm(x, normalized_shape, weight, bias, float(eps), backend=backend)
    return y


def _rms_norm_node(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None,
    eps: float | None,
    backend: str | None,
) -> Tensor:
    eps_value = None if eps is None else float(eps)
    y: Tensor = normlab.rms_norm(x, normalized_shape, weight, eps_value, backend=backend)
    return y


@functools.cache
def _allow_nodes_in_graph() -> None:
    """Register the two nodes with dynamo: on the first module built, not at import (it imports
    torch._dynamo, seconds that the backends' hooks into this module should not pay)."""
    torch.compiler.allow_in_graph(_layer_norm_node)  # type: ignore[no-untyped-call]
    torch.compiler.allow_in_graph(_rms_norm_node)  # type: ignore[no-untyped-call]


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by :func:`normlab.layer_norm`.

    The constructor, parameters and ``state_dict`` keys are those of ``torch.nn.LayerNorm``;
    ``backend`` (keyword only) names the normlab backend, strictly as ``backend=`` does, or
    None to let normlab choose (``normlab.use_backend`` applies).
    """

    def __init__(
        self,
        normalized_shape: Any,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        backend: str | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        if backend is not None:
            registry.get(backend)
        self.backend = backend
        _allow_nodes_in_graph()

    def forward(self, input: Tensor) -> Tensor:
        return _layer_norm_node(
            input, self.normalized_shape, self.weight, self.bias, self.eps, self.backend
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by :func:`normlab.rms_norm` (``eps=None``: the machine
    epsilon of the input's dtype, as torch); constructor, parameters and ``state_dict`` as
    ``torch.nn.RMSNorm``, plus ``backend`` as for :class:`LayerNorm`."""

    def __init__(
        self,
        normalized_shape: Any,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        backend: str | None = None,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        if backend is not None:
            registry.get(backend)
        self.backend = backend
        _allow_nodes_in_graph()

    def forward(self, x: Tensor) -> Tensor:
        return _rms_norm_node(x, self.normalized_shape, self.weight, self.eps, self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"


def replace_layer_norms(model: torch.nn.Module, backend: str | None = None) -> torch.nn.Module:
    """Swap every ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` in ``model`` for normlab's.

    The new modules hold the very same parameter objects (an optimizer built before still
    updates them) and the same training mode. Only modules of exactly those classes are
    swapped: a subclass may override ``forward`` and is left alone. Returns ``model`` (or its
    replacement, when ``model`` itself is one of them).
    """
    if backend is not None:
        registry.get(backend)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swapped = _swap(child, backend)
            if swapped is not child:
                setattr(parent, name, swapped)
    return _swap(model, backend)


def _swap(module: torch.nn.Module, backend: str | None) -> torch.nn.Module:
    new: torch.nn.Module
    if type(module) is torch.nn.LayerNorm:
        new = LayerNorm(
            module.normalized_shape, module.eps, module.elementwise_affine,
            bias=module.bias is not None, device="meta", backend=backend,
        )  # fmt: skip
        new.weight, new.bias = module.weight, module.bias
    elif type(module) is torch.nn.RMSNorm:
        new = RMSNorm(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            device="meta",
            backend=backend,
        )
        new.weight = module.weight
    else:
        return module
    return new.train(module.training)
