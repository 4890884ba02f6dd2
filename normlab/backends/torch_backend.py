"""The PyTorch backend: torch's own layer_norm/rms_norm kernels on CPU and CUDA, autograd kept.

This backend is torch's kernels, with torch's numerics, plus on CPU a repair of the rows where
those numerics fail. After each CPU call a rows-sized check of the statistics torch returns
(``rstd``) finds the rows that torch's float32 arithmetic got wrong, and :func:`_wide_rows`
recomputes only those, in float64 with torch operations (differentiable; each such row is
first divided by a power of two). Bad rows are those where

* ``rstd`` is 0, inf or NaN: float32 squares that overflow (rows spread wider than about
  1.8e19), or an ``eps`` that vanishes in float32 on a constant row (0 * inf = NaN);
* with an eps too small to hide it, ``rstd`` beyond ``1/sqrt(tiny)`` (the variance is below
  the compute dtype's smallest normal number: squares that underflowed);
* ``eps > 0`` dominates the variance (``rstd >= 0.5 / sqrt(eps)``) of a LayerNorm row, or of
  an RMSNorm row whose eps is below float32's normal range (1.2e-38; torch rounds it to a
  float32 subnormal or to 0). For half x torch's CPU kernel is off there by about
  ``|mean| * rstd * 2^-24``, so a constant row misses ``bias`` (-1.6e-5 at ``eps=1e-5`` on rows
  of 3.1, -0.125 at 1e-12, -inf at 1e-30); for float32/float64 x it finds variance 0 for rows
  whose mean is not representable (``[2**24 + 6, 2**24 + 4]`` in float32: ``y = [632, 0]``
  for ``[1, -1]``; found by the fuzzer). A row whose variance truly is that small (a constant
  row) is recomputed too, with the same result.

The check does not run on CUDA (reading the statistics back would make every call wait for
the device) nor inside ``torch.compile``/``torch.export`` graphs (which cannot branch on
values): there the results are torch's own, deviations included (a documented deviation of
this backend; on CUDA not measured here). Statistics for ``return_stats`` come from
``torch.native_layer_norm`` (the values that produced ``y``), recomputed in float32 where a
device returns them in a half type (rstd with eps added in float64).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Final

import numpy as np
import torch

from normlab.constants import MACHINE_EPS, ROW_CHUNK, stats_dtype_for
from normlab.hookspecs import Plan

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "from_numpy",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "to_numpy",
]

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
#: float32's smallest normal number: a smaller eps is rounded (or lost) by torch's float32 math.
_FLOAT32_TINY: Final = float(np.finfo(np.float32).tiny)
#: Rows recomputed by _wide_rows are scaled by 2^k, |k| at most this (float64 normal range).
_SCALE_LIMIT: Final = 1000
#: The smallest normal number of each compute dtype: a variance below it has lost precision.
_TINY: Final = {"float32": _FLOAT32_TINY, "float64": float(np.finfo(np.float64).tiny)}

#: A CPU call of at most this many rows checks its ``rstd`` as Python floats, not by a torch
#: reduction (:func:`_all_within`): the same test, cheaper for a few rows.
FEW_ROWS: Final = 16
#: Elements per block of rows in the CPU backward (whole chunks of ROW_CHUNK rows, at least
#: one): each of its full-size temporaries holds about this many, never the whole batch.
ROW_BLOCK_ELEMENTS = 1 << 18
#: A CPU backward of at most this many elements is one block: its temporaries are small, and
#: more blocks mean more torch operations, each a parallel region (slow on a busy machine).
ONE_BLOCK_ELEMENTS = 1 << 20


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    plan: Plan,
    out: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Normalize each row of the 2-D tensor ``x``; see :mod:`normlab.hookspecs`. On CPU, rows
    that torch's float32 arithmetic gets wrong are recomputed (see the module docstring)."""
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        weight, bias = weight.float(), bias.float()  # torch wants one parameter dtype
    elif weight is None and bias is not None and bias.dtype != x.dtype:
        weight = torch.ones_like(bias)  # torch's CPU backward of a lone float32 bias raises
    shape = (plan.cols,)
    on_cpu = _checked(x)
    if not plan.return_stats and not on_cpu:
        return torch.nn.functional.layer_norm(x, shape, weight, bias, plan.eps), None, None
    given = x
    if on_cpu and plan.requires_grad and _mixed(x, weight, bias):
        # torch's CPU backward of half x with float32 parameters sums dweight and dbias in the
        # half dtype (errors near 1% of their scale): normalize in float32, round y once
        x = x.float()
    chunked = on_cpu and x.dtype in _HALF and _parameter_grads(weight, bias)

    def native(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if chunked:
            return _ChunkedParameterGradients.apply(rows, weight, bias, plan)  # type: ignore[no-untyped-call,no-any-return]
        return torch.native_layer_norm(rows, shape, weight, bias, plan.eps)

    y, mean, rstd = native(x)
    stats_dtype = _TORCH_DTYPES[plan.stats_dtype]
    if plan.return_stats and mean.dtype != stats_dtype:  # a half-precision result: recompute
        var, mean = torch.var_mean(x.detach().to(stats_dtype), dim=1, correction=0)
        rstd = torch.rsqrt(var.double() + plan.eps).to(stats_dtype)
    if on_cpu:
        bad = _bad_rows(plan, rstd, centre=True)
        if bad is not None:
            mean, rstd = mean.reshape(plan.rows), rstd.reshape(plan.rows)
            if y.requires_grad:  # y's graph runs through the bad rows' inf/NaN: rebuild it
                good = _indices(bad.logical_not())
                y = torch.zeros_like(y)
                if good.numel():  # every row bad: y is the repaired rows alone
                    y = y.index_put((good,), native(x[good])[0])
            y, (mean, rstd) = _repair(x, weight, bias, plan, _indices(bad), y, (mean, rstd))
    if x is not given:
        y = y.to(given.dtype)
    if not plan.return_stats:
        return y, None, None
    return y, mean.reshape(plan.rows), rstd.reshape(plan.rows)


def _mixed(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Half-precision ``x`` with a float32 weight or bias."""
    return x.dtype in (torch.float16, torch.bfloat16) and any(
        p is not None and p.dtype == torch.float32 for p in (weight, bias)
    )


#: The half-precision dtypes, whose parameter gradients torch's CPU backward sums in x's dtype.
_HALF: Final = (torch.float16, torch.bfloat16)


def _parameter_grads(weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """A weight or bias that requires grad (in grad mode)."""
    return torch.is_grad_enabled() and any(
        p is not None and p.requires_grad for p in (weight, bias)
    )


class _ChunkedParameterGradients(torch.autograd.Function):
    """``torch.native_layer_norm`` of half x on CPU whose parameter gradients sum in fixed
    chunks, in float32.

    torch's CPU backward of half x sums dweight and dbias in the half dtype (a bfloat16 sum
    stalls once it is 256 times its terms: 4096 rows of ones give ``dbias == 512``), over rows
    split by the thread count, and takes dx from the statistics rounded to the half dtype (rows
    of a large mean relative to their spread lose every digit). Here the forward is torch's own
    call (the same bits as without grad) and the backward is :func:`_backward` from float32
    statistics: dx rounded once to x's dtype, dweight and dbias chunk sums in float32 rounded
    once into the parameter's dtype. It is made of torch operations: differentiable again.
    (float32 and float64 x keep torch's own backward, 4-6 times faster here, whose parameter
    gradients follow the thread count: a documented deviation, docs/training.md.)
    """

    @staticmethod
    def forward(
        x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, plan: Plan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.native_layer_norm(x, (plan.cols,), weight, bias, plan.eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        x, weight, bias, plan = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.plan = plan
        ctx.mark_non_differentiable(mean, rstd)

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor, _dmean: Any, _drstd: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        plan: Plan = ctx.plan
        wanted = zip(("x", "weight", "bias"), ctx.needs_input_grad, strict=False)
        needs = frozenset(name for name, wants in wanted if wants)
        compute = _TORCH_DTYPES[stats_dtype_for(_dtype_name(x))]
        if mean.dtype != compute:  # torch returned them rounded to x's half dtype: again
            with torch.no_grad():
                var, mean = torch.var_mean(x.detach().float(), dim=1, correction=0)
                rstd = torch.rsqrt(var.double() + plan.eps).float()
        dx, dweight, dbias = _backward(
            dy, x, mean.reshape(-1), rstd.reshape(-1), weight, plan, needs
        )
        return (
            dx,
            None if dweight is None or weight is None else dweight.to(weight.dtype),
            None if dbias is None or bias is None else dbias.to(bias.dtype),
            None,
        )


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    plan: Plan,
    out: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``torch.nn.functional.rms_norm`` on the 2-D ``x``; rstd recomputed in float32/64. On
    CPU its ``rstd`` is checked and the bad rows are recomputed (see the module docstring)."""
    if _checked(x) and hasattr(torch, "_fused_rms_norm"):  # private: present in pinned torch
        return _rms_norm_cpu(x, weight, plan)
    if weight is not None and weight.dtype != x.dtype:  # float32 weight, half x: widen x
        y = torch.nn.functional.rms_norm(x.float(), (plan.cols,), weight, plan.eps).to(x.dtype)
    else:
        y = torch.nn.functional.rms_norm(x, (plan.cols,), weight, plan.eps)
    if not plan.return_stats:
        return y, None
    wide = x.detach().to(_TORCH_DTYPES[plan.stats_dtype])
    rstd = torch.rsqrt(wide.square().mean(dim=1) + plan.eps)
    return y, rstd


def _rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor | None, plan: Plan
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``torch._fused_rms_norm``, the function ``torch.nn.functional.rms_norm`` runs on CPU
    (torch is pinned), which also returns ``rstd`` (float32 for half x); then the check."""
    y, rstd = torch._fused_rms_norm(x, [plan.cols], weight, plan.eps)
    rstd = rstd.detach()
    bad = _bad_rows(plan, rstd, centre=False)
    if bad is not None:
        y, (rstd,) = _repair(x, weight, None, plan, _indices(bad), y, (rstd.reshape(plan.rows),))
    return y, rstd.reshape(plan.rows) if plan.return_stats else None


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    plan: Plan,
    out: Any = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``h = torch.add(x, residual)`` (into ``residual_out`` when given), then
    :func:`layer_norm` of ``h``: composed from torch operations, autograd kept; see
    :mod:`normlab.hookspecs`. Without ``plan.return_residual`` h is a temporary."""
    h = _add(x, residual, residual_out)
    y, mean, rstd = layer_norm(h, weight, bias, plan=plan)
    return y, h if plan.return_residual else None, mean, rstd


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    plan: Plan,
    out: Any = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``h = torch.add(x, residual)``, then :func:`rms_norm` of ``h``; ``(y, h, rstd)``."""
    h = _add(x, residual, residual_out)
    y, rstd = rms_norm(h, weight, plan=plan)
    return y, h if plan.return_residual else None, rstd


def _add(x: torch.Tensor, residual: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """``x + residual`` in x's dtype (torch's own add), into ``into`` when given (which may be
    the memory of x or residual: torch adds element by element)."""
    if into is None:
        return torch.add(x, residual)
    return torch.add(x, residual, out=into)


def _checked(x: torch.Tensor) -> bool:
    """Whether the rows check runs: on CPU tensors whose values can be read, outside
    ``torch.compile``/``torch.export`` tracing (whose graphs cannot branch on values): not a
    fake tensor or another subclass that dispatches itself, not under a ``torch.func``
    transform (``vmap`` forbids reading values)."""
    return (
        x.is_cpu
        and not torch.compiler.is_compiling()
        and (type(x) is torch.Tensor or not _dispatches(type(x)))
        and not torch._C._functorch.is_functorch_wrapped_tensor(x)
    )


@functools.lru_cache(maxsize=64)
def _dispatches(kind: type) -> bool:
    """Whether the tensor subclass ``kind`` overrides ``__torch_dispatch__`` (FakeTensor, a
    wrapper subclass): its values are not in memory to read."""
    return getattr(kind, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__


def _bad_rows(plan: Plan, rstd: torch.Tensor, centre: bool) -> torch.Tensor | None:
    """A boolean mask of the rows whose results torch got wrong (see the module docstring), or
    None when there is none. Rows-sized: one min/max reduction of ``rstd`` when all is well."""
    limit = _rstd_limit(plan.compute_dtype, plan.eps, centre)
    if _all_within(rstd, limit):
        return None
    return ((rstd > 0) & (rstd < limit)).logical_not().reshape(-1)


@functools.lru_cache(maxsize=64)
def _rstd_limit(compute_dtype: str, eps: float, centre: bool) -> float:
    """The largest ``rstd`` of a row torch got right (a larger one is recomputed)."""
    limit = math.inf
    eps_lost = compute_dtype == "float32" and eps < _FLOAT32_TINY
    if eps > 0 and (centre or eps_lost):
        limit = 0.5 / math.sqrt(eps)  # eps dominates the variance beyond this rstd
    tiny = _TINY[compute_dtype]
    if eps < tiny / MACHINE_EPS[compute_dtype]:  # squares may underflow unseen
        limit = min(limit, 1.0 / math.sqrt(tiny))  # a variance below the normal range
    return limit


def _all_within(rstd: torch.Tensor, limit: float) -> bool:
    """Whether every element of the rows-sized ``rstd`` (1-D, or 2-D of one column) lies in
    ``(0, limit)``; NaN does not. Up to :data:`FEW_ROWS` elements read as Python floats (a
    fifth of the cost of a torch reduction on one row), more by one min/max reduction."""
    if rstd.numel() <= FEW_ROWS and rstd.dim() <= 2:
        values = rstd.tolist()
        if rstd.dim() == 2:
            values = [v for row in values for v in row]
        return all(0 < v < limit for v in values)
    low, high = torch.aminmax(rstd)
    return bool(low.item() > 0 and high.item() < limit)  # NaN fails both


def _indices(mask: torch.Tensor) -> torch.Tensor:
    return mask.nonzero().reshape(-1)


def _repair(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    plan: Plan,
    bad: torch.Tensor,
    y: torch.Tensor,
    stats: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``y`` and ``stats`` (``(mean, rstd)``: LayerNorm; ``(rstd,)``: RMSNorm) with the rows
    ``bad`` (indices) recomputed by :func:`_wide_rows`; y out of place, so that autograd
    records the new rows."""
    centre = len(stats) == 2
    y_bad, mean_bad, rstd_bad = _wide_rows(x[bad], weight, bias, plan.eps, centre)
    y = y.index_put((bad,), y_bad.to(y.dtype))
    dtype = _TORCH_DTYPES[plan.stats_dtype]
    fixes = (mean_bad, rstd_bad) if centre else (rstd_bad,)
    patched = [
        s.to(dtype).index_put((bad,), fix.detach().to(dtype))
        for s, fix in zip(stats, fixes, strict=True)
    ]
    return y, patched


def _wide_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    centre: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` of a few rows in float64 torch operations (y 2-D; mean, rstd 1-D),
    with the shifted two-pass mean (centre) or none (RMSNorm). Each row is divided by a power
    of two ``s`` first (its largest magnitude / s in [1, 2)), so that no square overflows or
    underflows anywhere in float64's range: ``(x/s - mean/s) / sqrt(var/s^2 + eps/s^2)`` is
    the same ``y``. A NaN or Inf in a row makes that row NaN; so does a constant row with
    eps = 0 (0 / 0, as IEEE arithmetic and torch's own float64 kernel)."""
    x64 = x.to(torch.float64)
    with torch.no_grad():
        largest = x64.abs().amax(dim=1, keepdim=True)
        largest = torch.where(largest.isfinite(), largest, 0.0)
        _, exponent = torch.frexp(largest)
        k = torch.where(largest > 0, exponent - 1, 0).clamp(-_SCALE_LIMIT, _SCALE_LIMIT)
        s = torch.ldexp(torch.ones_like(largest), k)
        scaled_eps = eps / s / s
    xs = x64 / s
    mean = torch.zeros_like(s)
    if centre:
        x0 = xs[:, :1]
        mean = x0 + (xs - x0).mean(dim=1, keepdim=True)
    d = xs - mean
    square = (d * d).mean(dim=1, keepdim=True)
    with torch.no_grad():
        # eps alone counts where eps / s^2 overflows (eps dwarfs a tiny row's variance) or
        # underflows beside a zero variance (a constant row of huge values)
        finite_eps = scaled_eps.isfinite() & ~((square + scaled_eps == 0) & (eps > 0))
    rstd = torch.where(
        finite_eps,
        torch.rsqrt(square + torch.where(finite_eps, scaled_eps, 0.0)),
        s / math.sqrt(eps) if eps > 0 else s,
    )
    # with eps > 0, a row of exact zeros stays 0 (never 0 * inf = NaN)
    y = d * (rstd.clamp(max=torch.finfo(torch.float64).max) if eps > 0 else rstd)
    if weight is not None:
        y = y * weight.to(torch.float64)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y, (mean * s).reshape(-1), (rstd / s).reshape(-1)


def to_numpy(a: torch.Tensor) -> np.ndarray:
    """A NumPy copy of a tensor (bfloat16 via ml_dtypes)."""
    t = a.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        bits: np.ndarray = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        return bits
    values: np.ndarray = t.numpy().copy()
    return values


def from_numpy(a: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor copy of a NumPy array, on ``like``'s device (bfloat16 via ml_dtypes)."""
    a = np.array(a, copy=True, order="C")
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if like is None else t.to(like.device)


# --------------------------------------------------------------------------------------------
# Backward (see :mod:`normlab.hookspecs` for the contract), in torch operations: differentiable
# again, on CPU and CUDA. Column sums are bitwise repeatable: fixed chunks of ROW_CHUNK rows
# (each chunk's sum is one output of a torch reduction, computed by one thread), then a pairwise
# tree of elementwise float64 additions over the chunks; nothing depends on the thread count.
# On CPU this is the portable path, not the fast one (numba is): every operation allocates, a
# block of rows at a time (temporaries of ROW_BLOCK_ELEMENTS elements, not of the batch).


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))``, ``dweight = Σ dy * x̂``, ``dbias = Σ dy``
    with ``x̂ = (x - mean) * rstd``, ``g = dy * weight``; see :mod:`normlab.hookspecs`."""
    return _backward(dy, x, mean, rstd, weight, plan, needs)


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``dx = rstd * (g - x̂ * mean(g * x̂))``, ``dweight = Σ dy * x̂`` with ``x̂ = x * rstd``."""
    dx, dweight, _ = _backward(dy, x, None, rstd, weight, plan, needs - {"bias"})
    return dx, dweight


def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Both backward ops (``mean`` None: RMSNorm). On CPU the rows go through
    :func:`_backward_rows` a block at a time (see :func:`_row_blocks`), so that its full-size
    temporaries are block-sized; dx is written into one output, and the chunk sums of all
    blocks are added by :func:`_pairwise_sum`. Every row and every chunk of ROW_CHUNK rows is
    computed by the same torch operations as in one pass over the whole batch: the results are
    bitwise those of one pass. On CUDA the whole batch is one pass (torch's CUDA reductions
    choose their launch shape from the number of rows)."""
    compute = _TORCH_DTYPES[plan.compute_dtype]
    rows, cols = x.shape
    bounds = _row_blocks(rows, cols) if x.device.type == "cpu" else [0, rows]
    if len(bounds) == 2:
        dx, weight_sums, bias_sums = _backward_rows(dy, x, mean, rstd, weight, compute, needs)
    else:
        # the outputs are allocated before any block's temporaries: nothing long-lived lies
        # between those, which would keep the allocator from reusing their memory
        chunks = -(-rows // ROW_CHUNK)
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if "x" in needs else None
        weight_sums = x.new_empty((chunks, cols), dtype=compute) if "weight" in needs else None
        bias_sums = x.new_empty((chunks, cols), dtype=compute) if "bias" in needs else None
        for start, stop in itertools.pairwise(bounds):
            block = slice(start, stop)
            dx_rows, weight_rows, bias_rows = _backward_rows(
                dy[block],
                x[block],
                None if mean is None else mean[block],
                rstd[block],
                weight,
                compute,
                needs,
            )
            first, end = start // ROW_CHUNK, -(-stop // ROW_CHUNK)  # the block's chunks
            if dx is not None and dx_rows is not None:
                dx[block].copy_(dx_rows)
            if weight_sums is not None and weight_rows is not None:
                weight_sums[first:end].copy_(weight_rows)
            if bias_sums is not None and bias_rows is not None:
                bias_sums[first:end].copy_(bias_rows)
    dweight = None if weight_sums is None else _pairwise_sum(weight_sums)
    dbias = None if bias_sums is None else _pairwise_sum(bias_sums)
    return dx, dweight, dbias


def _row_blocks(rows: int, cols: int) -> list[int]:
    """The bounds of the blocks of rows of the CPU backward: one block up to
    ONE_BLOCK_ELEMENTS, else whole chunks of ROW_CHUNK rows, about ROW_BLOCK_ELEMENTS elements
    (at least one chunk). A last block of a single row joins
    the block before it: torch reduces a lone row with a thread-count-dependent split, which
    one pass over the whole batch would not do."""
    if rows * cols <= ONE_BLOCK_ELEMENTS:
        return [0, rows]
    per_block = max(ROW_CHUNK, ROW_BLOCK_ELEMENTS // max(cols, 1) // ROW_CHUNK * ROW_CHUNK)
    bounds = [*range(0, rows, per_block), rows]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return bounds


def _backward_rows(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    compute: torch.dtype,
    needs: frozenset[str],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dx (in x's dtype) and the :func:`_chunk_sums` of dweight's and dbias's terms (in the
    compute dtype) of some rows (the first a chunk's first), with ``d = x - mean`` and its
    residual ``res = mean(d)`` (the rounding of a float32 mean), so that ``x̂ = (d - res) * r``::

        mean(g * x̂) = r * (mean(g * d) - res * mean(g))
        dx = r * g + b * d + c     b = -r^2 * mean(g * x̂),  c = -b * res - r * mean(g)

    (RMSNorm: ``d = x``, ``res = 0``, no ``mean(g)``): two full-size passes for dx."""
    r = rstd.to(compute)[:, None]
    d = x.to(compute)
    res = None
    if mean is not None:
        d = d - mean.to(compute)[:, None]
        res = d.mean(dim=1, keepdim=True)
    dyc = dy.to(compute)
    dx = None
    if "x" in needs:
        g = dyc if weight is None else dyc * weight.to(compute)
        mean_gd = (g * d).mean(dim=1, keepdim=True)
        if res is None:
            b = -r * r * (r * mean_gd)
            dx = torch.addcmul(b * d, r, g)
        else:
            mean_g = g.mean(dim=1, keepdim=True)
            b = -r * r * (r * (mean_gd - res * mean_g))
            dx = torch.addcmul(torch.addcmul(-b * res - r * mean_g, b, d), r, g)
        dx = dx.to(x.dtype)
    weight_sums = bias_sums = None
    if "weight" in needs:
        xhat = d * r if res is None else torch.addcmul(-res * r, d, r)
        weight_sums = _chunk_sums(dyc * xhat)
    if "bias" in needs:
        bias_sums = _chunk_sums(dyc)
    return dx, weight_sums, bias_sums


def _chunk_sums(t: torch.Tensor) -> torch.Tensor:
    """The sums of the chunks of ROW_CHUNK rows of the 2-D ``t`` (a last chunk may be short),
    one row each, in ``t``'s dtype: each sum is one output of a torch reduction, computed by
    one thread."""
    rows, cols = t.shape
    whole = rows - rows % ROW_CHUNK
    parts = [t[:whole].reshape(-1, ROW_CHUNK, cols).sum(dim=1)]
    if whole < rows:
        parts.append(t[whole:].sum(dim=0, keepdim=True))
    return torch.cat(parts)


def _pairwise_sum(sums: torch.Tensor) -> torch.Tensor:
    """The sum of the rows of ``sums`` (the chunk sums), in its dtype: pairwise in float64 (the
    first half added to the second half, an odd middle row carried along, until one is left);
    zeros for no rows (an empty batch)."""
    if sums.shape[0] == 0:
        return sums.new_zeros(sums.shape[1:])
    total = sums.to(torch.float64)
    while total.shape[0] > 1:
        n, half = total.shape[0], total.shape[0] // 2
        head = total[:half] + total[n - half :]
        total = torch.cat((head, total[half : n - half])) if n % 2 else head
    return total[0].to(sums.dtype)
