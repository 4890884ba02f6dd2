"""What fusing the quantizer into the norm saves: ``quantize="int8"`` (and ``"fp8_e4m3"``) in one
pass beside the unfused pair and torch eager's composition of the same formula, on CPU torch
tensors, side by side.

The contenders of a case (an op and a mode, dynamic per-row scale, on one shape and dtype):

- ``fused``: ``normlab.rms_norm(x, weight=w, quantize=mode)`` (``add_rms_norm(x, r, ...)``),
  numba chosen by default: q and scale in one pass over each row, y never in memory;
- ``unfused pair``: normlab's plain call (y in x's dtype, numba), then numba's quantizer alone
  over that y (:func:`normlab.backends.numba_quantized.quantized_rows`, on the pool's threads
  as the fused call takes them), q and scale allocated in the call as the fused call does;
- ``torch eager``: ``F.rms_norm`` of float32 x (h = x + r first), ``scale = max|y| / limit``
  per row, ``q = (y / scale).round().clamp(±127)`` as int8 (fp8: clamped to ±448, cast to
  ``torch.float8_e4m3fn``).

Each case is timed at one token (1x4096), a small batch (32x4096) and a prefill (8192x4096), in
float32 and bfloat16. The contenders of a case are timed round by round, interleaved (each round
times each contender's best batch of calls); a contender's figure is its median over the
rounds::

    python benchmarks/quantized.py --rounds 7

prints, per case, each contender's median (µs) and its ratio to the fused call (above 1:
slower than the fused call), with the load average before and after. The same cases are rows of
the benchmark matrix (``bench_matrix.test_quantized``, kind ``"quantized"``; the report's
quantized table).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import timeit
from collections.abc import Callable
from typing import Any, Final

from normlab.ops import names

SHAPES: Final = ((1, 4096), (32, 4096), (8192, 4096))
DTYPES: Final = ("float32", "bfloat16")
OPS: Final = names(direction="forward", norm="rms")
#: Each op's modes (dynamic per-row scale); a case is ``"<op> <mode>"``.
MODES: Final = {"rms_norm": ("int8", "fp8_e4m3"), "add_rms_norm": ("int8",)}
#: The cases measured, in the order :func:`cases` gives them.
CASES: Final = tuple(f"{op} {mode}" for op in OPS for mode in MODES[op])
CONTENDERS: Final = ("fused", "unfused pair", "torch eager")
#: The same eps for every contender.
EPS: Final = 1e-6
#: Each mode's largest magnitude of q (the dynamic scale is ``max|y_row| / LIMITS[mode]``).
LIMITS: Final = {"int8": 127.0, "fp8_e4m3": 448.0}
#: Seconds each contender is timed per round.
CASE_SECONDS: Final = 0.2


@functools.lru_cache(maxsize=1)
def cases(rows: int, cols: int, dtype: str) -> dict[str, dict[str, Callable[[], Any]]]:
    """Per case (:data:`CASES`), its contenders by name (:data:`CONTENDERS`) on ``rows x cols``
    tensors of ``dtype``. Cached (one input at a time): the matrix's rows of one shape and
    dtype share their tensors."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import normlab
    from normlab.backends.numba_pool import FORWARD_SERIAL_ELEMENTS, POOL, SERIAL_ELEMENTS
    from normlab.backends.numba_quantized import quantized_rows

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=gen).to(torch_dtype)
    r = torch.randn(rows, cols, generator=gen).to(torch_dtype)
    w = (0.1 * torch.randn(cols, generator=gen)).to(torch_dtype)
    shape = (cols,)
    q_dtypes = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
    # the pool's threads as the fused call takes them (numba_quantized.quantized)
    limit_elements = FORWARD_SERIAL_ELEMENTS.get(dtype, SERIAL_ELEMENTS)
    work = rows * cols * SERIAL_ELEMENTS // limit_elements if rows > 1 else 0

    def bits(a: Any) -> Any:
        """The NumPy view of a tensor's memory as numba's kernels read it."""
        if a.dtype == torch.bfloat16:
            return a.view(torch.int16).numpy().view(np.uint16)
        if a.dtype == torch.float8_e4m3fn:
            return a.view(torch.uint8).numpy()
        return a.numpy()

    def quantize(y: Any, mode: str) -> tuple[Any, Any]:
        """numba's quantizer alone over ``y``: (q, scale) allocated here."""
        q = torch.empty((rows, cols), dtype=q_dtypes[mode])
        scale = torch.empty(rows, dtype=torch.float32)
        threads = POOL.acquire(work)
        try:
            quantized_rows(
                bits(y), bits(q), scale.numpy(), 0.0, LIMITS[mode], mode == "fp8_e4m3", threads
            )
        finally:
            POOL.release(threads)
        return q, scale.reshape(rows, 1)

    def eager_q(y: Any, mode: str) -> tuple[Any, Any]:
        s = y.abs().amax(-1, keepdim=True) / LIMITS[mode]
        if mode == "int8":
            return (y / s).round().clamp(-127, 127).to(torch.int8), s
        return (y / s).clamp(-448, 448).to(torch.float8_e4m3fn), s

    def rms_case(mode: str) -> dict[str, Callable[[], Any]]:
        def pair() -> Any:
            return quantize(normlab.rms_norm(x, weight=w, eps=EPS), mode)

        def eager() -> Any:
            return eager_q(F.rms_norm(x.float(), shape, w.float(), EPS), mode)

        return {
            "fused": lambda: normlab.rms_norm(x, weight=w, eps=EPS, quantize=mode),
            "unfused pair": pair,
            "torch eager": eager,
        }

    def add_case(mode: str) -> dict[str, Callable[[], Any]]:
        def pair() -> Any:
            y, h = normlab.add_rms_norm(x, r, weight=w, eps=EPS)
            return (*quantize(y, mode), h)

        def eager() -> Any:
            h = x + r
            return (*eager_q(F.rms_norm(h.float(), shape, w.float(), EPS), mode), h)

        return {
            "fused": lambda: normlab.add_rms_norm(x, r, weight=w, eps=EPS, quantize=mode),
            "unfused pair": pair,
            "torch eager": eager,
        }

    makers = {"rms_norm": rms_case, "add_rms_norm": add_case}
    return {f"{op} {mode}": makers[op](mode) for op in OPS for mode in MODES[op]}


def _best(call: Callable[[], Any]) -> float:
    """The best time per call (µs) of batches filling :data:`CASE_SECONDS`."""
    timer = timeit.Timer(call)
    number, _ = timer.autorange()
    per_call = max(timer.timeit(number) / number, 1e-9)
    batches = max(3, int(CASE_SECONDS / per_call / number))
    return min(timer.repeat(repeat=batches, number=number)) / number * 1e6


def _load() -> str:
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("NORMLAB_QUIET", "1")
    print(f"load average (1 / 5 / 15 min): {_load()}")
    print(f"{'case':42} {'fused µs':>10} {'pair':>10} {'torch eager':>12}")
    for rows, cols in SHAPES:
        for dtype in DTYPES:
            for case, contenders in cases(rows, cols, dtype).items():
                for call in contenders.values():
                    call()  # compiles, caches plans and choices
                times: dict[str, list[float]] = {name: [] for name in contenders}
                for _ in range(args.rounds):
                    for name, call in contenders.items():
                        times[name].append(_best(call))
                median = {name: statistics.median(t) for name, t in times.items()}
                fused = median["fused"]
                label = f"{case} {rows}x{cols} {dtype}"
                print(
                    f"{label:42} {fused:10.1f} {median['unfused pair']:10.1f} "
                    f"{median['torch eager']:12.1f}   (pair {median['unfused pair'] / fused:.2f}x"
                    f"  eager {median['torch eager'] / fused:.2f}x)"
                )
    print(f"load average (1 / 5 / 15 min): {_load()}")


if __name__ == "__main__":
    main()
