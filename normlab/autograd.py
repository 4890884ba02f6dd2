"""The core keeps torch's autograd graph, once, for backends that record none, and lets torch's
own dispatch see tensors that are not plain memory.

A backend that computes outside torch (numba on CPU tensors, the cupy backend's CUDA kernels)
returns tensors without a ``grad_fn``, and cannot run on tensors without real memory. For such a
backend (:attr:`normlab.dispatch.Choice.records_no_graph`) the core routes a call on torch
tensors by what torch needs to see of it (:func:`through_graph`):

* **through normlab's custom ops** (:mod:`normlab.torch_ops`) when a tensor requires grad, a
  ``torch.compile``/``torch.export`` trace is in progress, or a tensor is one that torch's
  dispatcher must handle: a ``FakeTensor`` (tracing), a functional tensor
  (``torch.func.functionalize``) or a tensor subclass with its own ``__torch_dispatch__``
  (``TwoTensor``, ``DTensor``…). The op's fake implementation, functionalization or the
  subclass then does what it does for any torch op; the backend's kernels only ever see plain
  tensors. Validation (spec) and dispatch ran once, for the caller's arguments; layout makes the
  rows as for any call; the op rebuilds the backend's row plan from its scalar arguments;
* **on the torch backend** when a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``…) or
  forward-mode AD (a dual tensor) sees the call: torch's own ops carry their rules, the
  custom ops have none; and under ``torch.jit.trace``, which records torch's ops (a kernel
  outside torch would be traced as a constant);
* refused with an :class:`~normlab.errors.ArgumentError` naming the tensor when a plain tensor
  has no memory (its storage resized to 0, as FSDP does to freed parameters).

Backends never call up into torch integration. Importing this module does not import torch;
:func:`through_graph` imports :mod:`normlab.torch_ops` the first time a call needs it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from normlab import registry
from normlab.dispatch import Choice
from normlab.errors import ArgumentError, BackendError
from normlab.hookspecs import Plan

__all__ = ["TRANSFORM", "through_graph", "torch_seen"]

#: What :func:`torch_seen` answers for a call that a torch.func transform or forward AD sees.
TRANSFORM: Final = "a torch.func transform or forward-mode AD"
#: ... and for one whose tensors torch's dispatcher must handle.
DISPATCHED: Final = "a fake, functional, negated-view or tensor-subclass input"
#: The names of a call's outputs among the tensors :func:`torch_seen` checks.
_OUTPUTS: Final = frozenset({"out", "residual_out"})


def through_graph(
    plan: Plan, choice: Choice, names: tuple[str, ...], tensors: tuple[Any, ...]
) -> Choice:
    """``choice``, or how a call on torch tensors must run when its backend records no graph:
    on the torch backend under a torch.func transform, forward AD or ``torch.jit.trace``,
    through the custom ops when the call needs a graph or torch's dispatch must see its tensors
    (see the module docstring). ``tensors``: the call's tensors (None entries allowed), named
    by ``names`` in the same order; a plain one without memory raises ArgumentError, whatever
    the backend."""
    if plan.family != "torch":
        return choice
    seen = torch_seen(names, tensors)  # raises for a tensor without memory
    if not choice.records_no_graph:
        return choice  # torch's own ops see the call
    torch = _TORCH_REFS or _torch_refs()
    if seen is TRANSFORM or torch.jit_tracing_state() is not None:
        return _on_torch(plan, choice)  # a transform, or torch.jit.trace: torch's ops record it
    if seen is not None or plan.requires_grad or torch.is_compiling():
        from normlab import torch_ops

        return torch_ops.in_graph(choice)
    return choice


def torch_seen(names: tuple[str, ...], tensors: tuple[Any, ...]) -> str | None:
    """:data:`TRANSFORM` or :data:`DISPATCHED` when torch must see a call on ``tensors``
    (named by ``names``; None entries and tuples skipped), else None (plain memory). A plain
    tensor with elements but no memory, or an output that is a negated view, raises
    ArgumentError naming it.

    Plain tensors of real memory take a fast path (their type, negative bit and address: about
    0.15 µs each); anything else is classified by :func:`_classified`."""
    torch = _TORCH_REFS or _torch_refs()
    plain, parameter = torch.Tensor, torch.Parameter
    try:
        for t in tensors:
            if t is None:
                continue
            kind = type(t)
            if kind is not plain and kind is not parameter:
                if kind is tuple:
                    continue
                break
            if t.is_neg() or not t.data_ptr():
                break
        else:
            if torch.forward_ad._current_level < 0:
                return None
    except RuntimeError:  # a functorch wrapper (vmap, grad, jvp): no storage of its own
        pass
    return _classified(names, tensors)


def _classified(names: tuple[str, ...], tensors: tuple[Any, ...]) -> str | None:
    """:func:`torch_seen` of a call whose tensors are not all plain memory, tensor by tensor."""
    torch = _torch_refs()
    dual = torch.forward_ad._current_level >= 0
    for name, t in zip(names, tensors, strict=True):
        if t is None or isinstance(t, tuple):
            continue
        kind: type = type(t)
        if kind is not torch.Tensor and kind is not torch.Parameter and _dispatches(kind):
            return DISPATCHED
        if t.is_neg():  # a view whose values are its memory's negated (torch._neg_view)
            if name in _OUTPUTS:
                raise ArgumentError(
                    f"{name} is a negated view (its values are its memory's, negated): normlab "
                    f"writes results into memory; pass {name}.resolve_neg()"
                )
            return DISPATCHED  # torch's dispatcher resolves the view before the op's kernel
        try:
            address = t.data_ptr()
        except RuntimeError:  # a functorch wrapper (vmap, grad, jvp): no storage of its own
            address = 0
        if address == 0 and t.numel() > 0:
            if torch.is_functorch_wrapped(t):
                return TRANSFORM
            if torch.is_functional(t):
                return DISPATCHED
            raise ArgumentError(
                f"{name} has no memory: its storage holds {t.untyped_storage().nbytes()} bytes "
                f"for {t.numel()} elements (resized to 0, as FSDP does to the parameters it "
                "frees); normlab reads only memory a tensor holds"
            )
        if dual and torch.forward_ad.unpack_dual(t).tangent is not None:
            return TRANSFORM
    return None


class _TorchRefs(NamedTuple):
    """The parts of torch that :func:`torch_seen` reads on every call, looked up once."""

    Tensor: type
    Parameter: type
    forward_ad: Any
    jit_tracing_state: Callable[[], Any]
    is_compiling: Callable[[], bool]
    is_functorch_wrapped: Callable[[Any], bool]
    is_functional: Callable[[Any], bool]


_TORCH_REFS: _TorchRefs | None = None


def _torch_refs() -> _TorchRefs:
    """:class:`_TorchRefs`, made on the first call (torch is imported: the call has tensors)."""
    global _TORCH_REFS
    if _TORCH_REFS is None:
        torch = sys.modules["torch"]
        import torch.autograd.forward_ad as forward_ad

        _TORCH_REFS = _TorchRefs(
            torch.Tensor,
            torch.nn.Parameter,
            forward_ad,
            torch._C._get_tracing_state,
            torch.compiler.is_compiling,
            torch._C._functorch.is_functorch_wrapped_tensor,
            torch._is_functional_tensor,
        )
    return _TORCH_REFS


@functools.lru_cache(maxsize=64)
def _dispatches(kind: type) -> bool:
    """Whether tensors of the subclass ``kind`` override ``__torch_dispatch__`` (FakeTensor, a
    wrapper subclass): torch's dispatcher, not their memory, defines what they hold."""
    torch = sys.modules["torch"]
    return getattr(kind, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__


def _on_torch(plan: Plan, choice: Choice) -> Choice:
    """The torch backend for a call that a transform sees (BackendError when it cannot serve:
    torch is what carries the transform's rules; also when the caller named another backend,
    which is strict)."""
    from normlab import dispatch

    if choice.how == dispatch.NAMED:
        raise BackendError(
            f"backend {choice.backend.name!r} cannot serve a call that {TRANSFORM} sees: its "
            "kernels run outside torch, which carries the transform's rules; leave backend= "
            "unset (normlab then runs torch's own ops) or name backend='torch'"
        )
    torch_backend = registry.get("torch")
    why = dispatch.refusal(torch_backend, plan, named=True)
    if why is not None:
        raise BackendError(
            f"{TRANSFORM} sees this call, whose rules only torch's own ops carry, and the torch "
            f"backend cannot serve it: it {why}"
        )
    return Choice(
        torch_backend,
        f"{choice.how}; {TRANSFORM} sees the call, so torch's own ops run it",
        choice.notes,
    )
