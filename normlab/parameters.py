"""The core's composition of the parameters a backend does not take as given.

Backends take a weight and bias in x's dtype (or float32 for half x) and no offset. A call may
give more (:attr:`normlab.spec.Call.parameters` says what):

- ``weight_offset``: the weight is used as ``weight_offset + weight`` (Gemma's RMSNorm,
  Transformer Engine's ``zero_centered_gamma``, Liger's ``offset``), formed in the compute dtype
  (float32, float64 for float64 x) and rounded once there;
- a weight or bias of another float dtype (a bfloat16 weight beside float32 x, a float64 one
  beside float16 x): converted to the compute dtype, where the arithmetic happens anyway.

For a backend that does not declare the capability ``"weight_offset"`` (or for any call with a
converted parameter, :func:`native`), :func:`composed` forms those parameters in the arrays'
own library, once per call, and the call goes on as a plain one: the bits are those of a call
given ``offset + weight`` in the compute dtype, on every backend. Nothing is cached across calls: a
NumPy array can change in place without a trace, so a weight is read afresh every call. For
torch tensors the conversion and the addition are torch operations, so autograd carries the
gradient back to the caller's parameter, in its own dtype.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from normlab import arrays
from normlab.dispatch import Choice
from normlab.hookspecs import Plan
from normlab.spec import Call

__all__ = ["composed", "described", "native"]


def native(call: Call, choice: Choice) -> bool:
    """Whether the chosen backend takes the call's parameters as given: they need no conversion,
    its record declares ``"weight_offset"``, and no custom op of normlab's stands between (one
    records no offset: :mod:`normlab.torch_ops`)."""
    return (
        call.parameters == {"weight_offset"}
        and "weight_offset" in choice.backend.capabilities
        and not choice.records_no_graph
    )


def composed(call: Call, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The op's arguments ``args`` with the parameters as every backend takes them: the weight as
    ``weight_offset + weight`` in the compute dtype (and an offset of 0), a weight or bias of
    another dtype in the compute dtype."""
    op, plan = call.op, call.plan
    given = list(args)
    for name in op.per_feature:
        p = args[op.index[name]]
        if p is None:
            continue
        offset = plan.weight_offset if name == "weight" else 0.0
        if offset or name in call.parameters:
            given[op.index[name]] = _in_compute_dtype(p, plan, offset)
    if "weight_offset" in op.index:
        given[op.index["weight_offset"]] = 0.0
    return tuple(given)


def described(call: Call) -> str:
    """What :func:`composed` does for ``call``, in a line of :func:`normlab.explain`."""
    plan = call.plan
    formed = []
    if "weight_offset" in call.parameters:
        formed.append(f"weight_offset + weight ({plan.weight_offset!r} + {plan.weight_dtype})")
    formed.extend(
        f"{name} ({getattr(plan, name + '_dtype')})"
        for name in ("weight", "bias")
        if name in call.parameters and not (name == "weight" and "weight_offset" in call.parameters)
    )
    return (
        f"the core forms {', '.join(formed)} in {plan.compute_dtype}, once per call, and the "
        "backend is chosen for the call with those"
    )


def _in_compute_dtype(p: Any, plan: Plan, offset: float) -> Any:
    """``offset + p`` (or ``p`` alone when the offset is 0) in the compute dtype."""
    xp = array_api_compat.array_namespace(p)
    converted = arrays.astype(p, getattr(xp, plan.compute_dtype))
    return converted + offset if offset else converted
