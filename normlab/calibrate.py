"""``normlab calibrate``: measure each backend's cost model on this machine.

For every available backend, every family it serves (its own and its zero-copy families), every
op it provides (the fused ``add_*`` ops with a residual, h returned) and every dtype: time calls
on a few sizes of x, from one row to tens of MiB, fit ``time = fixed_us + x_bytes /
bytes_per_us`` by least squares and keep the timings themselves, which the estimates follow
(:class:`normlab.hookspecs.CostModel`). It also times what a small training call costs more
through normlab's torch custom ops (:func:`normlab.costs.through_graph_us`). The table goes to
the cache directory (:func:`normlab.costs.calibration_path`), where the dispatcher reads it
instead of the records' shipped models. Timings are medians of batches of calls, and the
backends that serve one point are timed in turn on the same x, so a busy moment shifts them
less and alike; calibrate on an idle machine all the same.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from normlab import costs, dispatch, registry
from normlab.constants import FLOAT_DTYPES
from normlab.errors import ArgumentError, NormlabError
from normlab.ops import OPS
from normlab.registry import Backend

__all__ = ["SIZES", "Measurement", "calibrate", "fit"]

#: Rows of float32 x measured (of :data:`COLS` columns; other dtypes take the rows of the same
#: bytes): one token to 48 MiB, densest where the rates change (numba's serial kernels up to
#: 2^15 elements, 42 rows, and its thread pool from there; caches; torch's fresh outputs
#: page-faulting from 32 MiB).
SIZES: Final = (1, 8, 32, 64, 512, 2048, 8192, 16384)
QUICK_SIZES: Final = (1, 64)
COLS: Final = 768
#: Seconds of calls per timed batch, and batches per size (the median is kept).
_BATCH_S: Final = 0.01
_BATCHES: Final = 5


@dataclass(frozen=True, slots=True)
class Measurement:
    backend: str
    op: str
    family: str
    dtype: str
    x_bytes: int
    us: float


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(fixed_us, bytes_per_us)`` of the line ``us = fixed + bytes / rate`` through
    ``(x_bytes, us)`` points, by least squares of the relative error (a 3 µs call counts as much
    as a 3 ms one); the fixed cost is at least 0, the rate positive."""
    weights = [1.0 / max(y, 1e-9) ** 2 for _, y in points]
    sw = sum(weights)
    mean_x = sum(w * x for w, (x, _) in zip(weights, points, strict=True)) / sw
    mean_y = sum(w * y for w, (_, y) in zip(weights, points, strict=True)) / sw
    spread = sum(w * (x - mean_x) ** 2 for w, (x, _) in zip(weights, points, strict=True))
    covariance = sum(
        w * (x - mean_x) * (y - mean_y) for w, (x, y) in zip(weights, points, strict=True)
    )
    slope = max(covariance / spread if spread else 0.0, 1e-9)  # µs per byte: never free
    fixed = max(mean_y - slope * mean_x, 0.0)
    return fixed, 1.0 / slope


def calibrate(
    backends: Sequence[str] | None = None,
    dtypes: Sequence[str] = FLOAT_DTYPES,
    quick: bool = False,
    path: Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[Path, list[Measurement]]:
    """Measure, fit, write the table (to ``path``, default the cache directory's) and make the
    dispatcher use it. Returns where it went and every measurement."""
    target = path or costs.calibration_path()
    if target is None:
        raise ArgumentError("no cache directory (no home directory): pass a path to write to")
    chosen = [registry.get(name) for name in backends] if backends else registry.list_backends()
    available = []
    for backend in chosen:
        if backend.available:
            available.append(backend)
        else:
            progress(f"{backend.name}: skipped, unavailable: {backend.reason}")
    measurements: list[Measurement] = []
    for m in _measure(available, dtypes, QUICK_SIZES if quick else SIZES, progress):
        measurements.append(m)
        progress(f"{m.backend} {m.op} {m.family} {m.dtype} {m.x_bytes} B: {m.us:.1f} µs")
    table = _table(measurements)
    through = _through_graph_us(available)
    if through is not None:
        progress(f"a training call through normlab's custom ops: {through:.1f} µs more")
        table["through_graph_us"] = round(through, 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tmp.replace(target)
    costs.reload()
    dispatch.clear_caches()
    return target, measurements


def _table(measurements: list[Measurement]) -> dict[str, Any]:
    grouped: dict[tuple[str, str, str], dict[str, list[tuple[float, float]]]] = {}
    for m in measurements:
        by_dtype = grouped.setdefault((m.backend, m.op, m.family), {})
        by_dtype.setdefault(m.dtype, []).append((float(m.x_bytes), m.us))
    backends: dict[str, dict[str, Any]] = {}
    for (name, op, family), by_dtype in grouped.items():
        fits = {dtype: fit(points) for dtype, points in by_dtype.items()}
        backends.setdefault(name, {})[f"{op}:{family}"] = {
            "fixed_us": round(statistics.median(f for f, _ in fits.values()), 3),
            "bytes_per_us": {dtype: round(rate, 1) for dtype, (_, rate) in fits.items()},
            "measured": {
                dtype: [[size, round(us, 3)] for size, us in sorted(points)]
                for dtype, points in by_dtype.items()
            },
        }
    return {"machine": _machine(), "backends": backends}


def _machine() -> str:
    import platform

    return (
        f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} CPUs"
    )


def _measure(
    backends: Sequence[Backend],
    dtypes: Sequence[str],
    sizes: Sequence[int],
    progress: Callable[[str], None],
) -> Iterator[Measurement]:
    """Every point (family, dtype, op, size) on every backend of ``backends`` that serves it.
    The backends of one point are timed on the same x, their batches interleaved, so that a
    busy moment or a clock that drifts weighs on all of them alike (the choice between two
    backends rests on their difference)."""
    import numpy as np

    from normlab.testing.conversions import numpy_dtype

    rng = np.random.default_rng(0)
    served = {b.name: b.families | b.zero_copy_families for b in backends}
    for family in sorted(set().union(*served.values())):
        converter = _converter(family)
        if converter is None:
            continue
        for dtype in sorted(set(dtypes)):
            able = [b for b in backends if family in served[b.name] and dtype in b.dtypes]
            if not able:
                continue
            try:  # a family may not hold every dtype its backend does (JAX without x64)
                converter(np.zeros((1, COLS), numpy_dtype(dtype)))
            except NormlabError as exc:
                for b in able:
                    progress(f"{b.name} on {family} {dtype}: skipped, {exc}")
                continue
            itemsize = np.dtype(numpy_dtype(dtype)).itemsize
            for op in sorted(set().union(*(b.ops for b in able))):
                timed = [b for b in able if op in b.ops]
                for float32_rows in sizes:
                    rows = max(1, float32_rows * 4 // itemsize)
                    x = rng.standard_normal((rows, COLS)).astype(numpy_dtype(dtype))
                    calls = [_call(op, converter, x, b.name) for b in timed]
                    nbytes = rows * COLS * itemsize
                    for b, us in zip(timed, _medians_us(calls), strict=True):
                        yield Measurement(b.name, op, family, dtype, nbytes, us)


def _through_graph_us(backends: Sequence[Backend]) -> float | None:
    """What a small training call (1×COLS float32 CPU tensors with weight and bias, forward
    and backward) costs more on the first of ``backends`` that serves tensors without recording
    a graph (the core runs it through normlab's custom ops) than on the first that records its
    own, beyond the difference of their forwards without grad; None without such a pair."""
    serving = [
        b
        for b in backends
        if "torch" in b.families | b.zero_copy_families
        and "float32" in b.dtypes
        and {"layer_norm", "layer_norm_backward"} <= b.ops
    ]
    graphless = next((b.name for b in serving if "autograd" not in b.capabilities), None)
    graphs = next((b.name for b in serving if "autograd" in b.capabilities), None)
    if graphless is None or graphs is None:
        return None
    import torch

    import normlab

    x, weight, bias = torch.randn(1, COLS), torch.ones(COLS), torch.zeros(COLS)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    dy = torch.ones(1, COLS)

    def step(name: str) -> Callable[[], Any]:
        def call() -> Any:
            y = normlab.layer_norm(leaves[0], weight=leaves[1], bias=leaves[2], backend=name)
            return torch.autograd.grad(y, leaves, dy)

        return call

    def forward(name: str) -> Callable[[], Any]:
        return lambda: normlab.layer_norm(x, weight=weight, bias=bias, backend=name)

    step_us, step_graphs_us, forward_us, forward_graphs_us = _medians_us(
        [step(graphless), step(graphs), forward(graphless), forward(graphs)]
    )
    return max(0.0, (step_us - forward_us) - (step_graphs_us - forward_graphs_us))


def _converter(family: str) -> Callable[[Any], Any] | None:
    """NumPy → ``family`` through the first available backend that serves it natively."""
    for b in registry.list_backends():
        if family in b.families and b.available:
            return b.from_numpy
    return None


def _call(op: str, convert: Callable[[Any], Any], x: Any, name: str) -> Callable[[], Any]:
    """A call of ``op`` as a model calls it: with a weight (and, for LayerNorm, a bias) of x's
    dtype, whose handling is part of the fixed cost. The fused ops add a residual like x and
    return h (the pre-norm form, which moves the most memory)."""
    import normlab

    xa = convert(x)
    weight = convert(x[0] * 0 + 1)
    arithmetic = OPS[op].arithmetic
    forward_op = op.removesuffix("_backward")
    params = {"weight": weight, "bias": weight} if arithmetic.centred else {"weight": weight}
    forward = getattr(normlab, forward_op)
    if arithmetic.residual_add:
        residual = convert(x[::-1])
        return lambda: forward(xa, residual, **params, backend=name)
    if op == forward_op:
        return lambda: forward(xa, **params, backend=name)
    _, *stats = forward(xa, **params, return_stats=True, backend=name)
    backward = getattr(normlab, op)
    return lambda: backward(xa, xa, *stats, weight, backend=name)


def _medians_us(calls: Sequence[Callable[[], Any]]) -> list[float]:
    """Each call's median µs over :data:`_BATCHES` batches of about :data:`_BATCH_S` seconds,
    the calls' batches taken in turn."""
    repeats = []
    for call in calls:
        call()  # compiles, allocates, fills caches
        start = time.perf_counter()
        call()
        repeats.append(max(1, int(_BATCH_S / max(time.perf_counter() - start, 1e-7))))
    batches: list[list[float]] = [[] for _ in calls]
    for _ in range(_BATCHES):
        for call, n, times in zip(calls, repeats, batches, strict=True):
            start = time.perf_counter()
            for _ in range(n):
                call()
            times.append((time.perf_counter() - start) / n)
    return [statistics.median(times) * 1e6 for times in batches]
