"""Memory layout: odd strides and non-trailing axes give correct results; ``explain`` says truly
when ``x`` is copied; empty inputs launch nothing; autograd survives the permutations."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import normlab
from normlab import reference, spec
from normlab.ops import OPS
from normlab.registry import Backend
from tests.support.plugins_for_tests import CALLS, record

torch = pytest.importorskip("torch")

Register = Callable[..., ModuleType]
RNG = np.random.default_rng(2)
BASE = RNG.standard_normal((6, 8))


def _broadcast(a: Any, shape: tuple[int, ...]) -> Any:
    return a.expand(shape) if hasattr(a, "expand") else np.broadcast_to(a, shape)


# name -> (view of BASE in the array library, the same view of BASE in NumPy)
LAYOUTS: dict[str, Callable[[Backend], tuple[Any, np.ndarray]]] = {
    "c": lambda lib: (lib.from_numpy(BASE), BASE),
    "fortran": lambda lib: (lib.from_numpy(np.ascontiguousarray(BASE.T)).T, BASE),
    "transposed": lambda lib: (lib.from_numpy(BASE).T, BASE.T),
    "sliced": lambda lib: (lib.from_numpy(BASE)[::2, 1::3], BASE[::2, 1::3]),
    "column-block": lambda lib: (lib.from_numpy(BASE)[1:5, 2:7], BASE[1:5, 2:7]),
    "broadcast-rows": lambda lib: (
        _broadcast(lib.from_numpy(BASE[0]), (5, 8)),
        np.broadcast_to(BASE[0], (5, 8)),
    ),
    "broadcast-cols": lambda lib: (
        _broadcast(lib.from_numpy(BASE[:, :1]), (6, 8)),
        np.broadcast_to(BASE[:, :1], (6, 8)),
    ),
    "3d-permuted": lambda lib: (
        lib.from_numpy(BASE.reshape(2, 3, 8)).permute(2, 0, 1)
        if lib.name == "torch"
        else BASE.reshape(2, 3, 8).transpose(2, 0, 1),
        BASE.reshape(2, 3, 8).transpose(2, 0, 1),
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("axis", [-1, 0, (0, -1)])
def test_layouts_give_the_reference_result(lib: Backend, layout: str, axis: Any) -> None:
    x, expected_input = LAYOUTS[layout](lib)
    before = lib.to_numpy(x).tobytes()
    for _ in range(2):  # the second call takes the cached route
        y = normlab.layer_norm(x, axis=axis)
        assert tuple(y.shape) == expected_input.shape
        np.testing.assert_allclose(
            lib.to_numpy(y),
            reference.layer_norm(expected_input, axis=axis)[0],
            rtol=1e-10,
            atol=1e-10,
        )
    assert lib.to_numpy(x).tobytes() == before


def test_reversed_numpy_views() -> None:
    x = BASE[::-1, ::-2]
    for axis in (-1, 0):
        np.testing.assert_allclose(
            normlab.layer_norm(x, axis=axis),
            reference.layer_norm(x, axis=axis)[0],
            rtol=1e-10,
            atol=1e-10,
        )


def test_non_native_byte_order() -> None:
    x = BASE.astype(">f8")
    y = normlab.layer_norm(x)
    np.testing.assert_allclose(y, reference.layer_norm(BASE)[0], rtol=1e-10, atol=1e-10)
    assert "copy of x — x has non-native byte order" in normlab.explain(x)


def test_strides_that_are_not_whole_elements() -> None:
    record_array = np.zeros((4, 3), dtype=[("a", "f4"), ("b", "f8")])
    record_array["b"] = BASE[:4, :3]
    x = record_array["b"]
    np.testing.assert_allclose(
        normlab.layer_norm(x), reference.layer_norm(BASE[:4, :3])[0], rtol=1e-10, atol=1e-10
    )
    assert "copy of x — x's batch or normalized axes cannot be viewed" in normlab.explain(x)


@st.composite
def numpy_views(draw: st.DrawFn) -> tuple[np.ndarray, tuple[int, ...]]:
    """A view of a C array (permuted, stepped, reversed) and a non-empty set of axes."""
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    base = np.arange(float(np.prod(shape))).reshape(shape) ** 1.5
    order = tuple(draw(st.permutations(range(ndim))))
    steps = tuple(draw(st.sampled_from([1, 2, -1, -2])) for _ in range(ndim))
    view = base.transpose(order)[tuple(slice(None, None, s) for s in steps)]
    axes = tuple(draw(st.lists(st.integers(0, ndim - 1), min_size=1, unique=True)))
    return view, axes


@settings(max_examples=60, deadline=None)
@given(numpy_views())
def test_any_view_and_any_axes(case: tuple[np.ndarray, tuple[int, ...]]) -> None:
    view, axes = case
    y = normlab.layer_norm(view, axis=axes)
    np.testing.assert_allclose(y, reference.layer_norm(view, axis=axes)[0], rtol=1e-9, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(numpy_views())
def test_claimed_row_view_strides_address_the_right_elements(
    case: tuple[np.ndarray, tuple[int, ...]],
) -> None:
    view, axes = case
    call = spec.validated(OPS["layer_norm"], spec.arguments("layer_norm", view, axis=axes))
    plan = call.plan
    rows = view.transpose(plan.batch_axes + plan.axes).reshape(plan.rows, plan.cols)
    if view.flags.c_contiguous and call.permutation is None:
        assert call.strides["x"] is not None
    if call.strides["x"] is not None:
        row, col = (s * view.itemsize for s in call.strides["x"])
        strided = np.lib.stride_tricks.as_strided(view, rows.shape, (row, col), writeable=False)
        np.testing.assert_array_equal(strided, rows)


# --------------------------------------------------------------------------------------------
# explain() tells when x is copied, and it is true


def _shares(call_x: Any, x: np.ndarray) -> bool:
    return bool(np.shares_memory(call_x, x))


def test_c_contiguous_trailing_axes_are_not_copied(register: Register) -> None:
    register(record("rows_only", families=frozenset({"numpy"})))
    x = RNG.standard_normal((2, 3, 4))
    for backend in ("numpy", "rows_only"):
        assert "layout: no copy of x" in normlab.explain(x, (3, 4), backend=backend)
    normlab.layer_norm(x, (3, 4), backend="rows_only")
    assert _shares(CALLS[0].x, x)


def test_a_backend_without_strided_capability_gets_a_copy(register: Register) -> None:
    register(record("rows_only", families=frozenset({"numpy"})))
    x = BASE.T
    assert "no copy of x" in normlab.explain(x, backend="numpy")
    text = normlab.explain(x, backend="rows_only")
    assert "layout: copy of x — backend 'rows_only' reads only C-contiguous rows" in text
    y = normlab.layer_norm(x, backend="rows_only")
    assert CALLS[0].x.flags.c_contiguous and not _shares(CALLS[0].x, x)
    np.testing.assert_allclose(y, reference.layer_norm(x)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("capabilities", "view", "copied"),
    [
        ({"strided"}, BASE.T, False),
        ({"strided"}, BASE[:, ::2], False),
        ({"row_strided"}, BASE[:, :5], False),
        ({"row_strided"}, BASE.T, True),
        ({"row_strided"}, BASE[:, ::2], True),
        (set(), BASE[:, :5], True),
        (set(), BASE[1:3], False),
    ],
    ids=["strided-T", "strided-step", "row-block", "row-T", "row-step", "c-block", "c-rows"],
)
def test_what_explain_says_is_what_the_backend_receives(
    register: Register, capabilities: set[str], view: np.ndarray, copied: bool
) -> None:
    register(record("caps", families=frozenset({"numpy"}), capabilities=frozenset(capabilities)))
    text = normlab.explain(view, backend="caps")
    assert ("copy of x —" in text) == copied
    assert ("no copy of x" in text) == (not copied)
    normlab.layer_norm(view, backend="caps")
    assert _shares(CALLS[0].x, view) == (not copied)


def test_layout_that_cannot_be_viewed_as_rows_is_copied() -> None:
    x = RNG.standard_normal((2, 3, 4))[:, :2, :]
    assert "copy of x — x's batch or normalized axes cannot be viewed" in normlab.explain(x)
    np.testing.assert_allclose(
        normlab.layer_norm(x), reference.layer_norm(x)[0], rtol=1e-10, atol=1e-10
    )


def test_out_is_written_directly_or_through_a_temporary(register: Register) -> None:
    register(
        record("no_out", families=frozenset({"numpy"})),
        record("with_out", families=frozenset({"numpy"}), capabilities=frozenset({"out"})),
    )
    x = RNG.standard_normal((3, 4))
    outs = {}
    for backend, how in (
        ("numpy", "directly"),
        ("with_out", "directly"),
        ("no_out", "through a temporary"),
    ):
        out = outs[backend] = np.zeros_like(x)
        assert f"out: written {how}" in normlab.explain(x, out=out, backend=backend)
        assert normlab.layer_norm(x, out=out, backend=backend) is out
        np.testing.assert_allclose(out, reference.layer_norm(x)[0], rtol=1e-10, atol=1e-10)
    assert CALLS[0].out is not None and _shares(CALLS[0].out, outs["with_out"])
    assert CALLS[1].out is None


def test_in_place_on_a_backend_that_cannot_write_in_place(register: Register) -> None:
    register(record("out_only", families=frozenset({"numpy"}), capabilities=frozenset({"out"})))
    x = RNG.standard_normal((3, 4))
    expected = reference.layer_norm(x)[0]
    assert normlab.layer_norm(x, out=x, backend="out_only") is x
    assert CALLS[0].out is None  # the backend wrote a fresh array, then it was copied into x
    np.testing.assert_allclose(x, expected, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------------------
# Empty inputs


@pytest.mark.parametrize(("shape", "axis"), [((0, 4), -1), ((2, 0, 3), -1), ((3, 0), 0)])
def test_no_rows_gives_an_empty_result_without_a_backend_call(
    register: Register, shape: tuple[int, ...], axis: int
) -> None:
    register(record("never", families=frozenset({"numpy"})))
    x = np.zeros(shape, np.float32)
    assert "empty input: no kernel is launched" in normlab.explain(x, axis=axis, backend="never")
    y, mean, rstd = normlab.layer_norm(x, axis=axis, return_stats=True, backend="never")
    stats_shape = tuple(1 if a == axis % x.ndim else n for a, n in enumerate(shape))
    assert y.shape == shape and y.dtype == np.float32
    assert mean.shape == rstd.shape == stats_shape
    assert mean.dtype == rstd.dtype == np.float32
    assert CALLS == []


def test_no_columns_gives_nan_statistics(register: Register) -> None:
    register(record("never", families=frozenset({"numpy"})))
    y, mean, rstd = normlab.layer_norm(np.zeros((3, 0)), return_stats=True, backend="never")
    assert y.shape == (3, 0)
    assert mean.shape == rstd.shape == (3, 1) and mean.dtype == np.float64
    assert np.isnan(mean).all() and np.isnan(rstd).all()
    assert CALLS == []


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_empty_inputs_on_every_family(lib: Backend, shape: tuple[int, int]) -> None:
    x = lib.from_numpy(np.zeros(shape, np.float16))
    y, mean, rstd = normlab.layer_norm(x, return_stats=True)
    assert type(y) is type(x) and tuple(y.shape) == shape and y.dtype == x.dtype
    stats = lib.to_numpy(mean)
    assert stats.shape == (shape[0], 1) and stats.dtype == np.float32
    assert np.isnan(stats).all() and np.isnan(lib.to_numpy(rstd)).all()


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_empty_out(shape: tuple[int, int]) -> None:
    out = np.zeros(shape)
    assert normlab.layer_norm(np.zeros(shape), out=out) is out


# --------------------------------------------------------------------------------------------
# Autograd through the permutation and reshape


def test_autograd_through_non_trailing_axes() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    w = torch.randn(2, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    b = torch.randn(2, 4, dtype=torch.float64, generator=generator, requires_grad=True)

    def through_normlab(x: Any, w: Any, b: Any) -> Any:
        return normlab.layer_norm(x, weight=w, bias=b, axis=(0, 2))

    assert torch.autograd.gradcheck(through_normlab, (x, w, b))

    def through_torch(x: Any, w: Any, b: Any) -> Any:
        y = torch.nn.functional.layer_norm(x.permute(1, 0, 2), (2, 4), w, b)
        return y.permute(1, 0, 2)

    grad_y = torch.randn(2, 3, 4, dtype=torch.float64, generator=generator)
    ours = torch.autograd.grad(through_normlab(x, w, b), (x, w, b), grad_y)
    theirs = torch.autograd.grad(through_torch(x, w, b), (x, w, b), grad_y)
    for a, e in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_autograd_with_return_stats_and_a_parameter_tensor() -> None:
    x = torch.nn.Parameter(torch.randn(3, 5, dtype=torch.float64))
    y, _, _ = normlab.layer_norm(x, return_stats=True)
    assert y.requires_grad
    (y * torch.arange(5.0, dtype=torch.float64)).sum().backward()
    assert x.grad is not None and x.grad.shape == (3, 5)
    torch.testing.assert_close(x.grad.sum(dim=1), torch.zeros(3, dtype=torch.float64))
