"""Deliberately wrong backends, to prove the conformance suite has teeth.

NumPy kernels — :func:`layer_norm` (the shifted two-pass formula), :func:`rms_norm` and the
backward of both (:func:`layer_norm_backward`, :func:`rms_norm_backward`) — are correct unless
given a *flaw*; each flaw is one classic bug of one of them. :func:`plugin` makes a real normlab
plugin for one flaw: a module whose ``normlab_backends`` hook returns a record named
``mutant_<flaw>`` that points at the module itself, which also holds the kernels and the NumPy
converters. A LayerNorm mutant provides layer_norm only; an RMSNorm mutant provides both forward
ops, its layer_norm correct, so that only the suite's rms_norm tests can fail it; a backward
mutant (and the control) provides all six ops (the fused :func:`add_layer_norm` and
:func:`add_rms_norm` too), its forward ops correct, so that only the suite's backward tests can
fail it; a fused mutant provides layer_norm (correct) and add_layer_norm, so that only the
suite's fused tests can fail it. :func:`registered` registers a plugin for the duration of a
``with`` block.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import numpy as np

import normlab
from normlab.hookspecs import Plan
from normlab.ops import FORWARD_OPS, OPS

#: flaw -> what the kernel then does wrong. ``control`` is the correct pair of kernels.
FLAWS: Final = {
    "control": "nothing: mean and population variance per row, shifted two-pass; mean square; "
    "forward sums in float64 (extended precision for float64 x)",
    "std_plus_eps": "divides by sqrt(var) + eps instead of sqrt(var + eps)",
    "ddof1": "uses the sample variance (divides by cols - 1)",
    "naive_moments": "computes var = E[x^2] - E[x]^2, in float32 whatever x's dtype",
    "batch_stats": "takes one mean and variance over the whole batch, not per row",
    "ignored_strides": "reads x's memory as if it were C-contiguous (while claiming 'strided')",
    "half_accumulation": "sums (and adds eps) in x's dtype, float16 included",
    "bias_without_weight": "ignores bias when weight is None",
    "reads_x_after_writing": "recomputes the mean it returns from x after writing y into out, "
    "which is x's memory in place",
    "writes_into_x": "normalizes a C-contiguous x in x's own memory when given no out, then "
    "copies y out of it",
    "prepared_one_ulp_off": "prepares, for the direct route, a function whose y is its "
    "layer_norm's y with the last bit of every element flipped (within every tolerance)",
    "rows_past_65535": "leaves rows from 65,536 on untouched (y zero, statistics zero)",
    "drops_tail_block": "works in blocks of 32,768 rows and drops the last partial block",
    "stats_wrap_65536": "writes the statistics of rows from 65,536 on over rows 0, 1, …: "
    "y right, statistics wrong",
    "overflow_squares": "sums x and its squares in the compute dtype (float32 for float32): "
    "they overflow near the dtype's max",
    "flush_subnormals": "flushes inputs below float32's smallest normal to zero (float64: "
    "below its own), as a CPU's flush-to-zero mode does",
    "rms_mean_subtracted": "RMSNorm that subtracts the mean (LayerNorm without bias)",
    "rms_variance": "RMSNorm that divides x by sqrt(var + eps), the variance, not the mean square",
    "rms_eps_outside_root": "RMSNorm that divides by sqrt(mean(x^2)) + eps",
    "bwd_no_mean_g": "LayerNorm backward whose dx lacks the -mean(g) term",
    "bwd_rstd_squared": "backward that normalizes x with rstd**2 instead of rstd",
    "bwd_dbias_from_dx": "LayerNorm backward that sums dx over rows for dbias, not dy",
    "bwd_recomputed_stats": "backward that ignores the given mean and rstd and recomputes them "
    "as E[x^2] - E[x]^2 in float32 with eps 1e-5",
    "bwd_unordered_sums": "backward that sums dweight/dbias over rows in a random order",
    "bwd_thread_chunks": "backward that sums dweight/dbias in one chunk of rows per numba thread",
    "bwd_overwrites_dy": "backward that stores g = dy * weight in the caller's dy",
    "bwd_ignores_needs": "backward that returns every gradient, whatever needs says",
    "bwd_rms_mean_g": "RMSNorm backward whose dx subtracts mean(g) as LayerNorm's does",
    "row_count_order": "sums each row in the compute dtype, in reverse order once a batch "
    "holds 512 rows or more (a row's bits then depend on its batch)",
    "two_roundings": "forms y in the compute dtype from x - x0, rounded, minus the mean's "
    "remainder, rounded again (x0: the row's first element)",
    "bwd_row_count_order": "backward whose row sums for dx run in reverse order once a batch "
    "holds 512 rows or more",
    "bwd_half_sums": "backward that sums dweight and dbias over rows in x's dtype, float16 and "
    "bfloat16 included",
    "torch_half_sums": "the torch backend (CPU tensors, autograd kept) whose autograd graph of "
    "half x with half parameters is torch's own native_layer_norm's, which sums dweight and "
    "dbias in the half dtype",
    "normalize_before_rounding": "add_layer_norm that normalizes x + residual summed in the "
    "compute dtype (float64; extended for float64 x), h rounded to x's dtype only when written",
    "forgets_h": "add_layer_norm that returns h in a new array, leaving residual_out unwritten",
    "h_into_out": "add_layer_norm that writes h into out's memory, normalizes it there, then "
    "writes h again from x + residual (read after out, which may be x or residual, was written)",
    "offset_in_x_dtype": "adds weight_offset to the weight in the weight's own dtype (a float16 "
    "or bfloat16 weight: rounded there), not in the compute dtype",
    "offset_ignored": "declares the capability weight_offset and uses the weight as given",
    "offset_on_bias": "adds weight_offset to the bias as well as to the weight",
    "stream_rounded_h": "declares the capability residual_stream and rounds h = float32(x) + "
    "residual to x's half dtype before normalizing it (h returned as that rounded value)",
    "quant_round_half_away": "quantizes with ties rounded away from zero (int8 and e4m3fn), not "
    "to even",
    "quant_scale_from_half_y": "takes the dynamic scale from y rounded to x's half dtype, not "
    "from the float32 y",
    "quant_no_saturation": "converts y / scale to int8 (wrapping) or e4m3fn (NaN past 464) "
    "without saturating at ±127 / ±448",
    "quant_per_tensor_scale": "takes one dynamic scale for the whole batch, not one per row",
}

#: The flaws proper (every one but the control).
MUTANTS: Final = tuple(flaw for flaw in FLAWS if flaw != "control")

#: flaw -> tests of the suite before batch invariance, float32 accuracy and 4096-row half
#: gradients were promised, which the flaw passes (the new tests are what catches it).
ESCAPES: Final = {
    "row_count_order": frozenset({"test_batch_independence"}),
    "two_roundings": frozenset({"test_matches_reference", "test_large_offsets"}),
    "bwd_row_count_order": frozenset({"test_backward_matches_reference"}),
    "torch_half_sums": frozenset({"test_autograd_gradients"}),
}

#: Rows per block of the drops_tail_block flaw.
_BLOCK_ROWS: Final = 1 << 15
#: From this many rows the row_count_order flaws sum in another order (the suite's batch
#: independence test of 300 rows stays below it).
_REORDER_ROWS: Final = 512

#: The flaws of the RMSNorm kernel; the control has both ops too.
RMS_FLAWS: Final = frozenset(flaw for flaw in FLAWS if flaw.startswith("rms_"))

#: The flaws of the backward kernels (``bwd_rms_*``: of RMSNorm's only).
BACKWARD_FLAWS: Final = frozenset(flaw for flaw in FLAWS if flaw.startswith("bwd_"))

#: The flaws of the fused add_layer_norm kernel (its layer_norm is correct).
FUSED_FLAWS: Final = frozenset({"normalize_before_rounding", "forgets_h", "h_into_out"})

#: The flaws of the weight offset, which every numpy mutant applies itself (the record declares
#: the capability ``"weight_offset"``: the suite sees the native path, not the core's).
OFFSET_FLAWS: Final = frozenset({"offset_in_x_dtype", "offset_ignored", "offset_on_bias"})

#: The flaws of a float32 residual stream (a mutant whose record declares the capability
#: ``"residual_stream"``; the other mutants leave the stream to the core).
STREAM_FLAWS: Final = frozenset({"stream_rounded_h"})

#: The flaws of quantized outputs (mutants whose record declares the capability
#: ``"quantize"``, as the control's does: the suite sees their own ``quantized``).
QUANTIZE_FLAWS: Final = frozenset(flaw for flaw in FLAWS if flaw.startswith("quant_"))

#: The flaws of a torch-family mutant (normlab's torch backend with one fix undone).
TORCH_FLAWS: Final = frozenset({"torch_half_sums"})

#: flaw -> the ``-k`` expression of the suite tests that must catch it, for flaws that need
#: not run the whole suite (the suite's CI time stays flat). A flaw of one op or direction runs
#: that op's or direction's tests: its other kernels are the control's, which passes the whole
#: suite.
ONLY: Final = {
    **dict.fromkeys(RMS_FLAWS, "rms_norm"),
    **dict.fromkeys(BACKWARD_FLAWS, "backward"),
    "bwd_row_count_order": "backward_rows_alone or backward_matches_reference",
    "bwd_half_sums": "half_parameter_gradients or backward_matches_reference or backward_affine",
    "reads_x_after_writing": "in_place",
    "writes_into_x": "x_never_modified",
    "prepared_one_ulp_off": "x_never_modified",
    "rows_past_65535": "boundary_shapes",
    "drops_tail_block": "boundary_shapes",
    "stats_wrap_65536": "boundary_shapes",
    "overflow_squares": "magnitudes",
    "flush_subnormals": "magnitudes",
    "row_count_order": "row_alone_and_in_any_batch or batch_independence",
    "two_roundings": "as_accurate_as_torch or matches_reference or large_offsets",
    "torch_half_sums": "half_parameter_gradients or autograd_gradients",
    **dict.fromkeys(("normalize_before_rounding", "forgets_h", "h_into_out"), "fused or add_"),
    **dict.fromkeys(("offset_in_x_dtype", "offset_ignored", "offset_on_bias"), "weight_offset"),
    "stream_rounded_h": "residual_stream",
    **dict.fromkeys(
        (
            "quant_round_half_away",
            "quant_scale_from_half_y",
            "quant_no_saturation",
            "quant_per_tensor_scale",
        ),
        "quantize",
    ),
}

#: The ops each kind of mutant provides.
_FORWARD_OPS: Final = frozenset(FORWARD_OPS)
_ALL_OPS: Final = frozenset(OPS)


def layer_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    plan: Plan,
    out: np.ndarray | None,
    flaw: str = "control",
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """LayerNorm of the rows of the 2-D ``x`` (normlab's backend contract), with ``flaw``."""
    weight = _offset_weight(weight, plan, flaw)
    if flaw == "offset_on_bias" and bias is not None and plan.weight_offset:
        compute_dtype = np.dtype(plan.compute_dtype)
        bias = bias.astype(compute_dtype) + compute_dtype.type(plan.weight_offset)
    compute = _compute_dtype(plan, flaw)
    if flaw == "naive_moments":
        compute = np.dtype(np.float32)
    elif flaw == "half_accumulation":
        compute = x.dtype
    elif flaw in ("row_count_order", "two_roundings"):
        compute = np.dtype(plan.compute_dtype)
    if flaw == "ignored_strides":
        x = _as_if_c_contiguous(x)
    xc = _read(x, compute, flaw)  # a copy: out may be x's own memory
    eps = compute.type(plan.eps)
    if flaw == "batch_stats":
        mean = np.full((plan.rows, 1), xc.mean(), compute)
        var = np.full((plan.rows, 1), ((xc - mean) ** 2).mean(), compute)
    elif flaw == "naive_moments":
        mean = xc.mean(axis=1, keepdims=True)
        var = (xc * xc).mean(axis=1, keepdims=True) - mean * mean
    elif flaw == "two_roundings":
        x0 = xc[:, :1]
        shifted = xc - x0  # rounded at the scale of |x - x0|
        shift = shifted.mean(axis=1, keepdims=True, dtype=compute)
        d = shifted - shift  # rounded again
        var = (d * d).mean(axis=1, keepdims=True, dtype=compute)
        mean = x0 + shift
        z = d / np.sqrt(var + eps)
        y = _write(_affine(z, weight, bias, compute, flaw), x, out, flaw)
        if not plan.return_stats:
            return y, None, None
        return y, *_stats_of(mean, 1 / np.sqrt(var + eps), plan, flaw)
    elif flaw == "row_count_order" and plan.rows >= _REORDER_ROWS:
        mean = _shifted_mean(xc[:, ::-1], compute)
        squares = ((xc[:, ::-1] - mean) ** 2).sum(axis=1, keepdims=True, dtype=compute)
        var = squares / compute.type(plan.cols)
    else:
        mean = _shifted_mean(xc, compute)
        squares = ((xc - mean) ** 2).sum(axis=1, keepdims=True, dtype=compute)
        var = squares / compute.type(plan.cols - 1 if flaw == "ddof1" else plan.cols)
    root = np.sqrt(var) + eps if flaw == "std_plus_eps" else np.sqrt(var + eps)
    rstd = 1 / root
    y = _write(_affine((xc - mean) * rstd, weight, bias, compute, flaw), x, out, flaw)
    if flaw == "reads_x_after_writing":
        mean = _shifted_mean(x.astype(compute), compute)
    if not plan.return_stats:
        return y, None, None
    return y, *_stats_of(mean, rstd, plan, flaw)


def _offset_weight(weight: np.ndarray | None, plan: Plan, flaw: str) -> np.ndarray | None:
    """The weight the kernels use: ``plan.weight_offset + weight`` formed in the plan's compute
    dtype (the offset_in_x_dtype flaw: in the weight's); the weight itself without an offset."""
    offset = plan.weight_offset
    if weight is None or not offset or flaw == "offset_ignored":
        return weight
    dtype = weight.dtype if flaw == "offset_in_x_dtype" else np.dtype(plan.compute_dtype)
    return weight.astype(dtype) + dtype.type(offset)


def _affine(
    z: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, compute: Any, flaw: str
) -> np.ndarray:
    """``z * weight + bias`` in ``compute`` (bias dropped without weight by that flaw)."""
    if weight is not None:
        z = z * weight.astype(compute)
    if bias is not None and not (flaw == "bias_without_weight" and weight is None):
        z = z + bias.astype(compute)
    return z


def _compute_dtype(plan: Plan, flaw: str) -> np.dtype[Any]:
    """A type whose squares of x's values neither overflow nor underflow: float64 for the
    narrower dtypes, extended precision (``np.longdouble``) for float64 (the overflow flaw: the
    plan's compute dtype)."""
    if flaw == "overflow_squares":
        return np.dtype(plan.compute_dtype)
    return np.dtype(np.longdouble if plan.dtype == "float64" else np.float64)


def _read(x: np.ndarray, compute: np.dtype[Any], flaw: str) -> np.ndarray:
    """x's rows as a new array of ``compute`` (subnormals flushed to zero by that flaw)."""
    xc = x.astype(compute, order="C")  # sums over C rows: the same order whatever x's strides
    if flaw == "flush_subnormals":
        xc[np.abs(xc) < np.finfo(np.float64 if x.dtype == np.float64 else np.float32).tiny] = 0
    return xc


def _shifted_mean(xc: np.ndarray, compute: np.dtype[Any]) -> np.ndarray:
    x0 = xc[:, :1]
    total = (xc - x0).sum(axis=1, keepdims=True, dtype=compute)
    return x0 + total / compute.type(xc.shape[1])  # type: ignore[no-any-return]


def _write(z: np.ndarray, x: np.ndarray, out: np.ndarray | None, flaw: str) -> np.ndarray:
    """y: ``z`` rounded to x's dtype, in ``out`` when given (rows dropped by some flaws)."""
    if flaw == "writes_into_x" and out is None and x.flags.writeable and x.flags.c_contiguous:
        x[...] = z
        return x.copy()
    y = out if out is not None else np.empty(x.shape, x.dtype)
    written = z.shape[0]
    if flaw == "rows_past_65535":
        written = min(written, 65_536)
    elif flaw == "drops_tail_block" and written > _BLOCK_ROWS:
        written -= written % _BLOCK_ROWS
    y[:written] = z[:written]
    y[written:] = 0
    return y


def _stats_of(
    mean: np.ndarray, rstd: np.ndarray, plan: Plan, flaw: str
) -> tuple[np.ndarray, np.ndarray]:
    """mean and rstd as 1-D arrays of the statistics dtype (wrapped or dropped by some flaws)."""
    stats = [a[:, 0].astype(plan.stats_dtype) for a in (mean, rstd)]
    for a in stats:
        if flaw == "stats_wrap_65536" and a.shape[0] > 65_536:
            a[65_536:] = a[: a.shape[0] - 65_536].copy()
        elif flaw == "rows_past_65535":
            a[65_536:] = 0
        elif flaw == "drops_tail_block" and a.shape[0] > _BLOCK_ROWS:
            a[a.shape[0] - a.shape[0] % _BLOCK_ROWS :] = 0
    return stats[0], stats[1]


def rms_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: None,
    *,
    plan: Plan,
    out: np.ndarray | None,
    flaw: str = "control",
) -> tuple[np.ndarray, None, np.ndarray | None]:
    """RMSNorm of the rows of the 2-D ``x``, ``x / sqrt(mean(x^2) + eps) * weight``, with
    ``flaw``."""
    weight = _offset_weight(weight, plan, flaw)
    compute = _compute_dtype(plan, flaw)
    xc = _read(x, compute, flaw)  # a copy: out may be x's own memory
    eps = compute.type(plan.eps)
    n = compute.type(plan.cols)
    if flaw in ("rms_mean_subtracted", "rms_variance"):
        mean = xc.sum(axis=1, keepdims=True, dtype=compute) / n
        square = ((xc - mean) ** 2).sum(axis=1, keepdims=True, dtype=compute) / n
        if flaw == "rms_mean_subtracted":
            xc = xc - mean
    else:
        square = (xc * xc).sum(axis=1, keepdims=True, dtype=compute) / n
    root = np.sqrt(square) + eps if flaw == "rms_eps_outside_root" else np.sqrt(square + eps)
    rstd = 1 / root
    z = xc * rstd
    if weight is not None:
        z = z * weight.astype(compute)
    y = out if out is not None else np.empty(x.shape, x.dtype)
    y[...] = z
    if not plan.return_stats:
        return y, None, None
    return y, None, rstd[:, 0].astype(plan.stats_dtype)


def add_layer_norm(
    x: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    plan: Plan,
    out: np.ndarray | None,
    residual_out: np.ndarray | None,
    flaw: str = "control",
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """``h = x + residual`` rounded to x's dtype, then :func:`layer_norm` of h (normlab's fused
    backend contract), with ``flaw``."""
    if plan.residual_dtype is not None:
        return _rounded_stream(x, residual, weight, bias, plan, out, residual_out, layer_norm)
    if flaw == "normalize_before_rounding":
        compute = _compute_dtype(plan, flaw)
        exact = x.astype(compute) + residual.astype(compute)
        y, mean, rstd = layer_norm(exact, weight, bias, plan=plan, out=None)
        y = _write(y, x, out, "control")
        h = _h_into(exact, x, residual_out) if plan.return_residual else None
        return y, h, mean, rstd
    if flaw == "h_into_out" and out is not None:
        np.add(x, residual, out=out)
        y, mean, rstd = layer_norm(out, weight, bias, plan=plan, out=out)
        h = _h_into(np.add(x, residual), x, residual_out) if plan.return_residual else None
        return y, h, mean, rstd
    h = np.add(x, residual)  # a new array: out and residual_out may be x's or residual's memory
    y, mean, rstd = layer_norm(h, weight, bias, plan=plan, out=out)
    if not plan.return_residual:
        return y, None, mean, rstd
    return y, _h_into(h, x, None if flaw == "forgets_h" else residual_out), mean, rstd


def add_rms_norm(
    x: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray | None,
    bias: None,
    *,
    plan: Plan,
    out: np.ndarray | None,
    residual_out: np.ndarray | None,
    flaw: str = "control",
) -> tuple[np.ndarray, np.ndarray | None, None, np.ndarray | None]:
    """``h = x + residual`` rounded to x's dtype, then :func:`rms_norm` of h (no flaw of its
    own but the stream's)."""
    if plan.residual_dtype is not None:
        return _rounded_stream(x, residual, weight, None, plan, out, residual_out, rms_norm)
    h = np.add(x, residual)
    y, _, rstd = rms_norm(h, weight, None, plan=plan, out=out)
    return y, (_h_into(h, x, residual_out) if plan.return_residual else None), None, rstd


def _rounded_stream(
    x: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    plan: Plan,
    out: np.ndarray | None,
    residual_out: np.ndarray | None,
    norm: Any,
) -> Any:
    """The stream_rounded_h flaw (the only mutant whose record takes a float32 stream): h =
    float32(x) + residual rounded to x's half dtype, normalized, and returned as float32."""
    h = np.add(x.astype(np.float32), residual).astype(x.dtype)
    y, mean, rstd = norm(h, weight, bias, plan=plan, out=out)
    return y, _h_into(h, residual, residual_out) if plan.return_residual else None, mean, rstd


def quantized(
    x: np.ndarray,
    residual: np.ndarray | None,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    plan: Plan,
    residual_out: np.ndarray | None,
    flaw: str = "control",
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantized outputs (normlab's ``quantized`` contract): the control kernels' float32 y of
    float32 x (or h), quantized in NumPy, with ``flaw``."""
    source = x
    h = None
    if residual is not None:
        source = np.add(x, residual)  # rounded to x's dtype, as the family's add
        if residual_out is not None:
            residual_out[...] = source
            source = residual_out
        h = source if plan.return_residual else None
    wide = source if source.dtype == np.float64 else source.astype(np.float32)
    base = plan.op.removeprefix("add_")
    norm = layer_norm if base == "layer_norm" else rms_norm
    base_plan = dataclasses.replace(
        plan, op=base, dtype=wide.dtype.name, quantize=None, quantize_scale=None
    )
    y = norm(wide, weight, bias, plan=base_plan, out=None)[0].astype(np.float32)
    limit = 127.0 if plan.quantize == "int8" else 448.0
    magnitudes = np.abs(y)
    if flaw == "quant_scale_from_half_y" and x.dtype.itemsize == 2:
        magnitudes = np.abs(y.astype(x.dtype).astype(np.float32))
    if plan.quantize_scale is not None:
        s = np.full((plan.rows, 1), plan.quantize_scale, np.float32)
    elif flaw == "quant_per_tensor_scale":
        s = np.full((plan.rows, 1), magnitudes.max(initial=0.0) / np.float32(limit), np.float32)
    else:
        s = magnitudes.max(axis=1, keepdims=True, initial=0.0) / np.float32(limit)
    with np.errstate(invalid="ignore", over="ignore"):
        v = np.where(s == 0, np.float32(0.0), y / np.where(s == 0, np.float32(1.0), s))
        if flaw != "quant_no_saturation":
            v = np.clip(v, -limit, limit)
        if plan.quantize == "int8":
            r = (
                np.floor(np.abs(v) + 0.5) * np.sign(v)
                if flaw == "quant_round_half_away"
                else np.rint(v)
            )
            r = np.where(np.isnan(r), 0.0, r)
            q = (r.astype(np.int64) & 0xFF).astype(np.uint8).view(np.int8)
        else:
            import ml_dtypes

            if flaw == "quant_round_half_away":
                v = _e4m3_half_away(v)
            q = v.astype(ml_dtypes.float8_e4m3fn)
    return q, np.ascontiguousarray(s[:, 0], np.float32), h


def _e4m3_half_away(v: np.ndarray) -> np.ndarray:
    """``v`` rounded to e4m3fn's precision with ties away from zero (then exact in e4m3fn)."""
    a = np.abs(v).astype(np.float64)
    exponent = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    quantum = 2.0 ** (np.maximum(exponent, -6) - 3)
    return (np.floor(a / quantum + 0.5) * quantum * np.sign(v)).astype(np.float32)


def _h_into(h: np.ndarray, x: np.ndarray, residual_out: np.ndarray | None) -> np.ndarray:
    """h rounded to x's dtype, in ``residual_out`` when given."""
    target = residual_out if residual_out is not None else np.empty(x.shape, x.dtype)
    target[...] = h
    return target


def layer_norm_backward(
    dy: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    *,
    plan: Plan,
    needs: frozenset[str],
    flaw: str = "control",
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """LayerNorm's gradients of the 2-D rows (normlab's backward contract), with ``flaw``."""
    return _backward(dy, x, mean, rstd, weight, plan, needs, flaw)


def rms_norm_backward(
    dy: np.ndarray,
    x: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    *,
    plan: Plan,
    needs: frozenset[str],
    flaw: str = "control",
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """RMSNorm's gradients of the 2-D rows, with ``flaw``."""
    dx, dweight, _ = _backward(dy, x, None, rstd, weight, plan, needs - {"bias"}, flaw)
    return dx, dweight


def _backward(
    dy: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray | None,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    plan: Plan,
    needs: frozenset[str],
    flaw: str,
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Both backward ops (``mean`` None: RMSNorm): ``x̂ = (d - mean(d)) * rstd`` with
    ``d = x - mean`` (the residual removes the rounding of the given mean; RMSNorm: ``d = x``),
    ``g = dy * weight``, ``dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))`` (RMSNorm: no
    ``mean(g)``), ``dweight = Σ dy * x̂``, ``dbias = Σ dy``; row sums in the compute dtype."""
    weight = _offset_weight(weight, plan, flaw)
    compute = np.dtype(plan.compute_dtype)
    r = rstd.astype(compute)[:, None]
    if flaw == "bwd_recomputed_stats":
        x32 = x.astype(np.float32)
        m32 = x32.mean(axis=1, keepdims=True) if mean is not None else np.float32(0)
        var = (x32 * x32).mean(axis=1, keepdims=True) - m32 * m32
        r = (1 / np.sqrt(var + np.float32(1e-5))).astype(compute)
        mean = None if mean is None else np.asarray(m32[:, 0])
    d = x.astype(compute)
    if mean is not None:
        d = d - mean.astype(compute)[:, None]
        d = d - d.mean(axis=1, keepdims=True, dtype=compute)
    xhat = d * (r * r if flaw == "bwd_rstd_squared" else r)
    dyc = dy.astype(compute)
    g = dyc if weight is None else dyc * weight.astype(compute)
    if flaw == "bwd_overwrites_dy" and dy.flags.writeable:
        dy[...] = g
    centred_g = g
    reorder = flaw == "bwd_row_count_order" and plan.rows >= _REORDER_ROWS
    if flaw == "bwd_rms_mean_g" if mean is None else flaw != "bwd_no_mean_g":
        centred_g = g - _in_order(g, reorder).mean(axis=1, keepdims=True)
    gx = _in_order(g * xhat, reorder)
    dx = r * (centred_g - xhat * gx.mean(axis=1, keepdims=True))
    if flaw == "bwd_ignores_needs":
        needs = frozenset({"x", "weight", "bias"} if mean is not None else {"x", "weight"})
    sums = x.dtype if flaw == "bwd_half_sums" else compute
    return (
        dx.astype(x.dtype) if "x" in needs else None,
        _row_sum(dyc * xhat, sums, flaw) if "weight" in needs else None,
        _row_sum(dx if flaw == "bwd_dbias_from_dx" else dyc, sums, flaw)
        if "bias" in needs
        else None,
    )


def _in_order(terms: np.ndarray, reversed_: bool) -> np.ndarray:
    """``terms``, or a copy with each row's elements in reverse order (so sums run backwards)."""
    return np.ascontiguousarray(terms[:, ::-1]) if reversed_ else terms


def _row_sum(terms: np.ndarray, compute: np.dtype[Any], flaw: str) -> np.ndarray:
    """The column sums of ``terms`` in ``compute``, row after row (the order ``flaw`` says)."""
    if flaw == "bwd_unordered_sums":
        terms = terms[np.random.default_rng().permutation(terms.shape[0])]
    if flaw == "bwd_half_sums":  # row after row, rounding each partial sum to the half type
        total = np.zeros(terms.shape[1], compute)
        for row in terms:
            total = (total + row).astype(compute)
        return total
    if flaw == "bwd_thread_chunks":
        import numba

        chunks = np.array_split(terms, numba.get_num_threads())
        total = np.zeros(terms.shape[1], compute)
        for chunk in chunks:
            total += chunk.sum(axis=0, dtype=compute)
        return total
    summed: np.ndarray = terms.sum(axis=0, dtype=compute)
    return summed


def _as_if_c_contiguous(x: np.ndarray) -> np.ndarray:
    """x's memory read from its first element as C-contiguous rows, where that stays inside x's
    extent (transposed, sliced views); else x's elements in memory order (reversed, broadcast)."""
    if x.flags.c_contiguous:
        return x
    byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds  # numpy 2 moved it
    low, high = byte_bounds(x)
    if x.__array_interface__["data"][0] == low and high - low >= x.nbytes:
        return np.lib.stride_tricks.as_strided(x, x.shape, (x.shape[1] * x.itemsize, x.itemsize))
    return np.ravel(x, order="K").reshape(x.shape)


def to_numpy(a: np.ndarray) -> np.ndarray:
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    return np.array(a, copy=True)


def plugin(flaw: str, **record_fields: Any) -> types.ModuleType:
    """A plugin module providing the backend ``mutant_<flaw>``; the module is its own backend
    module (``<this module>.<flaw>``, importable while :func:`registered`). ``record_fields``
    override the record's defaults (``flushes_subnormals=True``)."""
    module_name = f"{__name__}.{flaw}"
    module = types.ModuleType(module_name, f"A mutant that {FLAWS[flaw]}.")
    if flaw in TORCH_FLAWS:
        return _torch_plugin(module, flaw, **record_fields)
    if flaw in BACKWARD_FLAWS | OFFSET_FLAWS | STREAM_FLAWS | QUANTIZE_FLAWS | {"control"}:
        ops = _ALL_OPS
    elif flaw in FUSED_FLAWS:
        ops = frozenset({"layer_norm", "add_layer_norm"})
    else:
        ops = _FORWARD_OPS if flaw in RMS_FLAWS else frozenset({"layer_norm"})
    record = normlab.BackendRecord(
        name=f"mutant_{flaw}",
        module=module_name,
        families=frozenset({"numpy"}),
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        ops=ops,
        priority=-100,  # never chosen unless named
        capabilities=frozenset(
            {"strided", "out", "inplace", "weight_offset"}
            | ({"residual_stream"} if flaw in STREAM_FLAWS else set())
            | ({"quantize"} if flaw in QUANTIZE_FLAWS | {"control"} else set())
        ),
        # the library whose thread count the suite varies (bwd_thread_chunks follows it)
        library="numba" if flaw == "bwd_thread_chunks" else None,
        description=f"a mutant for the suite's teeth: {FLAWS[flaw]}",
        **record_fields,
    )

    @normlab.hookimpl
    def normlab_backends() -> list[normlab.BackendRecord]:
        return [record]

    module.normlab_backends = normlab_backends  # type: ignore[attr-defined]
    module.layer_norm = functools.partial(layer_norm, flaw=flaw)  # type: ignore[attr-defined]
    module.rms_norm = functools.partial(rms_norm, flaw=flaw)  # type: ignore[attr-defined]
    module.layer_norm_backward = functools.partial(  # type: ignore[attr-defined]
        layer_norm_backward, flaw=flaw
    )
    module.rms_norm_backward = functools.partial(  # type: ignore[attr-defined]
        rms_norm_backward, flaw=flaw
    )
    module.add_layer_norm = functools.partial(  # type: ignore[attr-defined]
        add_layer_norm, flaw=flaw
    )
    module.add_rms_norm = functools.partial(add_rms_norm, flaw=flaw)  # type: ignore[attr-defined]
    module.quantized = functools.partial(quantized, flaw=flaw)  # type: ignore[attr-defined]
    module.to_numpy = to_numpy  # type: ignore[attr-defined]
    module.from_numpy = from_numpy  # type: ignore[attr-defined]
    if flaw == "prepared_one_ulp_off":
        module.prepare = _prepare_one_ulp_off  # type: ignore[attr-defined]
    return module


def _torch_plugin(module: types.ModuleType, flaw: str, **record_fields: Any) -> types.ModuleType:
    """The torch-family mutant of ``flaw``: normlab's torch backend (forward ops, autograd kept)
    with its float32 parameter gradients for half x undone."""
    from unittest import mock

    from normlab.backends import torch_backend

    record = normlab.BackendRecord(
        name=f"mutant_{flaw}",
        module=module.__name__,
        families=frozenset({"torch"}),
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        ops=frozenset({"layer_norm"}),
        priority=-100,  # never chosen unless named
        capabilities=frozenset({"autograd"}),
        library="torch",
        description=f"a mutant for the suite's teeth: {FLAWS[flaw]}",
        **record_fields,
    )

    def layer_norm(x: Any, weight: Any, bias: Any, *, plan: Plan, out: Any) -> Any:
        with mock.patch.object(torch_backend, "_parameter_grads", return_value=False):
            return torch_backend.layer_norm(x, weight, bias, plan=plan, out=out)

    @normlab.hookimpl
    def normlab_backends() -> list[normlab.BackendRecord]:
        return [record]

    module.normlab_backends = normlab_backends  # type: ignore[attr-defined]
    module.layer_norm = layer_norm  # type: ignore[attr-defined]
    module.to_numpy = torch_backend.to_numpy  # type: ignore[attr-defined]
    module.from_numpy = torch_backend.from_numpy  # type: ignore[attr-defined]
    return module


def _prepare_one_ulp_off(op: str, plan: Plan) -> Any:
    """The ``prepare`` of the prepared_one_ulp_off flaw: layer_norm with y's last bits flipped."""
    if op != "layer_norm":
        return None

    def one_ulp_off(x: np.ndarray, weight: Any, bias: Any) -> tuple[np.ndarray, None, None]:
        y = layer_norm(x, weight, bias, plan=plan, out=None)[0]
        bits = y.view(f"u{y.itemsize}")
        return (bits ^ bits.dtype.type(1)).view(y.dtype), None, None

    return one_ulp_off


@contextmanager
def registered(flaw: str, **record_fields: Any) -> Iterator[str]:
    """Register the plugin of ``flaw`` (its record given ``record_fields``) and yield its backend
    name; unregister on exit."""
    module = plugin(flaw, **record_fields)
    sys.modules[module.__name__] = module
    normlab.register_plugin(module)
    try:
        yield f"mutant_{flaw}"
    finally:
        normlab.unregister_plugin(module)
        del sys.modules[module.__name__]
