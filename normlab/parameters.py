"""The core's composition of the parameters a backend does not take as given.

Backends take a weight and bias in x's dtype (or float32 for half x) and no offset. A call may
give more (:attr:`normlab.spec.Call.parameters` says what):

- ``weight_offset``: the weight is used as ``weight_offset + weight`` (Gemma's RMSNorm,
  Transformer Engine's ``zero_centered_gamma``, Liger's ``offset``), formed in the compute dtype
  (float32, float64 for float64 x) and rounded once there;
- a weight or bias of another float dtype (a bfloat16 weight beside float32 x, a float64 one
  beside float16 x): converted to the compute dtype, where the arithmetic happens anyway.

A backend whose record declares the capability ``"weight_offset"`` (``"parameter_dtypes"``)
takes an offset (a parameter of another dtype) as given and forms the weight itself, in its own
pass over the ``cols`` parameters (the numba backend does both). For the others (and under
normlab's custom ops; :func:`native`), :func:`composed` forms those parameters in the arrays'
own library, once per call, and the call goes on as a plain one. Either way the bits are those
of a call given ``offset + weight`` in the compute dtype, on every backend. Nothing is cached
across calls: a NumPy array can change in place without a trace, so a weight is read afresh
every call. For torch tensors the conversion and the addition are torch operations, so autograd
carries the gradient back to the caller's parameter, in its own dtype.
"""

from __future__ import annotations

from typing import Any, Final

import array_api_compat

from normlab import arrays
from normlab.dispatch import Choice
from normlab.hookspecs import Plan
from normlab.option import Option
from normlab.spec import Call

__all__ = ["OPTION", "composed", "described", "native"]


def native(call: Call, choice: Choice) -> bool:
    """Whether the chosen backend (as the call runs it: ``choice`` after
    :func:`normlab.autograd.through_graph`) takes the call's parameters as given: its record
    declares ``"weight_offset"`` for an offset and ``"parameter_dtypes"`` for a weight or bias of
    another dtype (normlab's custom ops declare neither: :class:`normlab.torch_ops.InGraph`)."""
    capabilities = choice.backend.capabilities
    return all(_TAKEN_WITH[name] in capabilities for name in call.parameters)


#: The capability a backend takes each of :attr:`normlab.spec.Call.parameters` as given with.
_TAKEN_WITH: Final = {
    "weight_offset": "weight_offset",
    "weight": "parameter_dtypes",
    "bias": "parameter_dtypes",
}


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


def described(call: Call, choice: Choice, natively: bool) -> str:
    """What is done with ``call``'s parameters, in a line of :func:`normlab.explain`: the
    chosen backend takes them as given (:func:`native`), or :func:`composed`."""
    plan = call.plan
    formed = []
    if "weight_offset" in call.parameters:
        formed.append(f"weight_offset + weight ({plan.weight_offset!r} + {plan.weight_dtype})")
    formed.extend(
        f"{name} ({getattr(plan, name + '_dtype')})"
        for name in ("weight", "bias")
        if name in call.parameters and not (name == "weight" and "weight_offset" in call.parameters)
    )
    if natively:
        return (
            f"{choice.backend.name} takes them as given and forms {', '.join(formed)} in "
            f"{plan.compute_dtype} itself, in its pass over the parameters"
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


OPTION: Final = Option(
    title="parameters",
    capabilities=frozenset(_TAKEN_WITH.values()),
    applies=lambda call: bool(call.parameters),
    native=native,
    describe=described,
    formed=composed,
)
