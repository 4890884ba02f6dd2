"""The GPU check of the cupy backend, one stage per call (``benchmarks/gpu_check.sh`` runs all):

    python benchmarks/gpu_check.py correctness --out DIR   every kernel, both families, bitwise rows
    python benchmarks/gpu_check.py large --out DIR         65537 rows, 2^31+ elements, long rows
    python benchmarks/gpu_check.py backward --out DIR      gradients against torch autograd
    python benchmarks/gpu_check.py bench --out DIR         GB/s against torch and a copy

Every stage covers both ops, layer_norm and rms_norm (against ``torch.nn.functional.layer_norm``
and ``torch.nn.functional.rms_norm`` in the benchmark, forward and backward).

Each stage writes ``DIR/<stage>.md``. ``correctness``, ``large`` and ``backward`` exit 1 when a
case fails; ``bench`` measures and never fails on speed (it marks the targets met or missed).

``--dry-run`` needs no GPU: NumPy arrays through the numpy backend and CPU torch tensors through
the torch backend stand in for CuPy arrays and CUDA tensors, with small shapes, so that the logic
of every stage (cases, references, comparisons, tables) runs anywhere.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

ROOT: Final = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import normlab  # noqa: E402
from normlab import reference  # noqa: E402
from normlab.backends import cuda_launch  # noqa: E402
from normlab.testing.tolerances import (  # noqa: E402
    TOLERANCES,
    assert_close,
    conditioning,
    y_scale,
)

OPS: Final = ("layer_norm", "rms_norm")
DTYPES: Final = ("float16", "bfloat16", "float32", "float64")
EPS: Final = 1e-5
AWKWARD_COLS: Final = (1, 3, 17, 127, 1000, 4097, 65536, 262144)
BENCH_HIDDEN: Final = (256, 512, 1024, 2048, 4096, 8192, 16384)
BENCH_ROWS: Final = (4096, 16384)
BENCH_DTYPES: Final = ("float32", "bfloat16", "float16")
#: Row lengths of the backward check: rungs of backward_rows, the loop kernel (beyond 8192).
BACKWARD_COLS: Final = (1, 17, 127, 1000, 4096, 8192, 8200, 16384)
BACKWARD_DTYPES: Final = ("float32", "bfloat16", "float16")
#: Error (max |error| / the gradient's scale, see _grad_scales) a gradient may always have, per
#: dtype; it may also have twice torch's own at the same precision.
GRAD_FLOOR: Final = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}
#: (rows, hidden) where the targets apply: >= 85% of a copy's GB/s, >= 1.2x torch.
TARGETS: Final = {(4096, 4096), (16384, 4096)}
COPY_TARGET: Final = 0.85
TORCH_TARGET: Final = 1.2
#: Bytes written between timed calls so that x is not in L2 (a few times any current L2).
FLUSH_BYTES: Final = 1 << 30


# --------------------------------------------------------------------------------------------
# Where arrays live: the GPU, or (dry run) the CPU


@dataclass
class Device:
    """Array families, backends and timing on the GPU, or their CPU stand-ins in a dry run."""

    dry: bool
    families: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.families = ("numpy", "torch") if self.dry else ("cupy", "torch")

    def backend(self, family: str) -> str:
        if not self.dry:
            return "cupy"
        return "numpy" if family == "numpy" else "torch"

    def array(self, a: np.ndarray, family: str) -> Any:
        """A copy of ``a`` in ``family`` on this device."""
        if family == "torch":
            from normlab.backends.torch_backend import from_numpy

            t = from_numpy(a)
            return t if self.dry else t.cuda()
        if family == "cupy":
            from normlab.backends.cupy_backend import from_numpy as cupy_from_numpy

            return cupy_from_numpy(a)
        return np.array(a, copy=True)

    def torch_device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def synchronize(self) -> None:
        if not self.dry:
            import torch

            torch.cuda.synchronize()

    def median_seconds(self, call: Callable[[], Any], repeats: int) -> float:
        """Median time of ``call``: CUDA events with L2 flushed before each call on the GPU,
        wall time on the CPU. The flush (a memset of FLUSH_BYTES) also hides the host's launch
        overhead: the kernel is queued before the flush ends."""
        call()
        if self.dry:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        import torch

        scratch = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        torch.cuda.synchronize()
        for start, end in events:
            scratch.zero_()
            start.record()
            call()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy copy of a NumPy, CuPy or torch array (bfloat16 via ml_dtypes)."""
    module = type(a).__module__
    if module.startswith("torch"):
        from normlab.backends.torch_backend import to_numpy as torch_to_numpy

        return torch_to_numpy(a)
    if module.startswith("cupy"):
        import cupy

        return np.asarray(cupy.asnumpy(a))
    return np.array(a, copy=True)


def numpy_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class Outcome:
    """One checked case: what it was, whether it passed, and why not."""

    stage: str
    case: str
    passed: bool | None  # None: skipped
    detail: str = ""


@dataclass
class Report:
    stage: str
    outcomes: list[Outcome] = field(default_factory=list)

    def run(self, case: str, check: Callable[[], str | None]) -> None:
        """Run ``check`` (returns a detail line or None); an exception is a failure, a
        :class:`Skip` a skip."""
        try:
            detail = check() or ""
            self.outcomes.append(Outcome(self.stage, case, True, detail))
        except Skip as skip:
            self.outcomes.append(Outcome(self.stage, case, None, str(skip)))
        except Exception as error:  # a failing case is reported, and the stage goes on
            lines = traceback.format_exception_only(type(error), error)
            self.outcomes.append(Outcome(self.stage, case, False, "".join(lines).strip()))

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.passed is False]

    def markdown(self, title: str, notes: list[str]) -> str:
        passed = sum(o.passed is True for o in self.outcomes)
        skipped = [o for o in self.outcomes if o.passed is None]
        lines = [f"## {title}", "", *notes, ""]
        lines.append(
            f"{passed} passed, {len(self.failed)} failed, {len(skipped)} skipped "
            f"of {len(self.outcomes)} cases."
        )
        for heading, group in (("Failures", self.failed), ("Skipped", skipped)):
            if group:
                lines += ["", f"### {heading}", "", "| case | detail |", "|---|---|"]
                lines += [f"| `{o.case}` | {_cell(o.detail)} |" for o in group[:200]]
        details = [o for o in self.outcomes if o.passed and o.detail]
        if details:
            lines += ["", "| case | result |", "|---|---|"]
            lines += [f"| `{o.case}` | {_cell(o.detail)} |" for o in details]
        return "\n".join(lines) + "\n"


class Skip(Exception):
    """A case that cannot run here (say, CuPy without bfloat16)."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


# --------------------------------------------------------------------------------------------
# Stage 1: correctness


def _rows(rows: int, cols: int, dtype: str, seed: int) -> np.ndarray:
    """Rows of different kinds: normal, 100 + 0.01 normal, constant, scaled, shifted."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols))
    x[1 % rows] = 100 + 0.01 * rng.standard_normal(cols)
    x[2 % rows] = 3.25
    for r in range(3, rows):
        x[r] = x[r] * 10.0 ** (r % 5 - 2) + (r - 5)
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
    return x.astype(numpy_dtype(dtype))


def _parameters(
    cols: int, dtype: str, param: str | None, seed: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    if param is None:
        return None, None
    rng = np.random.default_rng(seed + 1)
    w = (1 + 0.5 * rng.standard_normal(cols)).astype(numpy_dtype(param))
    b = (0.5 * rng.standard_normal(cols)).astype(numpy_dtype(param))
    return w, b


def _call(op: str, x: Any, w: Any, b: Any, backend: str, **kwargs: Any) -> Any:
    """``normlab.layer_norm`` or ``normlab.rms_norm`` (which takes no bias) with eps EPS."""
    if op == "rms_norm":
        return normlab.rms_norm(x, weight=w, eps=EPS, backend=backend, **kwargs)
    return normlab.layer_norm(x, weight=w, bias=b, eps=EPS, backend=backend, **kwargs)


def _compare(
    op: str,
    got: tuple[Any, ...],
    x: np.ndarray,
    w: np.ndarray | None,
    b: np.ndarray | None,
    dtype: str,
) -> None:
    """Assert y and the statistics (``(y, mean, rstd)``, or ``(y, rstd)`` for rms_norm) are
    within the suite's tolerances of the float64 reference."""
    cols = x.shape[-1]
    if op == "rms_norm":
        y, rstd = (to_numpy(a) for a in got)
        want_y, want_rstd = reference.rms_norm(x, weight=w, eps=EPS)
        want_mean = mean = None
    else:
        y, mean, rstd = (to_numpy(a) for a in got)
        want_y, want_mean, want_rstd = reference.layer_norm(x, weight=w, bias=b, eps=EPS)
    cond = conditioning(want_mean, want_rstd)
    centred = reference.to_float64(x) - (0.0 if want_mean is None else want_mean)
    scale = y_scale(op, centred * want_rstd, w, b)
    assert_close(y, want_y, dtype, cond, what="y", cols=cols, scale=scale)
    if want_mean is not None:
        assert_close(mean, want_mean, dtype, cond, what="mean", cols=cols, scale=1 / want_rstd)
    assert_close(rstd, want_rstd, dtype, cond, what="rstd", cols=cols, scale=want_rstd)


def _every_kernel_cols() -> list[tuple[str, str, str, int]]:
    """(op, dtype, parameter dtype, cols) that reach every specialisation: each rung full
    (16-byte accesses) and one short of full (element accesses), and rows for the loop kernel."""
    cases = []
    for spec in cuda_launch.all_specialisations():
        if not spec.vector or spec.op not in OPS or spec.stage != "rows":
            continue  # the backward kernels: stage "backward"
        width = cuda_launch.vector_width(spec.dtype)
        top = max(s.capacity or 0 for s in cuda_launch.program_of(spec))
        full = spec.capacity if spec.capacity is not None else 4 * top + 8 * width
        kernel = (spec.op, spec.dtype, spec.param_dtype)
        cases += [(*kernel, full), (*kernel, full - 1)]
    return cases


def correctness(dev: Device) -> Report:
    report = Report("correctness")
    cases = _every_kernel_cols()
    if dev.dry:
        cases = [c for c in cases if c[3] <= 300]
    for family in dev.families:
        backend = dev.backend(family)
        for op, dtype, param, cols in cases:
            name = f"{family} {op} {dtype} weights {param} cols={cols}"
            report.run(
                name,
                lambda o=op, f=family, d=dtype, p=param, c=cols, b=backend: _check_call(
                    dev, o, f, b, d, p, c
                ),
            )
        for op in OPS:
            for dtype in DTYPES:
                _correctness_of(report, dev, op, family, backend, dtype)
    return report


def _correctness_of(
    report: Report, dev: Device, op: str, family: str, backend: str, dtype: str
) -> None:
    """The checks beyond every kernel's results, for one op, family and dtype."""
    for cols in (17, 1000, 4096):
        report.run(
            f"{family} {op} {dtype} cols={cols} rows bitwise alone/aligned/unaligned",
            lambda c=cols: _check_bitwise(dev, op, family, backend, dtype, c),
        )
    report.run(
        f"{family} {op} {dtype} layouts, out=, in place",
        lambda: _check_layouts(dev, op, family, backend, dtype),
    )
    report.run(
        f"{family} {op} {dtype} NaN stays in its row",
        lambda: _check_nan(dev, op, family, backend, dtype),
    )
    if op == "layer_norm" and dtype in ("float16", "bfloat16"):
        report.run(
            f"{family} {op} {dtype} weight {dtype}, bias float32",
            lambda: _check_mixed(dev, family, backend, dtype),
        )


def _inputs(dev: Device, family: str, dtype: str, x: np.ndarray, *params: Any) -> list[Any]:
    try:
        return [None if a is None else dev.array(a, family) for a in (x, *params)]
    except Exception as error:  # CuPy without ml_dtypes bfloat16, say
        raise Skip(f"{family} cannot hold {dtype} arrays: {error}") from error


def _check_call(
    dev: Device, op: str, family: str, backend: str, dtype: str, param: str, cols: int
) -> None:
    x = _rows(5, cols, dtype, seed=cols)
    w, b = _parameters(cols, dtype, param, seed=cols)
    b = None if op == "rms_norm" else b
    xd, wd, bd = _inputs(dev, family, dtype, x, w, b)
    _compare(op, _call(op, xd, wd, bd, backend, return_stats=True), x, w, b, dtype)


def _check_bitwise(dev: Device, op: str, family: str, backend: str, dtype: str, cols: int) -> str:
    """Each row's y is bitwise the same in the batch (16-byte accesses where cols allows), alone,
    and alone one element past an aligned address (element accesses)."""
    if dev.dry:
        raise Skip("a property of the CUDA kernels; the CPU stand-ins are not held to it here")
    x = _rows(9, cols, dtype, seed=7)
    (xd,) = _inputs(dev, family, dtype, x)
    batch = to_numpy(_call(op, xd, None, None, backend))
    shifted = np.zeros(cols + 1, dtype=x.dtype)
    for r in range(x.shape[0]):
        (alone,) = _inputs(dev, family, dtype, x[r : r + 1])
        shifted[1:] = x[r]
        (buffer,) = _inputs(dev, family, dtype, shifted)
        unaligned = buffer[1:].reshape(1, cols)
        for what, xr in (("alone", alone), ("unaligned", unaligned)):
            yr = to_numpy(_call(op, xr, None, None, backend))
            if yr.tobytes() != batch[r : r + 1].tobytes():
                raise AssertionError(f"row {r} {what} differs bitwise from the batch")
    return ""


def _check_layouts(dev: Device, op: str, family: str, backend: str, dtype: str) -> None:
    cols, rows = 1000, 6
    x = _rows(rows, cols, dtype, seed=3)
    w, b = _parameters(cols, dtype, dtype, seed=3)
    b = None if op == "rms_norm" else b
    width = cuda_launch.vector_width(dtype)
    wide = np.zeros((2 * rows, cols + width), dtype=x.dtype)
    wide[::2, :cols] = x
    xw, wd, bd = _inputs(dev, family, dtype, wide, w, b)
    views = {"padded rows": xw[::2, :cols], "odd row stride": xw[::2, 1 : cols + 1]}
    expected = {"padded rows": x, "odd row stride": wide[::2, 1 : cols + 1]}
    if family != "torch":  # torch has no negative strides
        views["reversed rows"] = xw[::-2, :cols]
        expected["reversed rows"] = wide[::-2, :cols]
    for what, view in views.items():
        got = _call(op, view, wd, bd, backend, return_stats=True)
        try:
            _compare(op, got, expected[what], w, b, dtype)
        except AssertionError as error:
            raise AssertionError(f"{what}: {error}") from None
    (xd,) = _inputs(dev, family, dtype, x)
    plain = to_numpy(_call(op, xd, wd, bd, backend))
    out = dev.array(np.zeros_like(x), family)
    y = _call(op, xd, wd, bd, backend, out=out)
    assert y is out, "out= did not return out"
    assert to_numpy(out).tobytes() == plain.tobytes(), "out= differs from a plain call"
    _call(op, xd, wd, bd, backend, out=xd)
    assert to_numpy(xd).tobytes() == plain.tobytes(), "in place differs from a plain call"


def _check_nan(dev: Device, op: str, family: str, backend: str, dtype: str) -> None:
    x = _rows(5, 300, dtype, seed=5)
    x[3, 17] = np.nan
    (xd,) = _inputs(dev, family, dtype, x)
    y = to_numpy(_call(op, xd, None, None, backend)).astype(np.float64)
    assert np.isnan(y[3]).all(), "the NaN row is not all NaN"
    assert np.isfinite(np.delete(y, 3, axis=0)).all(), "a NaN left its row"


def _check_mixed(dev: Device, family: str, backend: str, dtype: str) -> None:
    cols = 4096
    x = _rows(4, cols, dtype, seed=11)
    w, _ = _parameters(cols, dtype, dtype, seed=11)
    _, b = _parameters(cols, dtype, "float32", seed=11)
    xd, wd, bd = _inputs(dev, family, dtype, x, w, b)
    got = normlab.layer_norm(xd, weight=wd, bias=bd, eps=EPS, return_stats=True, backend=backend)
    _compare("layer_norm", got, x, w, b, dtype)


# --------------------------------------------------------------------------------------------
# Stage 2: large cases, against a float64 reference computed on the device in chunks


def large(dev: Device) -> Report:
    report = Report("large")
    cases: list[tuple[int, int, str]] = [(65537, 256, "float32")]
    if dev.dry:
        cases += [(3, 1000, "float16"), (2, 4097, "bfloat16")]
    else:
        cases.append(((1 << 31) // 4096 + 1, 4096, "float16"))  # 2^31 + 4096 elements
    for cols in AWKWARD_COLS:
        for dtype in DTYPES:
            rows = max(1, min(4096, (1 << 22) // cols))
            if not dev.dry or cols <= 4097:
                cases.append((rows if not dev.dry else min(rows, 8), cols, dtype))
    for rows, cols, dtype in cases:
        for op in OPS:
            report.run(
                f"{op} {rows} x {cols} {dtype} (torch tensors)",
                lambda o=op, r=rows, c=cols, d=dtype: _check_large(dev, o, r, c, d),
            )
    return report


def _chunks(rows: int, cols: int) -> Iterator[slice]:
    step = max(1, (1 << 26) // cols)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _check_large(dev: Device, op: str, rows: int, cols: int, dtype: str) -> str:
    """y and the statistics of ``op`` against a float64 reference on the device, chunk by chunk,
    with the tolerance formula of :mod:`normlab.testing.tolerances` (sums growing like
    log2(cols) roundoffs: the kernels' are trees); returns the worst error / allowed."""
    import torch

    torch_dtype = getattr(torch, dtype)
    param = "float32" if dtype in ("float16", "bfloat16") else dtype
    generator = torch.Generator(device=dev.torch_device()).manual_seed(rows * 31 + cols)
    x = torch.randn(
        (rows, cols), generator=generator, device=dev.torch_device(), dtype=torch.float32
    ).to(torch_dtype)
    x[::7] += 100  # large offsets in every seventh row
    w = 1 + 0.5 * torch.randn(cols, generator=generator, device=x.device).to(getattr(torch, param))
    b = 0.5 * torch.randn(cols, generator=generator, device=x.device).to(getattr(torch, param))
    rms = op == "rms_norm"
    if rms:
        mean = None
        y, rstd = normlab.rms_norm(
            x, weight=w, eps=EPS, return_stats=True, backend=dev.backend("torch")
        )
    else:
        y, mean, rstd = normlab.layer_norm(
            x, weight=w, bias=b, eps=EPS, return_stats=True, backend=dev.backend("torch")
        )
    dev.synchronize()
    tol, stats_tol = TOLERANCES[dtype], TOLERANCES["float64" if dtype == "float64" else "float32"]
    growth = math.log2(cols)
    w64, b64 = w.double(), b.double()
    worst = {"y": 0.0, "rstd": 0.0} if rms else {"y": 0.0, "mean": 0.0, "rstd": 0.0}
    for part in _chunks(rows, cols):
        xd = x[part].double()
        if rms:  # conditioning 1, no bias, errors relative to |y| (see the tolerances module)
            ref_rstd = torch.rsqrt((xd * xd).mean(dim=1, keepdim=True) + EPS)
            z = xd * ref_rstd
            ref_y = z * w64
            compute = tol.compute * (1 + growth)
            scale = w64.abs() * z.abs()
        else:
            x0 = xd[:, :1]
            ref_mean = x0 + (xd - x0).mean(dim=1, keepdim=True)
            centred = xd - ref_mean
            ref_rstd = torch.rsqrt((centred * centred).mean(dim=1, keepdim=True) + EPS)
            z = centred * ref_rstd
            ref_y = z * w64 + b64
            compute = tol.compute * (1 + ref_mean.abs() * ref_rstd + growth)
            scale = w64.abs() * (1 + z.abs()) + b64.abs()
        allowed_y = compute * scale + tol.rounding * ref_y.abs() + tol.floor
        ratios = {
            "y": (y[part].double() - ref_y).abs() / allowed_y,
            "rstd": (rstd[part].double() - ref_rstd).abs()
            / (compute * ref_rstd + stats_tol.rounding * ref_rstd + stats_tol.floor),
        }
        if mean is not None:
            ratios["mean"] = (mean[part].double() - ref_mean).abs() / (
                compute / ref_rstd + stats_tol.rounding * ref_mean.abs() + stats_tol.floor
            )
        for what, ratio in ratios.items():
            if not bool(torch.isfinite(ratio).all()):
                raise AssertionError(f"{what}: non-finite values in rows {part.start}..")
            worst[what] = max(worst[what], float(ratio.max()))
    if max(worst.values()) > 1:
        raise AssertionError(f"error / allowed: {worst}")
    return ", ".join(f"{k} {v:.2g}" for k, v in worst.items()) + " of the allowed error"


# --------------------------------------------------------------------------------------------
# Stage 3: the backward, against torch autograd (float64 as the exact answer)


def backward(dev: Device) -> Report:
    report = Report("backward")
    cols_list = BACKWARD_COLS if not dev.dry else (1, 17, 300)
    for op in OPS:
        for dtype in BACKWARD_DTYPES:
            for cols in cols_list:
                report.run(
                    f"{op} {dtype} 70 x {cols} through autograd vs torch",
                    lambda o=op, d=dtype, c=cols: _check_autograd(dev, o, d, 70, c),
                )
            report.run(
                f"{op} {dtype} bitwise: repeated, rows alone, CuPy arrays",
                lambda o=op, d=dtype: _check_backward_bitwise(dev, o, d),
            )
        report.run(
            f"{op} float32 4097 rows x 1024, each subset of the gradients",
            lambda o=op: _check_needs(dev, o),
        )
    return report


def _grad_inputs(dev: Device, dtype: str, rows: int, cols: int, seed: int) -> list[Any]:
    """x (one row at 100 + 0.01 randn), dy, weight and bias as tensors of ``dtype``."""
    import torch

    generator = torch.Generator(device=dev.torch_device()).manual_seed(seed)

    def randn(*shape: int) -> Any:
        return torch.randn(shape, generator=generator, device=dev.torch_device())

    x = randn(rows, cols) * 2 + 3
    x[1 % rows] = 100 + 0.01 * randn(cols)
    tensors = [x, randn(rows, cols), 1 + 0.5 * randn(cols), 0.5 * randn(cols)]
    return [t.to(getattr(torch, dtype)) for t in tensors]


def _grads_by_torch(op: str, tensors: list[Any], dtype: Any) -> dict[str, Any]:
    """torch.autograd's gradients of torch's op, computed in ``dtype``."""
    import torch

    x, dy, w, b = (t.to(dtype, copy=True) for t in tensors)  # never the caller's tensors
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    cols = x.shape[-1]
    if op == "rms_norm":
        y = torch.nn.functional.rms_norm(x, (cols,), w, EPS)
    else:
        y = torch.nn.functional.layer_norm(x, (cols,), w, b, EPS)
    y.backward(dy)
    grads = {"x": x.grad, "weight": w.grad}
    return grads if op == "rms_norm" else {**grads, "bias": b.grad}


def _grad_scales(op: str, tensors: list[Any]) -> dict[str, Any]:
    """The size each gradient's error is measured against (its terms' magnitudes, in float64):
    ``rstd |dy w|`` for dx, ``sum |dy| (1 + |x^|)`` for dweight, ``sum |dy|`` for dbias. A
    gradient that is 0 exactly (dx of rows of one element) still has a scale."""
    import torch

    x, dy, w, _ = (t.double() for t in tensors)
    centred = x if op == "rms_norm" else x - x.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((centred * centred).mean(dim=-1, keepdim=True) + EPS)
    return {
        "x": (rstd * (dy * w).abs()).max(),
        "weight": (dy.abs() * (1 + (centred * rstd).abs())).sum(dim=0).max(),
        "bias": dy.abs().sum(dim=0).max(),
    }


def _normwise(got: Any, exact: Any, scale: Any) -> float:
    """max |got - exact| / scale."""
    return float((got.double() - exact).abs().max() / scale.clamp_min(1e-300))


def _check_autograd(dev: Device, op: str, dtype: str, rows: int, cols: int) -> str:
    """normlab's op on tensors that require grad (backend cupy: the custom ops and the backward
    kernels), against torch autograd in float64; the error may reach GRAD_FLOOR or twice
    torch's own at ``dtype``."""
    import torch

    tensors = _grad_inputs(dev, dtype, rows, cols, seed=rows * 131 + cols)
    x, dy, w, b = (t.clone() for t in tensors)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    backend = dev.backend("torch")
    if op == "rms_norm":
        y = normlab.rms_norm(x, weight=w, eps=EPS, backend=backend)
    else:
        y = normlab.layer_norm(x, weight=w, bias=b, eps=EPS, backend=backend)
    y.backward(dy)
    got = {"x": x.grad, "weight": w.grad, "bias": b.grad}
    exact = _grads_by_torch(op, tensors, torch.float64)
    same = _grads_by_torch(op, tensors, getattr(torch, dtype))
    scales = _grad_scales(op, tensors)
    details, failures = [], []
    for name, want in exact.items():
        g = got[name]
        if g is None or g.dtype != tensors[0].dtype or g.shape != want.shape:
            raise AssertionError(f"d{name}: {None if g is None else (g.dtype, g.shape)}")
        ours, theirs = (_normwise(t, want, scales[name]) for t in (g, same[name]))
        details.append(f"d{name} {ours:.1e} (torch {theirs:.1e})")
        if not ours <= max(2 * theirs, GRAD_FLOOR[dtype]):
            failures.append(name)
    if failures:
        raise AssertionError(f"too large in d{', d'.join(failures)}: {'; '.join(details)}")
    return "; ".join(details)


def _stats(dev: Device, op: str, x: Any, w: Any, b: Any) -> tuple[Any, Any]:
    """The forward's (mean, rstd) of ``x`` (mean None for rms_norm)."""
    if op == "rms_norm":
        _, rstd = normlab.rms_norm(
            x, weight=w, eps=EPS, return_stats=True, backend=dev.backend("torch")
        )
        return None, rstd
    _, mean, rstd = normlab.layer_norm(
        x, weight=w, bias=b, eps=EPS, return_stats=True, backend=dev.backend("torch")
    )
    return mean, rstd


def _backward_call(
    op: str, dy: Any, x: Any, mean: Any, rstd: Any, w: Any, backend: str, **kw: Any
) -> tuple[Any, ...]:
    """``normlab.layer_norm_backward`` or ``normlab.rms_norm_backward``."""
    if op == "rms_norm":
        return tuple(normlab.rms_norm_backward(dy, x, rstd, w, backend=backend, **kw))
    return tuple(normlab.layer_norm_backward(dy, x, mean, rstd, w, backend=backend, **kw))


def _bits(grads: tuple[Any, ...]) -> list[bytes]:
    return [to_numpy(g).tobytes() for g in grads]


def _check_backward_bitwise(dev: Device, op: str, dtype: str) -> str:
    """The gradients twice: the same bits; dx of some rows alone: the bits of the batch; the same
    call on CuPy arrays (the other family, the same kernels): the same bits."""
    if dev.dry:
        raise Skip("a property of the CUDA kernels; the CPU stand-ins are not held to it here")
    rows, cols = 1000, 4096
    x, dy, w, b = _grad_inputs(dev, dtype, rows, cols, seed=17)
    mean, rstd = _stats(dev, op, x, w, b)
    first = _bits(_backward_call(op, dy, x, mean, rstd, w, "cupy"))
    if _bits(_backward_call(op, dy, x, mean, rstd, w, "cupy")) != first:
        raise AssertionError("a second run differs bitwise")
    batch_dx = to_numpy(_backward_call(op, dy, x, mean, rstd, w, "cupy")[0])
    for r in (0, 1, 31, 32, 999):
        part = slice(r, r + 1)
        alone = _backward_call(
            op, dy[part], x[part], None if mean is None else mean[part], rstd[part], w, "cupy"
        )
        if to_numpy(alone[0]).tobytes() != batch_dx[part].tobytes():
            raise AssertionError(f"dx of row {r} alone differs bitwise from the batch")
    try:
        arrays = [
            None if t is None else dev.array(to_numpy(t), "cupy") for t in (dy, x, mean, rstd, w)
        ]
        on_cupy = _bits(_backward_call(op, *arrays, "cupy"))
    except Exception as error:  # CuPy without bfloat16, say
        raise Skip(f"CuPy arrays of {dtype}: {error}") from error
    if on_cupy != first:
        raise AssertionError("CuPy arrays give other bits than CUDA tensors")
    return ""


def _check_needs(dev: Device, op: str) -> str:
    """Every subset of the gradients gives the bits of the full call (dweight alone, say, still
    runs the kernel that refines each row's mean)."""
    import itertools

    x, dy, w, b = _grad_inputs(dev, "float32", 4097, 1024, seed=23)
    mean, rstd = _stats(dev, op, x, w, b)
    names = ("x", "weight") if op == "rms_norm" else ("x", "weight", "bias")
    backend = dev.backend("torch")
    full = _bits(_backward_call(op, dy, x, mean, rstd, w, backend))
    for n in range(1, len(names)):
        for needs in itertools.combinations(names, n):
            got = _backward_call(op, dy, x, mean, rstd, w, backend, needs=needs)
            for name, g, want in zip(names, got, full, strict=True):
                if (g is None) == (name in needs):
                    raise AssertionError(f"needs={needs}: d{name} is {g!r}")
                if g is not None and to_numpy(g).tobytes() != want:
                    raise AssertionError(f"needs={needs}: d{name} differs from the full call")
    return ""


# --------------------------------------------------------------------------------------------
# Stage 4: the benchmark table


@dataclass(frozen=True)
class Timing:
    op: str
    dtype: str
    rows: int
    hidden: int
    seconds: dict[str, float]

    @property
    def bytes(self) -> int:
        """Bytes of x read plus y written."""
        return 2 * self.rows * self.hidden * numpy_dtype(self.dtype).itemsize

    def gbps(self, what: str) -> float:
        return self.bytes / self.seconds[what] / 1e9


def bench(dev: Device) -> tuple[list[Timing], Report]:
    import torch

    report = Report("bench")
    timings = []
    hidden_sizes = BENCH_HIDDEN if not dev.dry else (256, 1024)
    rows_list = BENCH_ROWS if not dev.dry else (64,)
    for dtype in BENCH_DTYPES:
        for rows in rows_list:
            for hidden in hidden_sizes:
                torch_dtype = getattr(torch, dtype)
                x = torch.randn((rows, hidden), device=dev.torch_device()).to(torch_dtype)
                w = torch.randn(hidden, device=x.device).to(torch_dtype)
                b = torch.randn(hidden, device=x.device).to(torch_dtype)
                y = torch.empty_like(x)
                backend = dev.backend("torch")
                calls = {
                    ("layer_norm", "normlab"): lambda x=x, w=w, b=b, be=backend: normlab.layer_norm(
                        x, weight=w, bias=b, eps=EPS, backend=be
                    ),
                    ("layer_norm", "torch"): lambda x=x, w=w, b=b, h=hidden: (
                        torch.nn.functional.layer_norm(x, (h,), w, b, EPS)
                    ),
                    ("rms_norm", "normlab"): lambda x=x, w=w, be=backend: normlab.rms_norm(
                        x, weight=w, eps=EPS, backend=be
                    ),
                    ("rms_norm", "torch"): lambda x=x, w=w, h=hidden: torch.nn.functional.rms_norm(
                        x, (h,), w, EPS
                    ),
                }
                repeats = 5 if dev.dry else 20
                copy = dev.median_seconds(lambda x=x, y=y: y.copy_(x), repeats)
                seconds = {k: dev.median_seconds(c, repeats) for k, c in calls.items()}
                for op in OPS:
                    measured = {"normlab": seconds[op, "normlab"], "torch": seconds[op, "torch"]}
                    timings.append(Timing(op, dtype, rows, hidden, {**measured, "copy": copy}))
    for t in timings:
        if (t.rows, t.hidden) in TARGETS:
            copy_ratio = t.gbps("normlab") / t.gbps("copy")
            torch_ratio = t.gbps("normlab") / t.gbps("torch")
            met = copy_ratio >= COPY_TARGET and torch_ratio >= TORCH_TARGET
            report.outcomes.append(
                Outcome(
                    "bench",
                    f"{t.op} {t.dtype} {t.rows}x{t.hidden}",
                    met,
                    f"{copy_ratio:.0%} of copy (target {COPY_TARGET:.0%}), "
                    f"{torch_ratio:.2f}x torch (target {TORCH_TARGET}x)",
                )
            )
    return timings, report


def bench_table(timings: list[Timing]) -> str:
    """One table per op: GB/s of normlab, torch's function of the op and a copy, and ratios."""
    lines = []
    for op in OPS:
        lines += [
            f"### {op}",
            "",
            f"| dtype | rows × hidden | MB moved | normlab cupy GB/s | torch {op} GB/s "
            "| copy GB/s | cupy / copy | cupy / torch |",
            "|---|---|--:|--:|--:|--:|--:|--:|",
        ]
        for t in (t for t in timings if t.op == op):
            mark = " **(target)**" if (t.rows, t.hidden) in TARGETS else ""
            lines.append(
                f"| {t.dtype} | {t.rows} × {t.hidden}{mark} | {t.bytes / 1e6:.0f} "
                f"| {t.gbps('normlab'):.0f} | {t.gbps('torch'):.0f} | {t.gbps('copy'):.0f} "
                f"| {t.gbps('normlab') / t.gbps('copy'):.0%} "
                f"| {t.gbps('normlab') / t.gbps('torch'):.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class BackwardTiming:
    op: str
    dtype: str
    rows: int
    hidden: int
    seconds: dict[str, float]

    @property
    def bytes(self) -> int:
        """Bytes of x and dy read and dx written, plus weight read and its gradients written
        (dweight, and dbias for layer_norm)."""
        itemsize = numpy_dtype(self.dtype).itemsize
        gradients = 1 if self.op == "rms_norm" else 2
        return (3 * self.rows + 1 + gradients) * self.hidden * itemsize

    def gbps(self, what: str) -> float:
        return self.bytes / self.seconds[what] / 1e9


def bench_backward(dev: Device) -> list[BackwardTiming]:
    """The backward ops: normlab's functional backward (backend cupy, tensors that do not require
    grad) against torch.autograd.grad of torch's op (one node, its graph kept between calls)."""
    import torch

    timings = []
    hidden_sizes = BENCH_HIDDEN if not dev.dry else (256, 1024)
    rows_list = BENCH_ROWS if not dev.dry else (64,)
    backend = dev.backend("torch")
    for op in OPS:
        for dtype in BENCH_DTYPES:
            for rows in rows_list:
                for hidden in hidden_sizes:
                    x, dy, w, b = _grad_inputs(dev, dtype, rows, hidden, seed=hidden)
                    mean, rstd = _stats(dev, op, x, w, b)
                    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
                    if op == "rms_norm":
                        y = torch.nn.functional.rms_norm(xr, (hidden,), wr, EPS)
                        inputs = (xr, wr)
                    else:
                        y = torch.nn.functional.layer_norm(xr, (hidden,), wr, br, EPS)
                        inputs = (xr, wr, br)
                    calls = {
                        "normlab": lambda o=op, dy=dy, x=x, m=mean, r=rstd, w=w: _backward_call(
                            o, dy, x, m, r, w, backend
                        ),
                        "torch": lambda y=y, i=inputs, dy=dy: torch.autograd.grad(
                            y, i, dy, retain_graph=True
                        ),
                    }
                    repeats = 5 if dev.dry else 20
                    seconds = {k: dev.median_seconds(c, repeats) for k, c in calls.items()}
                    timings.append(BackwardTiming(op, dtype, rows, hidden, seconds))
    return timings


def backward_table(timings: list[BackwardTiming]) -> str:
    """One table per op: GB/s of normlab's backward and torch's, and their ratio."""
    lines = []
    for op in OPS:
        lines += [
            f"### {op} backward",
            "",
            "| dtype | rows × hidden | MB moved | normlab cupy GB/s | torch autograd GB/s "
            "| cupy / torch |",
            "|---|---|--:|--:|--:|--:|",
        ]
        for t in (t for t in timings if t.op == op):
            lines.append(
                f"| {t.dtype} | {t.rows} × {t.hidden} | {t.bytes / 1e6:.0f} "
                f"| {t.gbps('normlab'):.0f} | {t.gbps('torch'):.0f} "
                f"| {t.gbps('normlab') / t.gbps('torch'):.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------


def _environment(dev: Device) -> list[str]:
    import torch

    notes = [f"- normlab {normlab.__version__}, numpy {np.__version__}, torch {torch.__version__}"]
    if dev.dry:
        notes.append("- **dry run**: CPU stand-ins (numpy/torch backends), small shapes")
    else:
        import cupy

        props = torch.cuda.get_device_properties(0)
        notes.append(
            f"- cupy {cupy.__version__}; device {props.name}, "
            f"compute capability {props.major}.{props.minor}"
        )
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=("correctness", "large", "backward", "bench"))
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--dry-run", action="store_true", help="no GPU: CPU stand-ins")
    args = parser.parse_args(argv)
    dev = Device(dry=args.dry_run)
    args.out.mkdir(parents=True, exist_ok=True)
    notes = _environment(dev)
    start = time.perf_counter()
    if args.stage == "bench":
        timings, report = bench(dev)
        backward_timings = bench_backward(dev)
        method = (
            "GB/s = bytes of x read + y written / median time of 20 calls (CUDA events, L2 "
            "flushed before each). normlab: `normlab.layer_norm(x, weight=w, bias=b, "
            "backend='cupy')` and `normlab.rms_norm(x, weight=w, backend='cupy')` on CUDA "
            "tensors; torch: `torch.nn.functional.layer_norm` and "
            "`torch.nn.functional.rms_norm`; copy: `y.copy_(x)`. Targets, for each op: "
            "≥ 85% of copy and ≥ 1.2× torch. Backward: bytes of x and dy read and dx written, "
            "plus weight read and its gradients written, over the median time of "
            "`normlab.layer_norm_backward(dy, x, mean, rstd, w, backend='cupy')` (and "
            "`rms_norm_backward`) on CUDA tensors, and of `torch.autograd.grad` of torch's op "
            "(graph kept); normlab's kernels read x and dy twice (dx, then the weight sums)."
        )
        tables = [bench_table(timings), backward_table(backward_timings)]
        text = report.markdown("Benchmark", [*notes, "", method, "", *tables])
        failed = False  # a benchmark is not a test
    else:
        stages = {"correctness": correctness, "large": large, "backward": backward}
        report = stages[args.stage](dev)
        text = report.markdown(args.stage.capitalize(), notes)
        failed = bool(report.failed)
    text += f"\n_{time.perf_counter() - start:.1f} s_\n"
    (args.out / f"{args.stage}.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
