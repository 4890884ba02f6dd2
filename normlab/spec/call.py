"""The validated call: what the core knows of one call of an op once its arguments passed the
rules (:mod:`normlab.spec.rules`), for any op of the table (:mod:`normlab.ops`).

A backend sees only its ``plan``. The rest is the core's: how the caller's arrays become the 2-D
rows a backend reads (the axis permutation, each x-like array's row strides), which inputs are
in non-native byte order, which outputs the caller gave memory for, the gradients a backward
call needs, and a per-backend cache of routes (:mod:`normlab.route`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from normlab.hookspecs import Plan
from normlab.ops import Op

__all__ = ["Call"]


@dataclass(frozen=True, slots=True)
class Call:
    """One validated call of ``op`` (cached by its arguments' metadata: one per kind of call).

    The caller's arrays are viewed with the batch axes first and the normalized axes last
    (``permutation``, None when that is already the order; ``inverse`` undoes it), of
    ``permuted_shape`` (``stats_shape`` for the statistics: the batch dims, then 1s), then as
    2-D ``(rows, cols)``. ``strides`` maps each x-like input (x, residual, dy) and each x-like
    output given (y into ``out``, h into ``residual_out``) to the element strides ``(row, col)``
    of that view, or None when no such view exists (a copy, or a temporary, is needed; an output
    in non-native byte order is always written through a temporary). ``non_native`` names the
    inputs in non-native byte order; ``outputs`` the outputs the caller gave memory for
    (``y``, ``h``, ``mean``, ``rstd``); ``needs`` the gradients a backward call asks for;
    ``parameters`` what the core composes for a backend that does not take the parameters as
    given (:mod:`normlab.parameters`): ``"weight_offset"`` (a nonzero offset), ``"weight"`` and
    ``"bias"`` (a dtype other than x's, or float32 for half x); ``residual_stream`` that a fused
    op's residual is a float32 stream beside half x (:mod:`normlab.residual_stream`);
    ``casting`` the order of RMSNorm's weight multiply and rounding, ``"exact"`` without a
    weight (:mod:`normlab.casting`); ``quantize`` the mode of quantized outputs (None: y) and
    ``quantize_scale`` their static scale (None: dynamic, per row; :mod:`normlab.quantize`);
    ``reshaped`` that any of these applies (the public route's one test of them).
    ``routes`` caches, per backend, how the call runs on it (:func:`normlab.route.route`).
    """

    op: Op
    plan: Plan
    permutation: tuple[int, ...] | None
    inverse: tuple[int, ...] | None
    permuted_shape: tuple[int, ...]
    stats_shape: tuple[int, ...]
    strides: dict[str, tuple[int, int] | None]
    non_native: frozenset[str]
    outputs: frozenset[str] = frozenset()
    needs: frozenset[str] = frozenset()
    parameters: frozenset[str] = frozenset()
    residual_stream: bool = False
    casting: str = "exact"
    quantize: str | None = None
    quantize_scale: float | None = None
    reshaped: bool = False
    routes: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def given_outputs(self, args: tuple[Any, ...]) -> dict[str, Any]:
        """The caller's output arrays among ``args`` (the op's arguments), by output name: ``y``
        and, when ``out`` is a tuple, the statistics (``mean``, ``rstd``) from ``out``; ``h``
        from ``residual_out``. None for an output not given; empty for an op without outputs to
        give."""
        given: dict[str, Any] = {}
        index = self.op.index
        for argument, name in self.op.output_arguments.items():
            value = args[index[argument]]
            if isinstance(value, tuple):  # out=(y, mean, rstd) with return_stats
                given[name] = value[0]
                given.update(zip(self.op.stats_outputs, value[1:], strict=True))
            else:
                given[name] = value
        return given
