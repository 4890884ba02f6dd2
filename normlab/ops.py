"""The op table: for each op, the role of every array it takes and which output may alias which
input. :mod:`normlab.spec` validates every op from this table and nothing else; a new op (a
fused one) is a new entry here plus its arithmetic in the backends.

Roles of the array arguments:

- ``like_x``: the arrays of x's shape, dtype, library and device (``x`` among them). The core makes
  2-D rows of each (:func:`normlab.layout.rows`), without a copy where the backend reads them.
- ``stats``: statistics inputs, shaped as x with 1 on the normalized axes, in the stats dtype.
- ``per_feature``: arrays of the normalized shape (weight, bias), in x's dtype (or float32 for
  float16/bfloat16 x).

Outputs: ``outputs`` in the order the op returns them (the first is written into ``out``);
``stats_outputs`` are returned too with ``return_stats=True``. ``in_place`` lists the
``(output, input)`` pairs that may be the very same memory (an in-place call); any other overlap
between an output and an input, or between two outputs, is an ArgumentError.

A fused op names its ``base``: the op it applies after its own first step (``add_layer_norm``
normalizes ``h = x + residual`` as ``layer_norm`` does). Its gradients are the base op's
backward plus that step's, and a backend that provides the base op but not the fused one is
served by the core's composition (:mod:`normlab.fused`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["BACKWARD_OPS", "FORWARD_OPS", "FUSED_OPS", "OPS", "Op"]


@dataclass(frozen=True, slots=True)
class Op:
    """One row of the op table (see the module docstring for the roles)."""

    name: str
    like_x: tuple[str, ...]
    per_feature: tuple[str, ...]
    outputs: tuple[str, ...]
    stats: tuple[str, ...] = ()
    stats_outputs: tuple[str, ...] = ()
    in_place: frozenset[tuple[str, str]] = frozenset()
    #: The eps a call without one gets; None: ``finfo(x.dtype).eps``. Backward ops take none.
    default_eps: float | None = None
    takes_eps: bool = True
    #: Backward ops: the gradients ``needs`` may name, in the order they are returned.
    gradients: tuple[str, ...] = ()
    #: Fused ops: the op applied after the fused step (its backward op serves the gradients).
    base: str | None = None

    @property
    def arrays(self) -> tuple[str, ...]:
        """Every array argument, in the order the op's function takes them."""
        return (*self.like_x, *self.stats, *self.per_feature)


OPS: Final = {
    op.name: op
    for op in (
        Op(
            "layer_norm",
            like_x=("x",),
            per_feature=("weight", "bias"),
            outputs=("y",),
            stats_outputs=("mean", "rstd"),
            in_place=frozenset({("y", "x")}),
            default_eps=1e-5,
        ),
        Op(
            "rms_norm",
            like_x=("x",),
            per_feature=("weight",),
            outputs=("y",),
            stats_outputs=("rstd",),
            in_place=frozenset({("y", "x")}),
        ),
        Op(
            "add_layer_norm",
            like_x=("x", "residual"),
            per_feature=("weight", "bias"),
            outputs=("y", "h"),
            stats_outputs=("mean", "rstd"),
            in_place=frozenset({("y", "x"), ("y", "residual"), ("h", "residual"), ("h", "x")}),
            default_eps=1e-5,
            base="layer_norm",
        ),
        Op(
            "add_rms_norm",
            like_x=("x", "residual"),
            per_feature=("weight",),
            outputs=("y", "h"),
            stats_outputs=("rstd",),
            in_place=frozenset({("y", "x"), ("y", "residual"), ("h", "residual"), ("h", "x")}),
            base="rms_norm",
        ),
        Op(
            "layer_norm_backward",
            like_x=("dy", "x"),
            stats=("mean", "rstd"),
            per_feature=("weight",),
            outputs=("dx", "dweight", "dbias"),
            takes_eps=False,
            gradients=("x", "weight", "bias"),
        ),
        Op(
            "rms_norm_backward",
            like_x=("dy", "x"),
            stats=("rstd",),
            per_feature=("weight",),
            outputs=("dx", "dweight"),
            takes_eps=False,
            gradients=("x", "weight"),
        ),
    )
}
FORWARD_OPS: Final = tuple(name for name, op in OPS.items() if not op.gradients and op.base is None)
FUSED_OPS: Final = tuple(name for name, op in OPS.items() if op.base is not None)
BACKWARD_OPS: Final = tuple(name for name, op in OPS.items() if op.gradients)
