"""Outputs whose elements overlap each other, over the space of strides (hypothesis).

:func:`normlab.spec.overlaps_itself` decides from shape and strides alone whether an output
may place two of its elements at one address. These properties hold it to the brute-force
answer (every element's offset listed): it never misses an overlap, it accepts every layout
that is an axis permutation of padded, possibly negated, C-order strides, and a call into an
accepted out= writes what a call without out= returns, on every NumPy-array backend and the
default choice.
"""

from __future__ import annotations

import itertools
import math
from typing import Final

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import normlab
from normlab import registry
from normlab.errors import ArgumentError
from normlab.spec.aliasing import overlaps_itself

PROPERTY: Final = settings(max_examples=300, deadline=None, derandomize=True)


def _offsets(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[int]:
    """The element offset of every index of ``shape`` under ``strides`` (in elements)."""
    return [
        sum(i * s for i, s in zip(index, strides, strict=True))
        for index in itertools.product(*(range(n) for n in shape))
    ]


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Any shape of up to 4 axes (0 to 5 elements each) and any strides in [-12, 12]."""
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    strides = tuple(draw(st.lists(st.integers(-12, 12), min_size=ndim, max_size=ndim)))
    return shape, strides


@st.composite
def _separate_layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes with strides of a padded C order over some axis permutation, signs at random:
    every element at an address of its own."""
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    order = draw(st.permutations(range(ndim)))
    strides = [0] * ndim
    span = 1
    for axis in reversed(order):  # the last axis of the order is the innermost
        stride = span + draw(st.integers(0, 3))
        strides[axis] = stride * draw(st.sampled_from((1, -1)))
        span = stride * shape[axis]
    return shape, tuple(strides)


@PROPERTY
@given(layout=_layouts())
def test_an_overlap_is_never_missed(layout: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    shape, strides = layout
    offsets = _offsets(shape, strides)
    if len(set(offsets)) < len(offsets):
        assert overlaps_itself(shape, strides)


@PROPERTY
@given(layout=_separate_layouts())
def test_separate_layouts_are_accepted(layout: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    shape, strides = layout
    offsets = _offsets(shape, strides)
    assert len(set(offsets)) == len(offsets)  # the strategy's own promise
    assert not overlaps_itself(shape, strides)


def _view(memory: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """A view of ``memory`` with element ``strides`` (negative allowed), its first element
    placed so that every element lies inside ``memory``."""
    low = sum(max(n - 1, 0) * s for n, s in zip(shape, strides, strict=True) if s < 0)
    size = memory.itemsize
    start = memory[-low:]
    return np.lib.stride_tricks.as_strided(start, shape, tuple(s * size for s in strides))


BACKENDS: Final = [None, "numpy", "numba"]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b or "default")
@settings(max_examples=60, deadline=None, derandomize=True)
@given(layout=_layouts(), cols=st.sampled_from((1, 3, 8)))
def test_out_strides_refused_or_written(
    backend: str | None, layout: tuple[tuple[int, ...], tuple[int, ...]], cols: int
) -> None:
    """Any strided out= of x's shape (rows of the drawn layout, ``cols`` columns at the drawn
    strides times ``cols`` plus one column stride): refused with ArgumentError exactly when
    :func:`overlaps_itself` says so, else filled with the values a call without out= returns,
    nothing outside its elements touched."""
    if backend is not None and not registry.get(backend).available:
        pytest.skip(f"backend {backend!r} is unavailable here")
    rows_shape, row_strides = layout
    shape = (*rows_shape, cols)
    strides = (*(s * cols for s in row_strides), 1)
    x = np.random.default_rng(len(shape) + sum(shape)).standard_normal(shape).astype(np.float32)
    span = sum(max(n - 1, 0) * abs(s) for n, s in zip(shape, strides, strict=True)) + 1
    memory = np.full(span + 8, 7.0, np.float32)
    out = _view(memory, shape, strides)
    before = memory.copy()
    if overlaps_itself(shape, strides):
        with pytest.raises(ArgumentError, match="overlap"):
            normlab.layer_norm(x, out=out, backend=backend)
        np.testing.assert_array_equal(memory, before)  # nothing written
        return
    normlab.layer_norm(x, out=out, backend=backend)
    np.testing.assert_array_equal(out, normlab.layer_norm(x, backend=backend))
    touched = np.zeros(memory.size, bool)
    flat = np.array(_offsets(shape, strides), dtype=np.int64)
    low = sum(max(n - 1, 0) * s for n, s in zip(shape, strides, strict=True) if s < 0)
    touched[flat - low] = True
    assert math.prod(shape) == 0 or touched.any()
    np.testing.assert_array_equal(memory[~touched], before[~touched])
