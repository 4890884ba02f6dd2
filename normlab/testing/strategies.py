"""Hypothesis strategies for :class:`~normlab.testing.cases.Case` (and the backward and fused
cases wrapping one), and the two profiles.

A drawn case is plain data (shape, axes, dtypes, eps, values kind, seed, layout); the arrays
are made from the seed, so examples are cheap to draw and to shrink, and a failure prints a
:class:`Case` that reruns it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from normlab.constants import HALF_DTYPES
from normlab.ops import OPS
from normlab.testing.backward_cases import BACKWARD_OPS, BackwardCase
from normlab.testing.cases import LAYOUTS, Case
from normlab.testing.fused_cases import FUSED_OPS, FusedCase

__all__ = [
    "PROFILES",
    "RANDOM_VALUES",
    "affine",
    "axes_choices",
    "backward_cases",
    "cases",
    "dims",
    "eps_values",
    "fused_cases",
    "profile",
    "shapes",
]

#: The kinds of values drawn at random (the named kinds have their own tests).
RANDOM_VALUES: Final = ("normal", "offset", "rowwise", "tiny", "large", "integers")

#: fused op -> its base op.
BASE_OPS: Final = {fused: base for base, fused in FUSED_OPS.items()}

#: Largest number of elements of a drawn x.
MAX_ELEMENTS: Final = 6000

#: Axis lengths beyond 8 that are drawn: around powers of two, odd.
AWKWARD_DIMS: Final = (16, 17, 31, 33, 64, 127, 129, 257)

PROFILES: Final[dict[str, settings]] = {
    # Fast and reproducible: the same examples on every run, no example database, no
    # explanation phase.
    "ci": settings(
        max_examples=50,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[phase for phase in Phase if phase is not Phase.explain],
        suppress_health_check=[HealthCheck.too_slow],
    ),
    # Thorough: new examples each run, failures remembered in the example database.
    "full": settings(
        max_examples=1000,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    ),
}


def dims(most: int = MAX_ELEMENTS) -> st.SearchStrategy[int]:
    """One axis length up to ``most``: small ones (shrinking towards 1) and awkward ones."""
    awkward = [n for n in AWKWARD_DIMS if n <= most]
    small = st.integers(1, min(8, most))
    return st.one_of(small, st.sampled_from(awkward)) if awkward else small


@st.composite
def shapes(draw: st.DrawFn, min_rank: int = 1, max_rank: int = 4) -> tuple[int, ...]:
    """Shapes of rank ``min_rank``..``max_rank`` with at most :data:`MAX_ELEMENTS` elements."""
    shape: list[int] = []
    for _ in range(draw(st.integers(min_rank, max_rank))):
        shape.append(draw(dims(MAX_ELEMENTS // math.prod(shape))))
    return tuple(shape)


@st.composite
def axes_choices(
    draw: st.DrawFn, shape: tuple[int, ...]
) -> tuple[int | tuple[int, ...] | None, int | tuple[int, ...] | None]:
    """``(normalized_shape, axis)`` naming normalized axes of ``shape`` in every accepted way:
    the default, ``normalized_shape`` as an int or tuple, ``axis`` as an int or a tuple in any
    order (non-trailing, negative), or both in agreement."""
    ndim = len(shape)
    style = draw(st.sampled_from(["default", "shape", "axis", "axes", "both"]))
    if style == "default":
        return None, None
    if style in ("shape", "both"):
        k = draw(st.integers(1, ndim))
        trailing = shape[ndim - k :]
        normalized: int | tuple[int, ...] = (
            trailing[0] if k == 1 and draw(st.booleans()) else trailing
        )
        if style == "shape":
            return normalized, None
        axis = tuple(draw(_signed(a, ndim)) for a in range(ndim - k, ndim))
        return normalized, axis
    if style == "axis":
        return None, draw(_signed(draw(st.integers(0, ndim - 1)), ndim))
    chosen = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    return None, tuple(draw(_signed(a, ndim)) for a in chosen)


def _signed(axis: int, ndim: int) -> st.SearchStrategy[int]:
    """``axis`` written as itself or as a negative index."""
    return st.sampled_from([axis, axis - ndim])


@st.composite
def affine(draw: st.DrawFn, dtype: str) -> tuple[str | None, str | None]:
    """``(weight, bias)`` dtypes: each absent, x's dtype, or float32 for half x."""
    choices: list[str | None] = [None, dtype]
    if dtype in HALF_DTYPES:
        choices.append("float32")
    return draw(st.sampled_from(choices)), draw(st.sampled_from(choices))


def eps_values() -> st.SearchStrategy[float]:
    """eps: the default, 0, powers of ten and anything in 1e-12..1e-1."""
    return st.one_of(
        st.just(1e-5),
        st.just(0.0),
        st.integers(-12, -1).map(lambda k: 10.0**k),
        st.floats(1e-12, 1e-1),
    )


@st.composite
def cases(
    draw: st.DrawFn,
    dtypes: Sequence[str],
    layouts: Sequence[str] = LAYOUTS,
    op: str = "layer_norm",
) -> Case:
    """A complete random call of ``op``: shape, axes, dtype, affine, eps, values, seed and
    layout. rms_norm cases have no bias, and their eps may be None (the default).

    eps is 0 only when no row is degenerate (else y would be 0/0).
    """
    shape = draw(shapes())
    normalized_shape, axis = draw(axes_choices(shape))
    dtype = draw(st.sampled_from(list(dtypes)))
    weight, bias = draw(affine(dtype))
    eps: float | None = draw(eps_values())
    if op == "rms_norm":
        bias = None
        eps = draw(st.sampled_from([None, eps]))
    case = Case(
        shape=shape,
        dtype=dtype,
        values=draw(st.sampled_from(RANDOM_VALUES)),
        seed=draw(st.integers(0, 2**32 - 1)),
        normalized_shape=normalized_shape,
        axis=axis,
        weight=weight,
        bias=bias,
        eps=eps,
        layout=draw(st.sampled_from(list(layouts))),
        return_stats=draw(st.booleans()),
        op=op,
    )
    if case.eps == 0.0 and case.has_degenerate_row():
        case = case.replace(eps=1e-5)
    return case


@st.composite
def backward_cases(
    draw: st.DrawFn,
    dtypes: Sequence[str],
    layouts: Sequence[str] = LAYOUTS,
    op: str = "layer_norm",
) -> BackwardCase:
    """A complete random backward call of ``op``'s gradients: a random forward call
    (:func:`cases`) and ``needs``, mostly the default, else any subset of the gradients."""
    forward = draw(cases(dtypes, layouts, op))
    names = OPS[BACKWARD_OPS[op]].gradients
    subset = st.lists(st.sampled_from(names), unique=True, max_size=len(names)).map(tuple)
    needs = draw(st.one_of(st.none(), st.none(), subset))
    return BackwardCase(forward, needs)


@st.composite
def fused_cases(
    draw: st.DrawFn,
    dtypes: Sequence[str],
    layouts: Sequence[str] = LAYOUTS,
    op: str = "add_layer_norm",
) -> FusedCase:
    """A complete random call of the fused ``op``: a random call of its base op
    (:func:`cases`) for x, a residual of random values and layout, and return_residual. eps is
    0 only when no row of h is degenerate."""
    base = draw(cases(dtypes, layouts, BASE_OPS[op]))
    case = FusedCase(
        base,
        residual=draw(st.sampled_from(RANDOM_VALUES)),
        residual_layout=draw(st.sampled_from(list(layouts))),
        return_residual=draw(st.booleans()),
    )
    if base.eps == 0.0 and case.has_degenerate_row():
        case = case.replace(base=base.replace(eps=1e-5))
    return case


def profile(name: str) -> settings:
    """The hypothesis settings of profile ``name`` (``"ci"`` or ``"full"``)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
