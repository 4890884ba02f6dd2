"""The GPU check's large-input and speed stages of the cupy backend, one stage per call
(``benchmarks/gpu_check.sh`` runs them after the conformance suite on CuPy arrays and on CUDA
tensors, which checks correctness):

    python benchmarks/gpu_check.py large --out DIR    65537 rows, 2^31+ elements, long rows
    python benchmarks/gpu_check.py bench --out DIR    GB/s against torch and a copy; the
                                                      quantized outputs against the unfused
                                                      pair and torch eager
    python benchmarks/gpu_check.py --out DIR          both

Both stages cover both ops, layer_norm and rms_norm (against ``torch.nn.functional.layer_norm``
and ``torch.nn.functional.rms_norm`` in the benchmark, forward and backward).

Each stage writes ``DIR/<stage>.md``. ``large`` exits 1 when a case fails; ``bench`` measures
and never fails on speed (it marks the targets met or missed).

``--dry-run`` needs no GPU: CPU torch tensors through the torch backend stand in for CUDA
tensors, with small shapes, so that the logic of every stage (cases, references, comparisons,
tables) runs anywhere.
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
from normlab.ops import FORWARD_OPS  # noqa: E402
from normlab.testing.conversions import numpy_dtype  # noqa: E402
from normlab.testing.tolerances import (  # noqa: E402
    TOLERANCES,
)

OPS: Final = FORWARD_OPS
DTYPES: Final = ("float16", "bfloat16", "float32", "float64")
EPS: Final = 1e-5
AWKWARD_COLS: Final = (1, 3, 17, 127, 1000, 4097, 65536, 262144)
BENCH_HIDDEN: Final = (256, 512, 1024, 2048, 4096, 8192, 16384)
BENCH_ROWS: Final = (4096, 16384)
BENCH_DTYPES: Final = ("float32", "bfloat16", "float16")
#: (rows, hidden) where the targets apply: >= 85% of a copy's GB/s, >= 1.2x torch.
TARGETS: Final = {(4096, 4096), (16384, 4096)}
COPY_TARGET: Final = 0.85
TORCH_TARGET: Final = 1.2
#: Bytes written between timed calls so that x is not in L2 (a few times any current L2).
FLUSH_BYTES: Final = 1 << 30


# --------------------------------------------------------------------------------------------
# Where arrays live: the GPU, or (dry run) the CPU


@dataclass(frozen=True)
class Device:
    """The backend, tensors and timing on the GPU, or their CPU stand-ins in a dry run."""

    dry: bool

    @property
    def backend(self) -> str:
        """The backend the stages call: cupy, or (dry run) torch."""
        return "torch" if self.dry else "cupy"

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


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class Outcome:
    """One checked case: what it was, whether it passed, and why not."""

    stage: str
    case: str
    passed: bool
    detail: str = ""


@dataclass
class Report:
    stage: str
    outcomes: list[Outcome] = field(default_factory=list)

    def run(self, case: str, check: Callable[[], str | None]) -> None:
        """Run ``check`` (returns a detail line or None); an exception is a failure."""
        try:
            detail = check() or ""
            self.outcomes.append(Outcome(self.stage, case, True, detail))
        except Exception as error:  # a failing case is reported, and the stage goes on
            lines = traceback.format_exception_only(type(error), error)
            self.outcomes.append(Outcome(self.stage, case, False, "".join(lines).strip()))

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.passed]

    def markdown(self, title: str, notes: list[str]) -> str:
        passed = sum(o.passed for o in self.outcomes)
        lines = [f"## {title}", "", *notes, ""]
        lines.append(f"{passed} passed, {len(self.failed)} failed of {len(self.outcomes)} cases.")
        if self.failed:
            lines += ["", "### Failures", "", "| case | detail |", "|---|---|"]
            lines += [f"| `{o.case}` | {_cell(o.detail)} |" for o in self.failed[:200]]
        details = [o for o in self.outcomes if o.passed and o.detail]
        if details:
            lines += ["", "| case | result |", "|---|---|"]
            lines += [f"| `{o.case}` | {_cell(o.detail)} |" for o in details]
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


# --------------------------------------------------------------------------------------------
# Stage 1: large cases, against a float64 reference computed on the device in chunks


def large(dev: Device) -> Report:
    report = Report("large")
    cases: list[tuple[int, int, str]] = [(65537, 256 if not dev.dry else 8, "float32")]
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
        y, rstd = normlab.rms_norm(x, weight=w, eps=EPS, return_stats=True, backend=dev.backend)
    else:
        y, mean, rstd = normlab.layer_norm(
            x, weight=w, bias=b, eps=EPS, return_stats=True, backend=dev.backend
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


def _stats(dev: Device, op: str, x: Any, w: Any, b: Any) -> tuple[Any, Any]:
    """The forward's (mean, rstd) of ``x`` (mean None for rms_norm)."""
    if op == "rms_norm":
        _, rstd = normlab.rms_norm(x, weight=w, eps=EPS, return_stats=True, backend=dev.backend)
        return None, rstd
    _, mean, rstd = normlab.layer_norm(
        x, weight=w, bias=b, eps=EPS, return_stats=True, backend=dev.backend
    )
    return mean, rstd


def _backward_call(
    op: str, dy: Any, x: Any, mean: Any, rstd: Any, w: Any, backend: str, **kw: Any
) -> tuple[Any, ...]:
    """``normlab.layer_norm_backward`` or ``normlab.rms_norm_backward``."""
    if op == "rms_norm":
        return tuple(normlab.rms_norm_backward(dy, x, rstd, w, backend=backend, **kw))
    return tuple(normlab.layer_norm_backward(dy, x, mean, rstd, w, backend=backend, **kw))


# --------------------------------------------------------------------------------------------
# Stage 2: the benchmark


@dataclass(frozen=True)
class Timing:
    """Median seconds of each contender (``normlab``, ``torch``, ``copy``) at one size."""

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
    hidden_sizes = BENCH_HIDDEN if not dev.dry else (256,)
    rows_list = BENCH_ROWS if not dev.dry else (64,)
    for dtype in BENCH_DTYPES:
        for rows in rows_list:
            for hidden in hidden_sizes:
                torch_dtype = getattr(torch, dtype)
                x = torch.randn((rows, hidden), device=dev.torch_device()).to(torch_dtype)
                w = torch.randn(hidden, device=x.device).to(torch_dtype)
                b = torch.randn(hidden, device=x.device).to(torch_dtype)
                y = torch.empty_like(x)
                backend = dev.backend
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
                repeats = 3 if dev.dry else 20
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
class BackwardTiming(Timing):
    """The timings of a backward op: the same fields, other bytes."""

    @property
    def bytes(self) -> int:
        """Bytes of x and dy read and dx written, plus weight read and its gradients written
        (dweight, and dbias for layer_norm)."""
        itemsize = numpy_dtype(self.dtype).itemsize
        gradients = 1 if self.op == "rms_norm" else 2
        return (3 * self.rows + 1 + gradients) * self.hidden * itemsize


def bench_backward(dev: Device) -> list[BackwardTiming]:
    """The backward ops: normlab's functional backward (backend cupy, tensors that do not require
    grad) against torch.autograd.grad of torch's op (one node, its graph kept between calls)."""
    import torch

    timings = []
    hidden_sizes = BENCH_HIDDEN if not dev.dry else (256,)
    rows_list = BENCH_ROWS if not dev.dry else (64,)
    backend = dev.backend
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
                    repeats = 3 if dev.dry else 20
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


#: The quantized outputs' benchmark: rows x hidden of serving (one token, a small batch, a
#: prefill), bfloat16, each mode with a dynamic per-row scale.
QUANTIZED_SHAPES: Final = ((1, 4096), (32, 4096), (8192, 4096))
QUANTIZED_MODES: Final = ("int8", "fp8_e4m3")


def _torch_quantize(y: Any, mode: str) -> tuple[Any, Any]:
    """The dynamic per-row quantization of y in torch's eager ops (float32)."""
    import torch

    y = y.float()
    limit = 127.0 if mode == "int8" else 448.0
    scale = y.abs().amax(dim=-1, keepdim=True) / limit
    v = y / torch.where(scale == 0, torch.ones_like(scale), scale)
    if mode == "int8":
        return v.round().clamp(-127, 127).to(torch.int8), scale
    return v.clamp(-448, 448).to(torch.float8_e4m3fn), scale


def bench_quantized(dev: Device) -> list[Timing]:
    """``normlab.add_rms_norm(..., quantize=mode)`` (one kernel: h and q written, y never)
    against the unfused pair on the same device (normlab's add_rms_norm, then torch's
    quantization of its y) and torch eager's whole composition, bfloat16."""
    import torch

    timings = []
    backend = dev.backend
    for mode in QUANTIZED_MODES:
        for rows, hidden in QUANTIZED_SHAPES if not dev.dry else ((1, 256), (64, 256)):
            x, r = (
                torch.randn((rows, hidden), device=dev.torch_device()).to(torch.bfloat16)
                for _ in range(2)
            )
            w = torch.randn(hidden, device=x.device).to(torch.bfloat16)

            def torch_eager(x: Any = x, r: Any = r, w: Any = w, m: str = mode) -> Any:
                h = x + r
                y = torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), w.float(), EPS)
                return _torch_quantize(y, m), h

            calls = {
                "normlab": lambda x=x, r=r, w=w, m=mode: normlab.add_rms_norm(
                    x, r, weight=w, eps=EPS, quantize=m, backend=backend
                ),
                "pair": lambda x=x, r=r, w=w, m=mode: _torch_quantize(
                    normlab.add_rms_norm(x, r, weight=w, eps=EPS, backend=backend)[0], m
                ),
                "torch": torch_eager,
            }
            repeats = 3 if dev.dry else 20
            seconds = {k: dev.median_seconds(c, repeats) for k, c in calls.items()}
            timings.append(Timing(f"add_rms_norm {mode}", "bfloat16", rows, hidden, seconds))
    return timings


def quantized_table(timings: list[Timing]) -> str:
    """Microseconds of the fused quantizing call, the unfused pair and torch eager, and ratios."""
    lines = [
        "### add_rms_norm with quantized outputs (bfloat16, dynamic per-row scale)",
        "",
        "| mode | rows × hidden | normlab fused µs | pair µs | torch eager µs | pair / fused "
        "| torch / fused |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for t in timings:
        fused, pair, eager = (t.seconds[k] * 1e6 for k in ("normlab", "pair", "torch"))
        lines.append(
            f"| {t.op.split()[1]} | {t.rows} × {t.hidden} | {fused:.1f} | {pair:.1f} "
            f"| {eager:.1f} | {pair / fused:.2f} | {eager / fused:.2f} |"
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


#: The stages, in the order a run of all of them takes.
STAGES: Final = ("large", "bench")

#: How the benchmark measures (written above its tables).
BENCH_METHOD: Final = (
    "GB/s = bytes of x read + y written / median time of 20 calls (CUDA events, L2 "
    "flushed before each). normlab: `normlab.layer_norm(x, weight=w, bias=b, "
    "backend='cupy')` and `normlab.rms_norm(x, weight=w, backend='cupy')` on CUDA "
    "tensors; torch: `torch.nn.functional.layer_norm` and "
    "`torch.nn.functional.rms_norm`; copy: `y.copy_(x)`. Targets, for each op: "
    "≥ 85% of copy and ≥ 1.2× torch. Backward: bytes of x and dy read and dx written, "
    "plus weight read and its gradients written, over the median time of "
    "`normlab.layer_norm_backward(dy, x, mean, rstd, w, backend='cupy')` (and "
    "`rms_norm_backward`) on CUDA tensors, and of `torch.autograd.grad` of torch's op "
    "(graph kept); normlab's kernels read x and dy twice (dx, then the weight sums). "
    "Quantized outputs: median µs (CUDA events, L2 flushed) of "
    "`normlab.add_rms_norm(x, r, weight=w, quantize=mode, backend='cupy')`, of the pair "
    "(the same call without quantize, then torch's per-row quantization of y) and of "
    "torch eager's composition; one kernel moves x, r in and h, q out, the pair y twice more."
)


def run_stage(stage: str, dev: Device, out: Path) -> bool:
    """Run ``stage``, write ``out/<stage>.md`` and print it; whether a case failed (a benchmark
    never fails)."""
    notes = _environment(dev)
    start = time.perf_counter()
    if stage == "bench":
        timings, report = bench(dev)
        tables = [
            bench_table(timings),
            backward_table(bench_backward(dev)),
            quantized_table(bench_quantized(dev)),
        ]
        text = report.markdown("Benchmark", [*notes, "", BENCH_METHOD, "", *tables])
        failed = False  # a benchmark is not a test
    else:
        report = large(dev)
        text = report.markdown("Large inputs", notes)
        failed = bool(report.failed)
    text += f"\n_{time.perf_counter() - start:.1f} s_\n"
    (out / f"{stage}.md").write_text(text)
    print(text)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", nargs="?", choices=STAGES, help="one stage (default: all)")
    parser.add_argument("--out", type=Path, default=Path("gpu-results"))
    parser.add_argument("--dry-run", action="store_true", help="no GPU: CPU stand-ins")
    args = parser.parse_args(argv)
    dev = Device(dry=args.dry_run)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = [
        stage
        for stage in ([args.stage] if args.stage else STAGES)
        if run_stage(stage, dev, args.out)
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
