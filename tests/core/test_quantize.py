"""Quantized outputs (normlab.quantize) beyond the suite's per-backend checks: the float8 bit
conversions against ml_dtypes, vLLM's fused-quant test grid against the float64 reference, the
default call (numba's own pass) against the core's composition, the model-norm options, NaN and
Inf rows, graphs and empty inputs, explain()."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import normlab
from normlab import reference
from normlab.quantize import e4m3_bits
from normlab.quantize import reference as quantized_reference

ml_dtypes = pytest.importorskip("ml_dtypes")


def _e4m3_cases() -> np.ndarray:
    """Every e4m3fn number, the midpoints between neighbours and a float32 ulp either side of
    them, values past ±448, random values of every scale, zeros, NaN."""
    every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.unique(every[np.isfinite(every)])
    mids = (finite[:-1] + finite[1:]) / 2
    near = np.concatenate([np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    rng = np.random.default_rng(0)
    scales = 2.0 ** rng.uniform(-12, 9, 100_000)
    random = (rng.choice([-1.0, 1.0], 100_000) * scales).astype(np.float32)
    special = np.float32([0.0, -0.0, 448.0, -448.0, 460.0, 465.0, -1e6, np.nan])
    return np.concatenate([finite, mids, near, random, special]).astype(np.float32)


def test_e4m3_bits_are_ml_dtypes_conversion() -> None:
    """The bit conversion for libraries without float8 (CuPy) rounds as ml_dtypes does: to
    nearest even, subnormals included, after the saturation at ±448."""
    v = np.clip(_e4m3_cases(), -448, 448)
    want = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = e4m3_bits(v)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} values differ, e.g. {v[bad[:4]]}: {got[bad[:4]]}"


def test_numba_e4m3_is_ml_dtypes_conversion() -> None:
    """numba's conversion from float32 bits (static scale 1: q = e4m3fn(clip(y, ±448)))."""
    pytest.importorskip("numba")
    from normlab.backends.numba_quantized import quantized_rows

    v = _e4m3_cases()
    v = v[: v.size // 64 * 64].reshape(-1, 64)
    q = np.empty(v.shape, np.uint8)
    scale = np.empty(v.shape[0], np.float32)
    quantized_rows(v, q, scale, 1.0, 448.0, True, 1)
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert (scale == 1.0).all()
    bad = np.flatnonzero(q != want)
    assert bad.size == 0, f"{bad.size} values differ, e.g. {v.ravel()[bad[:4]]}"


#: vLLM's test_fused_quant_layernorm grid (hidden sizes, token counts), run on CPU.
HIDDEN_SIZES = (8, 768, 769, 770, 771, 5120, 5124, 5125, 5126, 8192, 8199)
TOKENS = (1, 7, 83)


def _reference_y(op: str, x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray) -> Any:
    """The float64 reference's y of ``op`` (rms_norm ops, vLLM's eps 1e-6), and h."""
    h = x if residual is None else (x + residual).astype(x.dtype)
    y = reference.rms_norm(h.astype(np.float64), None, weight.astype(np.float64), 1e-6)[0]
    return y, h


@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("add_residual", [False, True])
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_vllm_grid_against_the_reference(
    hidden: int, add_residual: bool, dtype: str, mode: str
) -> None:
    """The default call on NumPy arrays for each of vLLM's shapes: scale within 1e-5 of the
    float64 reference's ``max|y| / limit``; int8 q within 1 of ``y / scale`` rounded (vLLM
    allows 1 too), e4m3fn q within a step; h bitwise NumPy's add."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(hidden)
    for tokens in TOKENS:
        x = (rng.standard_normal((tokens, hidden)) / np.sqrt(hidden) * 10).astype(np_dtype)
        residual = rng.standard_normal((tokens, hidden)).astype(np_dtype) if add_residual else None
        weight = rng.standard_normal(hidden).astype(np.float32)
        if residual is None:
            q, scale = normlab.rms_norm(x, weight=weight, eps=1e-6, quantize=mode)
        else:
            q, scale, h = normlab.add_rms_norm(x, residual, weight=weight, eps=1e-6, quantize=mode)
        y, want_h = _reference_y("rms_norm", x, residual, weight)
        if residual is not None:
            assert np.array_equal(h.view(np.uint8), want_h.view(np.uint8))
        limit = 127.0 if mode == "int8" else 448.0
        want_scale = np.abs(y).max(axis=1, keepdims=True) / limit
        np.testing.assert_allclose(scale, want_scale, rtol=1e-5)
        values = q.astype(np.float64)
        if mode == "int8":
            assert np.abs(values - y / scale).max() <= 0.5 + 1e-3
        else:
            step = 2.0**-4 * np.abs(y / scale) + 2.0**-10 + 1e-4
            assert (np.abs(values - y / scale) <= step).all()


def test_numba_pass_is_the_core_composition() -> None:
    """numba's own pass over each row gives the bits of the core's composition on numba (its
    float32 y, then the reference quantizer), short and long rows, every thread count; the
    composition is what a strided x takes."""
    pytest.importorskip("numba")
    import numba

    rng = np.random.default_rng(1)
    for cols in (33, 4096, 300_000):  # 300,000 float32: long rows (more than 1 MiB)
        rows = 3 if cols > 100_000 else 50
        x = rng.standard_normal((rows, cols * 2)).astype(ml_dtypes.bfloat16)
        strided = x[:, ::2]  # not C-contiguous rows: composed
        contiguous = np.ascontiguousarray(strided)
        weight = rng.standard_normal(cols).astype(np.float32)
        for mode in ("int8", "fp8_e4m3"):
            composed = normlab.rms_norm(strided, weight=weight, quantize=mode, backend="numba")
            text = normlab.explain(strided, weight=weight, quantize=mode, op="rms_norm")
            assert "core runs" in text
            for threads in (1, numba.config.NUMBA_NUM_THREADS):
                numba.set_num_threads(threads)
                try:
                    native = normlab.rms_norm(
                        contiguous, weight=weight, quantize=mode, backend="numba"
                    )
                finally:
                    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
                assert np.array_equal(native[0].view(np.uint8), composed[0].view(np.uint8))
                assert np.array_equal(native[1], composed[1])


def _want(y32: Any, mode: str, static: float | None = None) -> tuple[Any, Any]:
    return quantized_reference(y32, mode, static, (y32.ndim - 1,))


def _same(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` hold the same bits (float8 compared as uint8)."""
    import torch

    def bits(t: Any) -> Any:
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    return bool(torch.equal(bits(a), bits(b)))


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3"])
def test_quantize_composes_with_model_options(backend: str | None, mode: str) -> None:
    """Quantization of Gemma's offset weight, Llama's casting order, a bfloat16 weight and a
    float32 residual stream: the float32 y each defines (normlab.quantize), quantized."""
    torch = pytest.importorskip("torch")
    x = torch.randn(9, 512, dtype=torch.bfloat16) * 3
    residual32 = torch.randn(9, 512)
    w = (torch.randn(512) * 0.1).to(torch.bfloat16)
    kw: dict[str, Any] = {"backend": backend, "quantize": mode}
    q, s = normlab.rms_norm(x, 512, w, weight_offset=1.0, **kw)
    y = normlab.rms_norm(x.float(), 512, w, weight_offset=1.0, backend=backend)
    assert _same(q, _want(y, mode)[0]) and _same(s, _want(y, mode)[1])
    q, s = normlab.rms_norm(x, 512, w, casting="llama", **kw)
    y = normlab.rms_norm(x, 512, w.float(), casting="llama", backend=backend)
    assert y.dtype == torch.float32
    assert _same(q, _want(y, mode)[0]) and _same(s, _want(y, mode)[1])
    q, s, h = normlab.add_rms_norm(x, residual32, 512, w, **kw)
    assert h.dtype == torch.float32 and torch.equal(h, x.float() + residual32)
    y = normlab.rms_norm(h, 512, w, backend=backend)
    assert _same(q, _want(y, mode)[0]) and _same(s, _want(y, mode)[1])
    q, s = normlab.layer_norm(x, 512, w, w, quantize=mode, quantize_scale=0.01, backend=backend)
    y = normlab.layer_norm(x.float(), 512, w, w, backend=backend)
    assert _same(q, _want(y, mode, 0.01)[0]) and bool((s == np.float32(0.01)).all())


@pytest.mark.parametrize("backend", [None, "numba", "torch"])
@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3"])
def test_llama_casting_of_float64_x_is_the_plain_calls_y_rounded_to_float32(
    backend: str | None, mode: str
) -> None:
    """float64 x and weight with casting="llama": the quantized y is the plain call's (x̂ times
    the weight in float64) rounded to float32, the contract's definition; the weight was
    rounded to float32 before the multiply, and scales of 2 to 7 of 16 rows differed."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 64, generator=g, dtype=torch.float64)
    w = torch.randn(64, generator=g, dtype=torch.float64)
    q, s = normlab.rms_norm(x, 64, w, 1e-6, casting="llama", quantize=mode, backend=backend)
    y = normlab.rms_norm(x, 64, w, 1e-6, casting="llama", backend=backend)
    assert y.dtype == torch.float64
    want = _want(y.float(), mode)
    assert _same(q, want[0]) and _same(s, want[1])


@pytest.mark.parametrize("backend", [None, "numpy"])
def test_nan_and_inf_stay_in_their_rows(backend: str | None) -> None:
    """A row holding NaN gets a NaN scale (int8 q 0, float8 q NaN), a row holding Inf an Inf
    scale; the other rows are those of the batch without them."""
    x = np.random.default_rng(2).standard_normal((6, 64)).astype(np.float32)
    x[1, 3] = np.nan
    x[4, 0] = np.inf
    for mode in ("int8", "fp8_e4m3"):
        q, scale = normlab.rms_norm(x, quantize=mode, backend=backend)
        assert np.isnan(scale[1, 0]) and np.isnan(scale[4, 0]) | np.isinf(scale[4, 0])
        if mode == "int8":
            assert (q[1] == 0).all()
        clean = normlab.rms_norm(x[[0, 2, 3, 5]], quantize=mode, backend=backend)
        assert np.array_equal(q[[0, 2, 3, 5]].view(np.uint8), clean[0].view(np.uint8))
        assert np.array_equal(scale[[0, 2, 3, 5]], clean[1])


def test_zero_rows_and_empty_inputs() -> None:
    """A row of zeros gives scale 0 and q 0 (no NaN); an empty batch gives empty q and scale."""
    x = np.zeros((3, 16), np.float32)
    x[2] = 1.0
    for mode in ("int8", "fp8_e4m3"):
        q, scale = normlab.rms_norm(x, quantize=mode)
        assert (scale[:2] == 0).all() and (q[:2].view(np.uint8) == 0).all()
        q, scale = normlab.rms_norm(np.zeros((0, 16), np.float32), quantize=mode)
        assert q.shape == (0, 16) and scale.shape == (0, 1) and scale.dtype == np.float32


def test_inputs_that_require_grad_and_compiled_graphs() -> None:
    """Parameters that require grad (a model not under no_grad) and torch.compile: the core's
    composition in torch's ops, the same bits as the eager call without grad."""
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 64)
    w = torch.nn.Parameter(torch.randn(64))
    q, s = normlab.rms_norm(x, 64, w, quantize="int8")
    assert not q.requires_grad
    want = normlab.rms_norm(x, 64, w.detach(), quantize="int8")
    assert torch.equal(q, want[0]) and torch.equal(s, want[1])
    assert "core runs" in normlab.explain(x, 64, w, op="rms_norm", quantize="int8")

    def block(x: Any, w: Any) -> Any:
        return normlab.rms_norm(x, 64, w, quantize="int8")

    compiled = torch.compile(block, backend="eager")
    got = compiled(x, w.detach())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_statistics_into_out(op: str) -> None:
    """``return_stats`` with ``out=(q, scale, mean, rstd)``: every array receives its result
    (the statistics those of the float32 call) and is returned."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 32)).astype(np.float32)
    args = (x, x[::-1].copy()) if op == "add_layer_norm" else (x,)
    outs = (np.zeros((5, 32), np.int8), *(np.zeros((5, 1), np.float32) for _ in range(3)))
    function = getattr(normlab, op)
    got = function(*args, quantize="int8", return_stats=True, out=outs)
    want = function(*args, quantize="int8", return_stats=True)
    kept = [r for r in got if r is not None and not any(r is o for o in outs)]
    assert all(g is o for g, o in zip((got[0], got[1], *got[-2:]), outs, strict=True))
    assert len(kept) == (1 if op == "add_layer_norm" else 0)  # h, allocated
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)


def test_float8_needs_a_float8_dtype() -> None:
    """A family without a float8 dtype gets a DtypeError naming it for "fp8_e4m3"; int8 is
    served."""
    xp = pytest.importorskip("array_api_strict")
    x = xp.ones((2, 8), dtype=xp.float32)
    with pytest.raises(normlab.DtypeError, match="needs a float8 e4m3fn dtype"):
        normlab.rms_norm(x, quantize="fp8_e4m3")
    q, scale = normlab.rms_norm(x, quantize="int8")
    assert q.dtype == xp.int8 and scale.shape == (2, 1)


def test_native_path_is_explained() -> None:
    pytest.importorskip("numba")
    x = np.ones((2, 8), np.float32)
    text = normlab.explain(x, quantize="int8", backend="numba")
    assert "numba writes q and scale in its own pass" in text
    text = normlab.explain(x, quantize="fp8_e4m3", quantize_scale=0.5, backend="numpy")
    assert "static scale 0.5" in text and "the core runs layer_norm for y in float32" in text
