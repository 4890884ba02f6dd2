"""float16 and bfloat16 on the numba backend beside its peers, and where a half call spends time.

Not part of CI or the matrix: a side-by-side run for the half-precision work (docs/numba.md,
"Half precision"). For each shape of :data:`SHAPES` and dtype of :data:`DTYPES`, on the same
inputs (``workloads.Workload``), the contenders of each op are timed interleaved: every round
times a batch of calls of each contender in turn (the order rotating), so that a busy moment
of a shared machine falls on all of them alike; the figure is the median of the rounds.

- ``layer_norm``: normlab's numba backend (NumPy input, allocating), torch eager
  ``F.layer_norm`` on a zero-copy tensor, ONNX Runtime ``LayerNormalization`` (opset 17)
  allocating and through an io_binding (``peers.py``), where ORT has a kernel for the dtype;
- ``layer_norm_backward``: numba's backward kernels against torch autograd's backward alone.

``--profile`` times instead where a numba half call goes: decoding x to float32 alone, encoding
a float32 array to the half type alone (both parallel over rows, through the very ``load`` and
``store`` the kernels use), the float32 LayerNorm on the decoded x, and the half LayerNorm.

The load average before and after is printed: compare ratios, not absolute times. On a busy
machine a parallel call waits for its slowest thread, so ``--threads 1`` (numba, torch and ORT
each on one thread) gives the steadier ratios. Run::

    python benchmarks/bench_half.py [--rounds 15] [--threads 1] [--profile] [--shapes 32x768]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

if __name__ == "__main__":  # run as a script: the path has benchmarks/, not the root holding it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import normlab
from benchmarks import peers
from benchmarks.workloads import Workload, backend_call, moved_bytes, reference_call

SHAPES: Final = ((32, 768), (1024, 768), (8192, 1024), (65536, 768))
DTYPES: Final = ("float16", "bfloat16")
CONTENDERS: Final = {
    "layer_norm": ("numba", "torch", "ort", "ort_iobinding"),
    "layer_norm_backward": ("numba", "torch"),
}
#: A timed batch repeats a call until it lasts about this long (seconds).
BATCH_SECONDS: Final = 0.004

Call = Callable[[], Any]


def _backend(name: str) -> Any:
    return next(b for b in normlab.list_backends() if b.name == name)


def _contender(op: str, name: str, data: Workload) -> Call | str:
    """The call of contender ``name``, or why it cannot run here."""
    if name == "numba":
        return backend_call(op, _backend("numba"), data, out=False)
    if name in peers.PEERS.get(op, ()):
        why = peers.unavailable(op, name, data.dtype)
        if why is not None:
            return why
        try:
            return peers.call(op, name, data)
        except peers.PeerUnavailable as exc:
            return str(exc)
    return reference_call(op, name, data)


def _repeats(call: Call) -> int:
    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    return max(1, int(BATCH_SECONDS / max(once, 1e-7)))


def interleaved(calls: dict[str, Call], rounds: int) -> dict[str, tuple[float, float]]:
    """(median, best) seconds per call of each of ``calls``, over ``rounds`` rounds that each
    time a batch of every call, in a fresh random order (no call always follows the same one:
    ORT's and torch's worker threads spin a while after a call)."""
    names = list(calls)
    repeats = {name: _repeats(calls[name]) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(names, len(names)):
            call, n = calls[name], repeats[name]
            start = time.perf_counter()
            for _ in range(n):
                call()
            times[name].append((time.perf_counter() - start) / n)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def _load() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


def compare(shapes: tuple[tuple[int, int], ...], rounds: int) -> None:
    """The side-by-side table: median µs per call, GB/s, and numba's speed-up on each peer."""
    print(
        "| op | shape | dtype | contender | µs median | µs best | GB/s | numba × (median, best) |"
    )
    print("|---|---|---|---|--:|--:|--:|--:|")
    for shape in shapes:
        for dtype in DTYPES:
            data = Workload(shape, dtype)
            for op, names in CONTENDERS.items():
                built = {name: _contender(op, name, data) for name in names}
                calls = {n: c for n, c in built.items() if not isinstance(c, str)}
                timed = interleaved(calls, rounds)
                nbytes = moved_bytes(op, data)
                for name in names:
                    label = f"| {op} | {shape[0]}×{shape[1]} | {dtype} | {name} |"
                    if name not in timed:
                        print(f"{label} — | — | — | skipped: {str(built[name])[:60]} |")
                        continue
                    (median, best), (numba_median, numba_best) = timed[name], timed["numba"]
                    print(
                        f"{label} {median * 1e6:.1f} | {best * 1e6:.1f} | {nbytes / best / 1e9:.2f}"
                        f" | {median / numba_median:.2f}, {best / numba_best:.2f} |"
                    )


def profile(shapes: tuple[tuple[int, int], ...], rounds: int) -> None:
    """Where a numba half LayerNorm spends time: decode alone, encode alone, float32 math."""
    from numba import njit, prange

    from normlab.backends.numba_forward import load, store

    @njit(parallel=True)
    def decode(bits: Any, out: Any) -> None:
        for i in prange(bits.shape[0]):
            for j in range(bits.shape[1]):
                out[i, j] = load(bits[i, j])

    @njit(parallel=True)
    def encode(values: Any, bits: Any) -> None:
        for i in prange(values.shape[0]):
            row = bits[i]
            for j in range(values.shape[1]):
                row[j] = store(values[i, j], row)

    print("best of the rounds, µs per call:")
    print("| shape | dtype | decode | encode | float32 LayerNorm | half LayerNorm |")
    print("|---|---|--:|--:|--:|--:|")
    for shape in shapes:
        for dtype in DTYPES:
            calls = _profile_calls(Workload(shape, dtype), decode, encode)
            best = {k: v[1] for k, v in interleaved(calls, rounds).items()}
            cells = " | ".join(f"{best[k] * 1e6:.1f}" for k in calls)
            print(f"| {shape[0]}×{shape[1]} | {dtype} | {cells} |")


def _profile_calls(data: Workload, decode: Any, encode: Any) -> dict[str, Call]:
    """The four calls of :func:`profile` on ``data``: decode x, encode it back, the float32
    LayerNorm on the decoded x, the half LayerNorm on x."""
    bits = data.x.view(np.int16 if data.dtype == "float16" else np.uint16)
    decoded = np.empty(data.shape, np.float32)
    encoded = np.empty_like(bits)
    decode(bits, decoded)
    wide = Workload.__new__(Workload)  # the same operands, x decoded to float32
    wide.shape, wide.dtype = data.shape, "float32"
    wide.x, wide.weight, wide.bias = decoded, data.weight, data.bias
    numba = _backend("numba")
    return {
        "decode": lambda: decode(bits, decoded),
        "encode": lambda: encode(decoded, encoded),
        "float32": backend_call("layer_norm", numba, wide, out=False),
        "half": backend_call("layer_norm", numba, data, out=False),
    }


def _conversion_path() -> str:
    try:
        from normlab.backends import half_convert
    except ImportError:  # a normlab from before the instruction path, for a before/after run
        return "bit patterns only (normlab without half_convert)"
    return half_convert.PATH


def use_threads(count: int) -> None:
    """Every contender on ``count`` threads: numba's and torch's pools, and ORT's sessions
    (peers.py gives them ``os.cpu_count()`` intra-op threads: that count, for peers alone)."""
    import numba
    import torch

    numba.set_num_threads(count)
    torch.set_num_threads(count)
    peers.os = types.SimpleNamespace(cpu_count=lambda: count)  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--threads", type=int, help="threads of every contender (default: all)")
    parser.add_argument("--shapes", nargs="*", default=[f"{r}x{c}" for r, c in SHAPES])
    args = parser.parse_args()
    shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes)
    if args.threads:
        use_threads(args.threads)
    threads = args.threads or "all"
    print(f"conversion path: {_conversion_path()}; threads: {threads}; load before: {_load()}")
    (profile if args.profile else compare)(shapes, args.rounds)  # type: ignore[arg-type]
    print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
