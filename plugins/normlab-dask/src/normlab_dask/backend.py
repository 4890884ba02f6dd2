"""The Dask backend: a lazy graph in which normlab itself normalizes every chunk.

normlab's core hands this backend the caller's array as 2-D rows ``(plan.rows, plan.cols)``
(batch axes first, normalized axes flattened last: a lazy Dask transpose and reshape). Then:

1. when the columns are split across chunks they are rechunked into one, so each row is whole in
   one chunk; the row chunks are left as they are. ``weight`` and ``bias`` become one chunk each.
2. one task per row chunk calls :func:`normlab.layer_norm` (or :func:`normlab.rms_norm`) on that
   chunk where it runs: normlab's dispatch there picks numba or numpy for a NumPy chunk and cupy
   for a CuPy chunk, so every backend scales out through Dask, on any scheduler.
3. with ``return_stats`` that task returns ``(y, mean, rstd)`` and three cheap layers pick the
   parts: y, mean and rstd come from one graph, and ``dask.compute(y, mean, rstd)`` normalizes
   each chunk once.

Nothing is computed here. Results keep x's chunk type (``meta``). The per-chunk tasks are named
``normlab-<op>-<token>``; with ``return_stats`` the parts are ``normlab-<op>-y|mean|rstd-<token>``.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, TypeAlias

import array_api_compat
import dask.array as da
import normlab
import numpy as np
from dask.array.utils import meta_from_array

if TYPE_CHECKING:
    from normlab.hookspecs import Plan

__all__ = ["explain", "from_numpy", "layer_norm", "normalize_chunk", "rms_norm", "to_numpy"]

Result: TypeAlias = tuple[da.Array, da.Array | None, da.Array | None]


def layer_norm(
    x: da.Array,
    weight: da.Array | None,
    bias: da.Array | None,
    *,
    plan: Plan,
    out: None,
) -> Result:
    """Normalize each row of the 2-D ``x`` lazily; see :mod:`normlab.hookspecs` (``out`` is never
    passed: the record does not claim it)."""
    return _normalize(x, weight, bias, plan)


def rms_norm(x: da.Array, weight: da.Array | None, bias: None, *, plan: Plan, out: None) -> Result:
    """RMS-normalize each row of the 2-D ``x`` lazily: ``x / sqrt(mean(x^2) + eps) * weight``."""
    return _normalize(x, weight, None, plan)


def _normalize(x: da.Array, weight: da.Array | None, bias: da.Array | None, plan: Plan) -> Result:
    if x.numblocks[1] > 1:
        x = x.rechunk({1: -1})
    args: list[Any] = [x, "ij"]
    for p in (weight, bias):
        if p is not None:  # 1-D, one chunk (reshape: normlab's 2-D shortcut passes them as given)
            args += [p.reshape(plan.cols).rechunk(-1), "j"]
    config = {
        "op": plan.op,
        "has_weight": plan.has_weight,
        "has_bias": plan.has_bias,
        "eps": plan.eps,
        "return_stats": plan.return_stats,
    }
    name = f"normlab-{plan.op}"
    y_meta = meta_from_array(x, ndim=2)
    parts: da.Array = da.blockwise(normalize_chunk, "ij", *args, token=name, meta=y_meta, **config)
    if not plan.return_stats:
        return parts, None, None
    y = da.map_blocks(operator.getitem, parts, 0, token=f"{name}-y", meta=y_meta)
    stats_meta = meta_from_array(x, ndim=1, dtype=np.dtype(plan.stats_dtype))

    def stat(index: int, what: str) -> da.Array:
        picked: da.Array = da.blockwise(
            _stat, "i", parts, "ij", index, None, token=f"{name}-{what}", meta=stats_meta
        )
        return picked

    mean = stat(1, "mean") if plan.op == "layer_norm" else None
    return y, mean, stat(2, "rstd")


def normalize_chunk(
    x: Any,
    *params: Any,
    op: str,
    has_weight: bool,
    has_bias: bool,
    eps: float,
    return_stats: bool,
) -> Any:
    """One chunk of whole rows, normalized by normlab's dispatch wherever the task runs.

    ``params`` are the weight and bias chunks that are present, in that order. Returns ``y``,
    or ``(y, mean, rstd)`` with 1-D statistics (``mean`` None for rms_norm) when return_stats.
    """
    given = iter(params)
    weight = next(given) if has_weight else None
    bias = next(given) if has_bias else None
    if op == "layer_norm":
        result = normlab.layer_norm(x, weight=weight, bias=bias, eps=eps, return_stats=return_stats)
    else:
        result = normlab.rms_norm(x, weight=weight, eps=eps, return_stats=return_stats)
    if not return_stats:
        return result
    y, *stats = result
    flat = tuple(s.reshape(-1) for s in stats)
    return (y, *flat) if op == "layer_norm" else (y, None, *flat)


def _stat(blocks: list[tuple[Any, ...]], index: int) -> Any:
    """Part ``index`` of a row chunk's ``(y, mean, rstd)`` (``blocks``: its one column block)."""
    (parts,) = blocks
    return parts[index]


def _whole_batch_chunks(x: da.Array, plan: Plan) -> bool:
    """Whether x's batch chunks map onto row chunks as they are (else Dask's reshape to rows
    rechunks them): after the first batch axis longer than 1, every batch axis is one chunk."""
    longer = [a for a in plan.batch_axes if x.shape[a] > 1]
    return all(x.numblocks[a] == 1 for a in longer[1:])


def explain(x: da.Array, *, plan: Plan) -> str:
    """What this backend does with the caller's ``x`` (lines for :func:`normlab.explain`)."""
    lines = []
    split = math.prod(x.numblocks[a] for a in plan.axes)
    if split > 1:
        lines.append(
            f"dask: the normalized axes {plan.axes} are split into {split} chunks; they are "
            f"rechunked so that each row is whole in one chunk (chunks grow {split}x)"
        )
    else:
        lines.append(f"dask: the normalized axes {plan.axes} are whole in every chunk: no rechunk")
    if _whole_batch_chunks(x, plan):
        tasks = math.prod(x.numblocks[a] for a in plan.batch_axes)
        lines.append(f"dask: batch chunks kept as they are: {tasks} normlab task(s), one per chunk")
    else:
        lines.append(
            f"dask: the batch axes {plan.batch_axes} are chunked after their leading axis, so "
            "viewing them as rows makes Dask rechunk them; one normlab task per row chunk"
        )
    chunk_type = type(meta_from_array(x))
    lines.append(
        f"dask: each {chunk_type.__module__}.{chunk_type.__qualname__} chunk is normalized by "
        "normlab's dispatch where the task runs"
    )
    return "\n".join(lines)


def to_numpy(a: da.Array) -> np.ndarray:
    """Compute ``a`` with the scheduler in force and return the result as a NumPy array."""
    result = a.compute()
    if array_api_compat.is_cupy_array(result):
        result = result.get()
    return np.array(result)


def from_numpy(a: np.ndarray, like: da.Array | None = None) -> da.Array:
    """A Dask array holding a copy of ``a``, every axis split into two chunks (so rechunking is
    exercised), with ``like``'s chunk type (NumPy or CuPy) when given."""
    chunks = tuple(max(1, -(-n // 2)) for n in a.shape)
    result: da.Array = da.from_array(np.array(a, copy=True), chunks=chunks)
    meta = None if like is None else meta_from_array(like)
    if meta is not None and not isinstance(meta, np.ndarray):
        xp = array_api_compat.array_namespace(meta)
        result = da.map_blocks(xp.asarray, result, meta=meta_from_array(meta, a.ndim, a.dtype))
    return result
