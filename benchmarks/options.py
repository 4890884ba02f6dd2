"""What the options of real models' norms cost: each option's call beside the plain call (the
base op, same shape and dtypes) and beside torch eager's composition of the same formula, on
CPU torch tensors, side by side.

The options: ``weight_offset=1`` (Gemma), a bfloat16 weight beside float32 x, the Llama casting
order (``casting="llama"``), a float32 residual stream beside bfloat16 x (``add_rms_norm``).
Each is timed at one token (1x4096: most inference calls) and a prefill (1024x4096). The
contenders of a case are timed round by round, interleaved (each round times each contender's
best batch of calls); a contender's figure is its median over the rounds::

    python benchmarks/options.py --rounds 7

prints, per case, each contender's median (µs) and its ratio to the option's call (above 1:
slower than normlab's call with the option). The same cases are rows of the benchmark matrix
(``bench_matrix.test_option``, kind ``"option"``; the report's options table).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import timeit
from collections.abc import Callable
from typing import Any, Final

SHAPES: Final = ((1, 4096), (1024, 4096))
#: The options measured, and each one's contenders, in the order :func:`cases` gives them.
OPTIONS: Final = (
    "weight_offset=1 (bf16)",
    "bf16 weight, f32 x",
    "casting=llama (bf16)",
    "f32 stream, bf16 x",
)
CONTENDERS: Final = ("option", "base", "torch eager")
#: Seconds each contender is timed per round.
CASE_SECONDS: Final = 0.2


@functools.lru_cache(maxsize=1)
def cases(rows: int, cols: int) -> dict[str, dict[str, Callable[[], Any]]]:
    """Per option (:data:`OPTIONS`), its contenders by name (:data:`CONTENDERS`): ``option``
    (normlab with it), ``base`` (normlab's plain call of the same shape and dtypes) and
    ``torch eager`` (the same formula in torch's own ops). Cached: the matrix's rows of one
    shape share their tensors."""
    import torch
    import torch.nn.functional as F

    import normlab

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=gen)
    w = 0.1 * torch.randn(cols, generator=gen)
    x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
    stream = torch.randn(rows, cols, generator=gen)
    shape = (cols,)
    eps = torch.finfo(torch.float32).eps

    def llama() -> Any:
        h = x16.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w16 * h.to(torch.bfloat16)

    return {
        "weight_offset=1 (bf16)": {
            "option": lambda: normlab.rms_norm(x16, weight=w16, weight_offset=1.0),
            "base": lambda: normlab.rms_norm(x16, weight=w16),
            "torch eager": lambda: F.rms_norm(x16.float(), shape, 1 + w16.float()).to(x16.dtype),
        },
        "bf16 weight, f32 x": {
            "option": lambda: normlab.rms_norm(x, weight=w16),
            "base": lambda: normlab.rms_norm(x, weight=w),
            "torch eager": lambda: F.rms_norm(x, shape, w16.float()),
        },
        "casting=llama (bf16)": {
            "option": lambda: normlab.rms_norm(x16, weight=w16, casting="llama"),
            "base": lambda: normlab.rms_norm(x16, weight=w16),
            "torch eager": llama,
        },
        "f32 stream, bf16 x": {
            "option": lambda: normlab.add_rms_norm(x16, stream, weight=w16),
            "base": lambda: normlab.add_rms_norm(x16, stream.to(torch.bfloat16), weight=w16),
            "torch eager": lambda: F.rms_norm(x16.float() + stream, shape, w16.float(), eps).to(
                x16.dtype
            ),
        },
    }


def _best(call: Callable[[], Any]) -> float:
    """The best time per call (µs) of batches filling :data:`CASE_SECONDS`."""
    timer = timeit.Timer(call)
    number, _ = timer.autorange()
    per_call = max(timer.timeit(number) / number, 1e-9)
    batches = max(3, int(CASE_SECONDS / per_call / number))
    return min(timer.repeat(repeat=batches, number=number)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("NORMLAB_QUIET", "1")
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(f"{'case':42} {'option µs':>10} {'base':>10} {'torch eager':>12}")
    for rows, cols in SHAPES:
        for option, contenders in cases(rows, cols).items():
            for call in contenders.values():
                call()  # compiles, caches plans and choices
            times: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(args.rounds):
                for name, call in contenders.items():
                    times[name].append(_best(call))
            median = {name: statistics.median(t) for name, t in times.items()}
            ratios = "  ".join(
                f"{name} {median[name] / median['option']:.2f}x"
                for name in contenders
                if name != "option"
            )
            print(
                f"{option + f' {rows}x{cols}':42} {median['option']:10.1f} "
                f"{median['base']:10.1f} {median['torch eager']:12.1f}   ({ratios})"
            )
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
