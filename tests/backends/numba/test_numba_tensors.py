"""The Numba backend on CPU torch tensors (:mod:`normlab.backends.numba_tensors`): served zero-copy,
the graph kept through normlab's custom ops, and small C-contiguous tensors by address
(:mod:`normlab.backends.numba_addressed`), bitwise the NumPy call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import normlab  # noqa: E402
from normlab import spec  # noqa: E402
from normlab.backends import (  # noqa: E402
    numba_backend,
    numba_kernel_types,
    numba_pool,
    numba_tensors,
)
from normlab.errors import BackendError  # noqa: E402
from normlab.testing.conversions import numpy_dtype  # noqa: E402
from tests.support.numba_direct import (  # noqa: E402
    DTYPES,
    as_numpy_array,
    check,
    check_rms,
    dtype_of,
    numba_call,
    randn,
    same_bits,
)

# --------------------------------------------------------------------------------------------
# Torch CPU tensors, served zero-copy when named


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_tensors(torch: Any, dtype: str) -> None:
    t = torch.randn(12, 40, dtype=getattr(torch, dtype)).t()  # strided: served without a copy
    w = torch.randn(12, dtype=torch.float32)
    y, mean, rstd = numba_call(t, w, None)
    assert isinstance(y, torch.Tensor) and y.dtype == t.dtype and y.shape == t.shape
    x_np = t.float().numpy().astype(dtype_of(dtype))
    check(x_np, w.numpy(), None, 1e-5, (_numpy(y), mean.numpy(), rstd.numpy()))


def _numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(numpy_dtype("bfloat16"))
    return t.numpy()  # type: ignore[no-any-return]


def test_torch_out_and_in_place(torch: Any) -> None:
    t = torch.randn(8, 30, dtype=torch.float16)
    expected = numba_call(t)[0]
    out = torch.empty_like(t)
    assert numba_call(t, out=out)[0] is out and torch.equal(out, expected)
    assert numba_call(t, out=t)[0] is t and torch.equal(t, expected)


def test_torch_requires_grad_keeps_the_graph(torch: Any) -> None:
    x = torch.randn(4, 6)
    w = torch.ones(6, requires_grad=True)
    y = normlab.layer_norm(x, weight=w, backend="numba")
    assert y.grad_fn is not None  # through normlab's custom ops, never detached
    with pytest.raises(BackendError, match="autograd"):  # out= cannot keep a graph
        numba_backend.layer_norm(
            x,
            w,
            None,
            plan=spec.plan("layer_norm", x, weight=w),
            out=torch.empty(4, 6),
        )
    with torch.no_grad():
        y, _, _ = numba_call(x, w)
    assert torch.allclose(y, torch.nn.functional.layer_norm(x, (6,)), atol=1e-6)


def test_torch_through_the_api(torch: Any) -> None:
    t = torch.randn(3, 5, 7)
    y = normlab.layer_norm(t, backend="numba")
    assert isinstance(y, torch.Tensor)
    assert torch.allclose(y, torch.nn.functional.layer_norm(t, (7,)), atol=1e-6)


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_float64_tensor_parameters_stay_float64(op: str) -> None:
    """A float64 tensor's weight and bias reach the kernel unrounded: bitwise the NumPy call
    (a float32 weight would move y by about 1e-8)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x, r = rng.standard_normal((3, 16)), rng.standard_normal((3, 16))
    w, b = 1 + np.arange(16) * 1e-9, np.arange(16) * 1e-10
    function = getattr(normlab, op)
    lead_np = (x, r) if op == "add_layer_norm" else (x,)
    lead_t = tuple(torch.from_numpy(a) for a in lead_np)
    y_np = function(*lead_np, weight=w, bias=b, backend="numba")
    y_t = function(*lead_t, weight=torch.from_numpy(w), bias=torch.from_numpy(b), backend="numba")
    for got, want in zip(
        y_t if isinstance(y_t, tuple) else (y_t,),
        y_np if isinstance(y_np, tuple) else (y_np,),
        strict=True,
    ):
        assert np.array_equal(got.numpy(), want)


def test_rms_norm_torch_tensors_keep_the_graph(torch: Any) -> None:
    x = torch.randn(5, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, requires_grad=True)
    y = normlab.rms_norm(x, weight=w, eps=1e-6, backend="numba")
    assert y.grad_fn is not None
    want = torch.nn.functional.rms_norm(x, (24,), w, 1e-6)
    assert torch.allclose(y, want, atol=1e-12)
    dy = torch.randn(5, 24, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, w), dy)
    expected = torch.autograd.grad(want, (x, w), dy)
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, atol=1e-10)
    with torch.no_grad():
        t = torch.randn(6, 10, dtype=torch.bfloat16)
        y, _, rstd = numba_call(t, op="rms_norm")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and rstd.shape == (6,)
    check_rms(_numpy(t), None, 1e-5, (_numpy(y), None, rstd.numpy()))


# --------------------------------------------------------------------------------------------
# Small C-contiguous tensors: the address entries (numba_addressed), bitwise the NumPy call


@pytest.fixture
def address_entries(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the address entries called (each call appends its name): the first call
    of a signature runs through numba's dispatcher, later ones through its entry point."""
    called: list[str] = []
    entry_point = numba_tensors._entry_point

    def recording_entry_point(kernel: Any, args: tuple[Any, ...]) -> Any:
        called.append(kernel.__name__)
        entry = entry_point(kernel, args)

        def recording(*args: Any) -> Any:
            called.append(kernel.__name__)
            return entry(*args)

        return recording

    monkeypatch.setattr(numba_tensors, "_entry_point", recording_entry_point)
    # entry points taken before, and the prepared functions holding them: taken anew
    numba_kernel_types.kernel_types.cache_clear()
    spec.clear_cache()
    yield called
    numba_kernel_types.kernel_types.cache_clear()  # the recording ones go
    spec.clear_cache()


_SMALL_SHAPES = [(1, 1), (1, 768), (3, 5), (7, 1000), (40, 768)]
#: Contiguous tensors of short rows too large for the calling thread: the parallel entries.
_PARALLEL_SHAPES = [(128, 1024), (301, 768)]


def _entry(kernel: str, rows: int, cols: int, dtype: str) -> str:
    """The address entry a contiguous tensor takes: ``kernel``'s serial one on the calling
    thread, its parallel one where the numba backend would start threads."""
    limit = numba_pool.FORWARD_SERIAL_ELEMENTS.get(dtype, numba_pool.SERIAL_ELEMENTS)
    parallel = rows > 1 and rows * cols >= limit and numba.get_num_threads() > 1
    return kernel.replace("_at", "_parallel_at") if parallel else kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_contiguous_tensors_go_by_address_bitwise_the_numpy_call(
    torch: Any, address_entries: list[str], dtype: str, op: str
) -> None:
    """On the calling thread and on the pool's: the address entries, bitwise the NumPy call."""
    dtype_of(dtype)
    half = dtype in ("float16", "bfloat16")
    shapes = _SMALL_SHAPES + _PARALLEL_SHAPES
    for i, (rows, cols) in enumerate(shapes):
        x = torch.from_numpy(randn((rows, cols), "float32", seed=i, loc=2.0)).to(
            getattr(torch, dtype)
        )
        w = torch.randn(cols, dtype=torch.float32 if half else x.dtype)
        b = {"bias": torch.randn(cols, dtype=w.dtype)} if op == "layer_norm" else {}
        b_np = {k: v.numpy() for k, v in b.items()}
        for stats in (False, True):
            got = getattr(normlab, op)(x, weight=w, return_stats=stats, backend="numba", **b)
            want = getattr(normlab, op)(
                as_numpy_array(x), weight=w.numpy(), return_stats=stats, backend="numba", **b_np
            )
            got, want = (got, want) if stats else ((got,), (want,))
            for g, v in zip(got, want, strict=True):
                assert isinstance(g, torch.Tensor)
                assert np.array_equal(as_numpy_array(g).view(np.uint8), v.view(np.uint8))
    assert address_entries == [
        _entry("layer_norm_rows_at", rows, cols, dtype) for rows, cols in shapes for _ in "ab"
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep_h", [True, False])
def test_contiguous_fused_tensors_go_by_address_bitwise_the_numpy_call(
    torch: Any, address_entries: list[str], dtype: str, keep_h: bool
) -> None:
    dtype_of(dtype)
    shapes = _SMALL_SHAPES + _PARALLEL_SHAPES
    for i, (rows, cols) in enumerate(shapes):
        x, r = (
            torch.from_numpy(randn((rows, cols), "float32", seed=s, loc=1.0)).to(
                getattr(torch, dtype)
            )
            for s in (2 * i, 2 * i + 1)
        )
        w = torch.randn(cols, dtype=x.dtype)  # float16/bfloat16 weights read in that dtype
        got = normlab.add_layer_norm(
            x, r, weight=w, return_residual=keep_h, return_stats=True, backend="numba"
        )
        want = normlab.add_layer_norm(
            as_numpy_array(x), as_numpy_array(r), weight=as_numpy_array(w),
            return_residual=keep_h, return_stats=True, backend="numba",
        )  # fmt: skip
        for g, v in zip(got, want, strict=True):
            assert np.array_equal(as_numpy_array(g).view(np.uint8), v.view(np.uint8))
    assert address_entries == [_entry("add_norm_rows_at", r, c, dtype) for r, c in shapes]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_parameters_go_by_address_bitwise_their_float32_values(
    torch: Any, address_entries: list[str], monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """A weight and bias stored in x's half dtype (``model.half()``) reach the address entries
    as they are, widened inside the kernel, never copied: the results are bitwise those of
    the same values as float32 parameters (widening is exact), with and without outputs,
    statistics and the prepared route; an absent one takes a stand-in in that dtype."""
    dtype_of(dtype)
    half = getattr(torch, dtype)
    x, r = (torch.from_numpy(randn((3, 768), "float32", seed=s, loc=2.0)).to(half) for s in (1, 2))
    w, b = torch.randn(768).to(half), torch.randn(768).to(half)

    def never_converted(*args: Any) -> Any:
        raise AssertionError("half parameters were converted")

    calls = [
        ("layer_norm", {"weight": w, "bias": b}),
        ("layer_norm", {"weight": w}),
        ("layer_norm", {"bias": b}),
        ("rms_norm", {"weight": w}),
        ("add_layer_norm", {"weight": w, "bias": b}),
        ("add_layer_norm", {"weight": w, "bias": b, "return_residual": False}),
        ("add_rms_norm", {"weight": w}),
    ]
    for op, kwargs in calls:
        inputs = (x, r) if op.startswith("add_") else (x,)
        wide = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        for stats in (False, True):
            want = getattr(normlab, op)(*inputs, **wide, return_stats=stats, backend="numba")
            with monkeypatch.context() as m:
                m.setattr(numba_tensors, "_converted_params", never_converted)
                for _ in range(2):  # the first may compile the entry (then: prepared, w/o stats)
                    got = getattr(normlab, op)(
                        *inputs, **kwargs, return_stats=stats, backend="numba"
                    )
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            for g, v in zip(got, want, strict=True):
                assert same_bits(g, v), (op, list(kwargs), stats)
    assert set(address_entries) == {"layer_norm_rows_at", "add_norm_rows_at"}
    mixed = normlab.layer_norm(x, weight=w, bias=b.float(), backend="numba")  # w converted
    want = normlab.layer_norm(x, weight=w.float(), bias=b.float(), backend="numba")
    assert same_bits(mixed, want)


def test_tensors_the_address_entries_cannot_read_take_numpy_views(
    torch: Any, address_entries: list[str]
) -> None:
    """Strided, misaligned, in place, long rows: the NumPy views as before, the same results;
    a strided or misaligned weight is copied for the address entry."""
    x = torch.randn(4, 768)
    want = normlab.layer_norm(x.numpy(), backend="numba")
    strided = torch.empty(4, 2 * 768)[:, ::2]
    strided.copy_(x)
    misaligned = torch.frombuffer(bytearray(4 * 4 * 768 + 2), dtype=torch.float32, offset=2)
    misaligned = misaligned.view(4, 768)
    misaligned.copy_(x)
    assert misaligned.data_ptr() % 4 == 2
    in_place = x.clone()
    for t, kwargs in ((strided, {}), (misaligned, {}), (in_place, {"out": in_place})):
        assert np.array_equal(normlab.layer_norm(t, backend="numba", **kwargs).numpy(), want)
    long_rows = torch.randn(2, 300_000)  # the segmented kernels: arrays
    normlab.layer_norm(long_rows, backend="numba")
    assert address_entries == []
    w_strided = torch.randn(2 * 768)[::2]
    w_misaligned = torch.frombuffer(bytearray(4 * 768 + 2), dtype=torch.float32, offset=2)
    w_misaligned.copy_(w_strided)
    w_want = normlab.layer_norm(x.numpy(), weight=w_strided.numpy(), backend="numba")
    for w in (w_strided, w_misaligned):
        assert np.array_equal(normlab.layer_norm(x, weight=w, backend="numba").numpy(), w_want)
    assert address_entries == ["layer_norm_rows_at"] * 2


def test_outputs_given_go_by_address_in_place_forms_included(
    torch: Any, address_entries: list[str]
) -> None:
    """``out=`` a separate tensor, and the fused op's in-place serving form (``out=x,
    residual_out=residual``): by address, written in place, bitwise the NumPy call."""
    x, r = torch.randn(3, 768), torch.randn(3, 768)
    w, b = torch.randn(768), torch.randn(768)
    want = normlab.layer_norm(x.numpy(), weight=w.numpy(), bias=b.numpy(), backend="numba")
    out = torch.empty(3, 768)
    assert normlab.layer_norm(x, weight=w, bias=b, out=out, backend="numba") is out
    assert np.array_equal(out.numpy(), want)
    want_y, want_h = normlab.add_layer_norm(
        x.numpy(), r.numpy(), weight=w.numpy(), bias=b.numpy(), backend="numba"
    )
    xs, rs = x.clone(), r.clone()
    y, h = normlab.add_layer_norm(
        xs, rs, weight=w, bias=b, out=xs, residual_out=rs, backend="numba"
    )
    assert y is xs and h is rs
    assert np.array_equal(xs.numpy(), want_y) and np.array_equal(rs.numpy(), want_h)
    xs, rs = x.clone(), r.clone()  # swapped: h over x, y over the residual
    y, h = normlab.add_layer_norm(
        xs, rs, weight=w, bias=b, out=rs, residual_out=xs, backend="numba"
    )
    assert y is rs and h is xs
    assert np.array_equal(rs.numpy(), want_y) and np.array_equal(xs.numpy(), want_h)
    assert address_entries == ["layer_norm_rows_at"] + ["add_norm_rows_at"] * 2


def test_an_integer_eps_first_does_not_fix_the_entry_points_eps_type(torch: Any) -> None:
    """The address entries keep the entry point of their first call's argument types: a plan
    whose eps is an int (a backend driven by hand) must not make later calls' eps an integer
    (1e-5 truncated to 0)."""
    numba_kernel_types.kernel_types.cache_clear()  # the entry point is taken by the next call
    x = torch.from_numpy(randn((1, 768), "float32", seed=3, loc=2.0))
    plan = spec.plan("layer_norm", x)
    numba_backend.layer_norm(x, None, None, plan=dataclasses.replace(plan, eps=0), out=None)
    got = numba_backend.layer_norm(x, None, None, plan=plan, out=None)[0]
    want = normlab.layer_norm(x.numpy(), backend="numba")
    assert np.array_equal(got.numpy(), want)
