"""``normlab.warmup``: compile the numba kernels ahead of time (a Docker build step, a CI cache).

A first call of each dtype and layout compiles a numba specialization (1-2 s on an idle
machine, 10-20 s on a loaded one); numba caches it on disk, and later processes load it in
milliseconds. :func:`warmup` makes those first calls now, on small arrays, for the set

    dtypes x {contiguous, strided} x {serial, parallel} x {forward, backward, fused}
    dtypes x {contiguous} x {serial, parallel} x {quantized}

where *strided* is a row view of every other column, *parallel* an input of at least
:data:`~normlab.backends.numba_pool.SERIAL_ELEMENTS` elements (the kernels that run on
numba's threads; compiled only where numba has more than one thread), forward is
``layer_norm`` with weight and bias (``rms_norm`` runs the same kernels), backward
``layer_norm_backward`` with a weight (``rms_norm_backward`` runs the same kernels) and fused
the numba backend's ``add_layer_norm`` with weight and bias (``add_rms_norm`` runs the same
kernels), with h returned and without (two kernels), and quantized the numba backend's
quantizing kernels (``layer_norm`` and ``add_layer_norm`` with ``quantize="int8"`` and
``"fp8_e4m3"``, h returned and without; ``rms_norm`` and the static scales run the same
kernels; strided rows are composed from the forward's). Where torch is installed, the contiguous
forward and fused calls, serial and parallel, are also made on CPU tensors (the numba
backend's address entries, which contiguous tensors run; for half dtypes with float32
parameters and with parameters in x's dtype, which the entries widen themselves). Rows longer
than :data:`~normlab.backends.numba_forward.LONG_ROW_BYTES` and calls with ``out=`` use other
kernels and are not warmed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from normlab.backends import compile_notices as notices
from normlab.constants import FLOAT_DTYPES
from normlab.errors import ArgumentError, BackendError

__all__ = ["DIRECTIONS", "Warmed", "WarmupCall", "warmup", "warmup_calls"]

#: ``ops`` for :func:`warmup`: the forward, the backward, the fused residual-add and the
#: quantizing kernels.
DIRECTIONS: Final = ("forward", "backward", "fused", "quantized")
_COLS: Final = 64


@dataclass(frozen=True, slots=True)
class WarmupCall:
    """One call of the warm-up set: a dtype, a layout, serial or parallel, a direction."""

    dtype: str
    strided: bool
    parallel: bool
    direction: str

    @property
    def label(self) -> str:
        layout = "strided" if self.strided else "contiguous"
        threads = "parallel" if self.parallel else "serial"
        return f"{self.dtype} {layout} {threads} {self.direction}"


@dataclass(frozen=True, slots=True)
class Warmed:
    """What :func:`warmup` did: calls made, kernels compiled and loaded from the cache."""

    calls: int
    compiled: int
    loaded: int
    seconds: float
    cache_dir: str
    skipped: tuple[str, ...]


def warmup_calls(
    dtypes: Sequence[str] = FLOAT_DTYPES,
    ops: Sequence[str] = DIRECTIONS,
    parallel: bool = True,
) -> list[WarmupCall]:
    """The warm-up set for these dtypes and directions (``parallel=False``: serial only)."""
    for dtype in dtypes:
        if dtype not in FLOAT_DTYPES:
            raise ArgumentError(f"warmup: unknown dtype {dtype!r}; choose from {FLOAT_DTYPES}")
    for op in ops:
        if op not in DIRECTIONS:
            raise ArgumentError(f"warmup: unknown op {op!r}; choose from {DIRECTIONS}")
    return [
        WarmupCall(dtype, strided, threads, direction)
        for dtype in dtypes
        for strided in (False, True)
        for threads in ((False, True) if parallel else (False,))
        for direction in ops
        if not (strided and direction == "quantized")  # composed: the forward's kernels
    ]


def warmup(
    dtypes: Sequence[str] = FLOAT_DTYPES,
    ops: Sequence[str] = DIRECTIONS,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[Iterator[WarmupCall], int], Iterator[WarmupCall]] | None = None,
) -> Warmed:
    """Compile (or load from numba's cache) the numba kernels of the warm-up set.

    Args:
        dtypes: any of ``float16``, ``bfloat16`` (needs ``ml_dtypes``), ``float32``, ``float64``.
        ops: any of ``"forward"``, ``"backward"``, ``"fused"``, ``"quantized"``.
        cache_dir: numba's cache directory (``NUMBA_CACHE_DIR``); it must be given before the
            numba backend is first used in this process.
        progress: wraps the iterator of calls (the command line shows a progress bar with it).

    Returns:
        :class:`Warmed`: the calls made, the kernels compiled and loaded, the seconds taken.

    Raises:
        BackendError: numba is not installed. ArgumentError: an unknown dtype or op, or a
            ``cache_dir`` given after numba's cache was set up in this process.
    """
    _set_cache_dir(cache_dir)
    from normlab import registry

    numba_backend = next(b for b in registry.list_backends() if b.name == "numba")
    if not numba_backend.available:
        raise BackendError(f"warmup compiles numba kernels: {numba_backend.reason}")
    import numba

    from normlab.backends import (
        numba_addressed,
        numba_backward,
        numba_forward,
        numba_fused,
        numba_quantize,
    )

    skipped = []
    if "bfloat16" in dtypes and _bfloat16() is None:
        skipped.append("bfloat16 (ml_dtypes is not installed)")
        dtypes = [d for d in dtypes if d != "bfloat16"]
    calls = warmup_calls(dtypes, ops, parallel=numba.get_num_threads() > 1)
    if numba.get_num_threads() == 1:
        skipped.append("parallel kernels (numba has one thread here)")
    entries = _entry_points(
        numba_forward, numba_backward, numba_fused, numba_addressed, numba_quantize
    )
    before = _cache_counts(entries)
    start = time.perf_counter()
    with notices.compile_notices_silenced():
        for call in progress(iter(calls), len(calls)) if progress else calls:
            _run(call)
    hits, misses = (a - b for a, b in zip(_cache_counts(entries), before, strict=True))
    return Warmed(
        calls=len(calls),
        compiled=misses,
        loaded=hits,
        seconds=time.perf_counter() - start,
        cache_dir=_cache_dir_in_words(),
        skipped=tuple(skipped),
    )


def _set_cache_dir(cache_dir: str | os.PathLike[str] | None) -> None:
    if cache_dir is None:
        return
    wanted = os.path.abspath(os.fspath(cache_dir))
    if "normlab.backends.numba_forward" in sys.modules:
        if os.path.abspath(_numba_config().CACHE_DIR or "") != wanted:
            raise ArgumentError(
                f"warmup: cache_dir={wanted!r} comes too late: numba's kernels were loaded in "
                f"this process with cache {_numba_config().CACHE_DIR or '__pycache__'!r}; set "
                "NUMBA_CACHE_DIR before the first call, or run 'normlab warmup --cache-dir DIR'"
            )
        return
    try:
        os.makedirs(wanted, exist_ok=True)
    except OSError as exc:  # a regular file, /proc, a read-only place
        raise ArgumentError(
            f"warmup: cache_dir={wanted!r} cannot hold a cache: {exc.strerror or exc}"
        ) from None
    if not os.path.isdir(wanted) or not os.access(wanted, os.W_OK | os.X_OK):
        raise ArgumentError(f"warmup: cache_dir={wanted!r} is not a writable directory")
    os.environ["NUMBA_CACHE_DIR"] = wanted
    if "numba" in sys.modules:  # imported, but the kernels (and their caches) not yet
        _numba_config().CACHE_DIR = wanted


def _cache_dir_in_words() -> str:
    """Where the kernels were cached: the directory normlab's kernels use (``NUMBA_CACHE_DIR``,
    else ``$NORMLAB_CACHE_DIR/numba``, else ``~/.cache/normlab/numba``), or why none."""
    from normlab.backends.numba_cache import kernel_cache_root

    root = kernel_cache_root()
    return (
        "nowhere: no home directory (compiled in this process only)" if root is None else str(root)
    )


def _numba_config() -> Any:
    """numba's configuration module (its settings are not typed)."""
    from numba.core import config

    return config


def _entry_points(*modules: Any) -> list[Any]:
    """The numba dispatchers that Python calls (the kernels' entry points)."""
    names = (
        "layer_norm_rows",
        "layer_norm_rows_parallel",
        "add_norm_rows",
        "add_norm_rows_parallel",
        "layer_norm_rows_at",
        "layer_norm_rows_parallel_at",
        "add_norm_rows_at",
        "add_norm_rows_parallel_at",
        "backward_chunks",
        "backward_chunks_parallel",
        "sum_chunks",
        "norm_quantize_rows",
        "norm_quantize_rows_parallel",
        "add_norm_quantize_rows",
        "add_norm_quantize_rows_parallel",
    )
    return [getattr(m, n) for m in modules for n in names if hasattr(m, n)]


def _cache_counts(dispatchers: list[Any]) -> tuple[int, int]:
    hits = sum(sum(d.stats.cache_hits.values()) for d in dispatchers)
    misses = sum(sum(d.stats.cache_misses.values()) for d in dispatchers)
    return hits, misses


def _bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


def _run(call: WarmupCall) -> None:
    """One call of the set, on small arrays, through the public API and the numba backend."""
    import numpy as np  # here, not at import: ``import normlab`` imports no array library

    from normlab import api
    from normlab.backends.numba_pool import SERIAL_ELEMENTS

    dtype = _bfloat16() if call.dtype == "bfloat16" else np.dtype(call.dtype)
    cols_stride = 2 if call.strided else 1
    rows = 4 * SERIAL_ELEMENTS // _COLS if call.parallel else 4  # parallel in every dtype
    base = np.linspace(-1.0, 1.0, rows * _COLS * cols_stride).reshape(rows, _COLS * cols_stride)
    x = base.astype(dtype)[:, ::cols_stride]
    param = np.float32 if call.dtype in ("float16", "bfloat16") else dtype
    weight, bias = np.ones(_COLS, param), np.zeros(_COLS, param)
    residual = base[::-1].astype(dtype)[:, ::cols_stride]
    if call.direction == "quantized":
        _run_quantized(x, residual, weight, bias)
        return
    if call.direction == "fused":
        _run_fused(x, residual, weight, bias)
    else:
        y, mean, rstd = api.layer_norm(
            x, weight=weight, bias=bias, return_stats=True, backend="numba"
        )
        if call.direction == "backward":
            api.layer_norm_backward(y, x, mean, rstd, weight, backend="numba")
    if call.direction != "backward" and not call.strided:
        _run_tensors(x, weight, bias, call.direction == "fused")


def _run_tensors(x: Any, weight: Any, bias: Any, fused: bool) -> None:
    """Where torch is installed: the same call on CPU tensors, which small contiguous inputs
    run through the numba backend's address entries (:mod:`normlab.backends.numba_addressed`)."""
    import numpy as np

    from normlab import api

    try:
        import torch
    except ImportError:
        return
    if x.dtype.itemsize == 2 and x.dtype != np.float16:  # bfloat16: its bits, viewed
        t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(x)
    w, b = torch.from_numpy(weight), torch.from_numpy(bias)
    params = [(w, b)]
    if t.dtype != w.dtype:  # half x: parameters stored in x's dtype too (another entry)
        params.append((w.to(t.dtype), b.to(t.dtype)))
    for w, b in params:
        if not fused:
            api.layer_norm(t, weight=w, bias=b, backend="numba")
            continue
        for keep_h in (True, False):
            api.add_layer_norm(t, t, weight=w, bias=b, return_residual=keep_h, backend="numba")


def _run_fused(x: Any, residual: Any, weight: Any, bias: Any) -> None:
    """The numba backend's ``add_layer_norm`` of ``x`` and ``residual``, with h returned and
    without (the post-norm form): its two kernels for this dtype and layout."""
    import dataclasses

    from normlab import spec
    from normlab.backends import numba_backend

    base = spec.plan("layer_norm", x, weight=weight, bias=bias, return_stats=True)
    for keep_h in (True, False):
        plan = dataclasses.replace(base, op="add_layer_norm", return_residual=keep_h)
        numba_backend.add_layer_norm(
            x, residual, weight, bias, plan=plan, out=None, residual_out=None
        )


def _run_quantized(x: Any, residual: Any, weight: Any, bias: Any) -> None:
    """The numba backend's quantizing kernels for ``x``'s dtype and size: ``layer_norm`` and
    ``add_layer_norm`` (h returned and not) in each mode (q of another dtype is another
    specialization); fp8 where NumPy has a float8 dtype (ml_dtypes)."""
    import importlib.util

    from normlab import api

    modes = ("int8", "fp8_e4m3") if importlib.util.find_spec("ml_dtypes") else ("int8",)
    for mode in modes:
        api.layer_norm(x, weight=weight, bias=bias, quantize=mode, backend="numba")
        for keep_h in (True, False):
            api.add_layer_norm(
                x, residual, weight=weight, bias=bias, return_residual=keep_h, quantize=mode,
                backend="numba",
            )  # fmt: skip
