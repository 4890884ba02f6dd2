"""Outputs sharing memory with inputs: one rule (spec.aliasing.output_aliasing) for every op.

No output (``y``, the statistics outs) may share an element with an input or with another
output, except ``out is x`` (an in-place call); the test is exact (interleaved columns that share
no element are accepted) and bounded in work (undecided overlaps are written through a
temporary, never refused)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import normlab
from normlab import arrays, dispatch, reference, route, spec
from normlab.ops import OPS
from normlab.registry import Backend
from normlab.spec import aliasing

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(7)
CPU_BACKENDS = ["numpy", "numba", "torch"]


def _x(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _family(backend: str) -> str:
    return "torch" if backend == "torch" else "numpy"


def _convert(a: np.ndarray, backend: str) -> Any:
    return torch.from_numpy(a.copy()) if backend == "torch" else a.copy()


def _numpy(a: Any) -> np.ndarray:
    return a.numpy() if hasattr(a, "numpy") else np.asarray(a)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "call",
    [
        "weight=out[3]",
        "bias=out[0]",
        "weight=x[0] with out=x",
        "mean out inside y out",
        "rstd out inside x",
    ],
)
def test_overlapping_outputs_are_refused_and_nothing_is_written(backend: str, call: str) -> None:
    buffer = _convert(_x(4, 8), backend)
    extra = _convert(_x(2, 8), backend)
    before = (_numpy(buffer).copy(), _numpy(extra).copy())
    x = extra
    kwargs: dict[str, Any] = {"out": buffer}
    if call == "weight=out[3]":
        kwargs["weight"] = buffer[3]
        x = _convert(_x(4, 8), backend)
    elif call == "bias=out[0]":
        kwargs["bias"] = buffer[0]
        x = _convert(_x(4, 8), backend)
    elif call == "weight=x[0] with out=x":
        x = buffer
        kwargs["weight"] = buffer[0]
    elif call == "mean out inside y out":
        x = _convert(_x(4, 8), backend)
        kwargs = {"return_stats": True, "out": (buffer, buffer[:, :1], None)}
    else:
        x = buffer
        kwargs = {"return_stats": True, "out": (None, None, buffer[:, 1:2])}
    with pytest.raises(normlab.ArgumentError, match="share"):
        normlab.layer_norm(x, backend=backend, **kwargs)
    np.testing.assert_array_equal(_numpy(buffer), before[0])
    np.testing.assert_array_equal(_numpy(extra), before[1])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rms_norm_weight_inside_out_is_refused(backend: str) -> None:
    buffer = _convert(_x(3, 6), backend)
    with pytest.raises(normlab.ArgumentError, match=r"out \(y\) shares memory with weight"):
        normlab.rms_norm(_convert(_x(3, 6), backend), weight=buffer[1], out=buffer, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_in_place_beside_a_separate_weight_gives_the_reference(backend: str) -> None:
    x = _x(3, 8)
    w = _x(8)
    expected, _, _ = reference.layer_norm(x, weight=w)
    xt, wt = _convert(x, backend), _convert(w, backend)
    assert normlab.layer_norm(xt, weight=wt, out=xt, backend=backend) is xt
    np.testing.assert_allclose(_numpy(xt), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_view_of_exactly_x_is_in_place(backend: str) -> None:
    buffer = _convert(_x(3, 16), backend)
    expected, _, _ = reference.layer_norm(_numpy(buffer[:, ::2]).copy())
    normlab.layer_norm(buffer[:, ::2], out=buffer[:, ::2], backend=backend)
    np.testing.assert_allclose(_numpy(buffer[:, ::2]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_interleaved_columns_sharing_no_element_are_accepted(backend: str) -> None:
    buffer = _convert(_x(3, 16), backend)
    x, out = buffer[:, ::2], buffer[:, 1::2]
    expected, _, _ = reference.layer_norm(_numpy(x).copy())
    assert normlab.layer_norm(x, out=out, backend=backend) is out
    np.testing.assert_allclose(_numpy(out), expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_overlap_is_decided_exactly() -> None:
    buffer = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(normlab.ArgumentError, match="shares memory with weight"):
        normlab.layer_norm(torch.randn(4, 8, dtype=torch.bfloat16), weight=buffer[2], out=buffer)
    normlab.layer_norm(buffer[:, ::2], out=buffer[:, 1::2])


def test_undecided_overlap_is_written_through_a_temporary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no work allowed, NumPy's solver cannot decide interleaved strides: y must be
    written through a temporary (never refused, never wrong), with weight read first."""
    monkeypatch.setattr(aliasing, "OVERLAP_MAX_WORK", 0)
    buffer = _x(4, 16)
    x = _x(4, 8)
    weight = buffer[0, ::2]
    out = buffer[:, 1::2]
    assert aliasing.shares_memory(out, weight) is None
    expected, _, _ = reference.layer_norm(x, weight=weight.copy())
    normlab.layer_norm(x, weight=weight, out=out, backend="numba")
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


class _DeviceArray:
    """A stand-in for a device array: an address and a layout, and no readable data."""

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
        self.address, self.shape, self.strides = address, shape, strides


class _DeviceInspector(arrays.Inspector):
    def info(self, x: Any) -> arrays.ArrayInfo:
        return arrays.ArrayInfo(
            family="fake",
            type_name="fake",
            dtype="float32",
            shape=x.shape,
            strides=x.strides,
            itemsize=4,
            device="cuda:0",
            device_kind="cuda",
        )

    def address(self, x: Any) -> int:
        return int(x.address)


def test_device_arrays_are_decided_from_address_shape_and_strides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inspector = _DeviceInspector(_DeviceArray, "fake")
    real = arrays.inspector
    monkeypatch.setattr(arrays, "inspector", lambda t: inspector if t is _DeviceArray else real(t))
    base = 0x7F00_0000_0000  # a device address: never dereferenced
    evens = _DeviceArray(base, (3, 8), (16, 2))
    odds = _DeviceArray(base + 4, (3, 8), (16, 2))
    row_two = _DeviceArray(base + 2 * 16 * 4, (8,), (2,))
    assert aliasing.shares_memory(evens, odds) is False  # interleaved: bounds overlap, no element
    assert aliasing.shares_memory(evens, row_two) is True
    assert aliasing.shares_memory(odds, row_two) is False
    with pytest.raises(normlab.ArgumentError, match=r"out \(y\) shares memory with weight"):
        aliasing.output_aliasing(OPS["layer_norm"], {"x": odds, "weight": row_two}, {"y": evens})
    assert aliasing.output_aliasing(OPS["layer_norm"], {"x": evens}, {"y": evens}) == "in_place"
    assert aliasing.output_aliasing(OPS["layer_norm"], {"x": odds}, {"y": evens}) == "separate"


def test_outputs_sharing_memory_with_each_other_are_refused(lib: Backend) -> None:
    x = lib.from_numpy(_x(3, 4))
    stats = lib.from_numpy(np.zeros((3, 1), np.float32))
    with pytest.raises(normlab.ArgumentError, match=r"out \(rstd\) and out \(mean\) share"):
        normlab.layer_norm(x, return_stats=True, out=(None, stats, stats))


def test_a_tensor_extent_read_without_its_layout_agrees_with_the_layout() -> None:
    """A C-contiguous tensor's extent comes from its address and size alone (the common case
    of ``out=``); it is the extent of its full layout, and empty tensors have none."""
    inspector = arrays.inspector(torch.Tensor)
    base = torch.zeros(6, 8)
    for t in (base, base[1:4], base[:, 2:5], base.t(), base[::2], base[2:2], base[1:2, 3]):
        assert inspector.extent(t) == inspector.memory(t).extent()
    assert inspector.extent(base[2:2]) is None
    assert arrays.Memory(100, (3,), (-4,), 4).extent() == (92, 104)  # reversed: 92..103
    assert arrays.Memory(100, (2, 0), (8, 4), 4).extent() is None


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_tensors_over_overlapping_numpy_memory_are_refused(backend: str) -> None:
    """Two tensors of separate storages over overlapping NumPy memory: the contiguous fast
    path of the overlap test sees the overlap, as the exact test does."""
    memory = np.zeros(20, np.float32)
    x = torch.from_numpy(memory[0:16]).view(2, 8)
    out = torch.from_numpy(memory[4:20]).view(2, 8)
    with pytest.raises(normlab.ArgumentError, match=r"out \(y\) shares memory with x"):
        normlab.layer_norm(x, out=out, backend=backend)
    assert not memory.any()  # nothing written


def _verdict(decide: Any, *args: Any) -> str:
    """What an aliasing test answers: its result, or the ArgumentError it raises."""
    try:
        return str(decide(*args))
    except normlab.ArgumentError as exc:
        return f"ArgumentError: {exc}"


@pytest.mark.parametrize("family", ["numpy", "torch"])
def test_the_bounds_shortcut_answers_as_the_exact_test(family: str) -> None:
    """Wherever the bounds settle a call (``spec._apart``), the exact element test answers the
    same, over random views of one buffer and separate arrays as x, weight, bias and outputs
    (in-place pairs, the same object twice, strided and reversed views, empty ones)."""
    rng = np.random.default_rng(11)
    memory = np.zeros(64, np.float32)
    wrap = torch.from_numpy if family == "torch" else (lambda a: a)
    shared = wrap(memory)

    def view() -> Any:
        if rng.random() < 0.25:
            return wrap(np.zeros(int(rng.integers(0, 9)), np.float32))  # separate memory
        start, stop = sorted(int(v) for v in rng.integers(0, 65, size=2))
        step = int(rng.integers(1, 4))
        v = shared[start:stop:step]
        if rng.random() < 0.2 and family == "numpy":
            v = v[::-1]  # torch has no negative strides
        return v

    settled = 0
    for _ in range(3000):
        inputs: dict[str, Any] = {"x": view(), "weight": view(), "bias": view()}
        outputs: dict[str, Any] = {"y": view(), "mean": view(), "rstd": None}
        pick = rng.random()
        if pick < 0.2:
            outputs["y"] = inputs["x"]  # in place
        elif pick < 0.3:
            outputs["mean"] = outputs["y"]  # one object twice
        elif pick < 0.4:
            outputs["y"] = inputs["bias"]  # not an in-place pair
        given_in = [(n, a) for n, a in inputs.items() if a is not None]
        given_out = [(n, o) for n, o in outputs.items() if o is not None]
        shortcut = aliasing._apart(OPS["layer_norm"].in_place, given_in, given_out)
        exact = _verdict(aliasing._exact_aliasing, OPS["layer_norm"], given_in, given_out)
        if shortcut is not None:
            settled += 1
            assert shortcut == exact, (inputs, outputs)
        assert _verdict(aliasing.output_aliasing, OPS["layer_norm"], inputs, outputs) == exact
    assert settled > 300  # the shortcut was exercised, not only the fallback


@pytest.mark.parametrize(
    ("backend", "family"), [("numpy", "numpy"), ("numba", "numpy"), ("numba", "torch")]
)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_repeated_calls_with_outputs_are_checked_every_time(
    backend: str, family: str, op: str
) -> None:
    """Calls of one layout with outputs take the direct route from the second call on (the
    backend writes ``out`` itself): each call's outputs are checked anew — separate buffers,
    the in-place form, an overlapping buffer of the same layout (refused, nothing written) —
    and each result is bitwise the allocating call's."""
    wrap = torch.from_numpy if family == "torch" else np.asarray
    buffer = _x(5, 8)
    x, other, residual, weight = (wrap(a) for a in (buffer[:4], _x(4, 8), _x(4, 8), _x(8)))
    fused = op.startswith("add_")
    inputs = (x, residual) if fused else (x,)
    fn = getattr(normlab, op)
    expected = [_numpy(a).copy() for a in _as_tuple(fn(*inputs, weight=weight, backend=backend))]

    def call(out: Any, residual_out: Any = None) -> list[np.ndarray]:
        more = {"residual_out": residual_out} if fused else {}
        got = _as_tuple(fn(*inputs, weight=weight, backend=backend, out=out, **more))
        assert got[0] is out and (not fused or got[1] is residual_out)
        return [_numpy(a).copy() for a in got]

    for _ in range(3):  # the first call routes; the later ones take the direct route
        out, h = (
            wrap(np.full((4, 8), np.nan, np.float32)),
            wrap(np.full((4, 8), np.nan, np.float32)),
        )
        versions = [getattr(a, "_version", 0) for a in (out, h)]
        for got, want in zip(call(out, h if fused else None), expected, strict=True):
            np.testing.assert_array_equal(got, want)
        if family == "torch":  # written behind torch's back: its version counter is told
            assert out._version > versions[0] and (not fused or h._version > versions[1])
    assert _route(op, x, residual, weight, out, h if fused else None, backend).direct_out
    overlapping = wrap(buffer[1:])  # x's layout, one row further on: shares four rows with x
    before = buffer.copy()
    with pytest.raises(normlab.ArgumentError, match="shares memory with x"):
        call(overlapping, other if fused else None)
    np.testing.assert_array_equal(buffer, before)
    if fused:  # the serving form: y into x, h into residual
        x_before, r_before = _numpy(x).copy(), _numpy(residual).copy()
        y, h = fn(x, residual, weight=weight, backend=backend, out=x, residual_out=residual)
        assert y is x and h is residual
        np.testing.assert_array_equal(_numpy(h), (x_before + r_before))
        np.testing.assert_array_equal(_numpy(y), expected[0])
    else:
        y = fn(x, weight=weight, backend=backend, out=x)
        assert y is x
        np.testing.assert_array_equal(_numpy(y), expected[0])


def _route(op: str, x: Any, residual: Any, weight: Any, out: Any, h: Any, backend: str) -> Any:
    """The cached route of a call with outputs (:mod:`normlab.route`)."""
    given = {"residual": residual, "residual_out": h} if op.startswith("add_") else {}
    call = spec.validated(OPS[op], spec.arguments(op, x, weight=weight, out=out, **given))
    return route.route(call, dispatch.choose(call.plan, backend))


def _as_tuple(result: Any) -> tuple[Any, ...]:
    return result if isinstance(result, tuple) else (result,)
