"""The default call's own cost, for two checkouts side by side: tiny calls, where the front end is
most of the time, and large ones, where the kernel is.

Each op with no backend named, on NumPy arrays and CPU torch tensors of float32: 1x768 (one
token) and 1024x4096 (a prefill's worth), weight and bias in x's dtype. Each checkout is timed in
processes of its own, the two interleaved round by round; a case's time in a round is its best
batch of calls, and the report takes each case's median over the rounds::

    python benchmarks/hot_path.py --before /path/to/old/checkout --rounds 11

prints, per case, both medians and their ratio (after / before: above 1 is slower); ``--json
FILE`` keeps the figures. ``--measure`` times this checkout once and prints JSON (what a round
runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import timeit
from pathlib import Path
from typing import Any, Final

SHAPES: Final = ((1, 768), (1024, 4096))
FAMILIES: Final = ("numpy", "torch")
#: Seconds each case is timed per round, in batches of calls.
CASE_SECONDS: Final = 0.3
HERE: Final = Path(__file__).resolve()


def _cases(family: str, rows: int, cols: int) -> dict[str, Any]:
    """The calls of one family and shape, by name: a function of no arguments each."""
    import numpy as np

    import normlab

    rng = np.random.default_rng(0)
    x, r, dy = (rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(3))
    w = rng.standard_normal(cols).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    if family == "torch":
        import torch

        x, r, dy, w, b = (torch.from_numpy(a) for a in (x, r, dy, w, b))
    _, mean, rstd = normlab.layer_norm(x, weight=w, bias=b, return_stats=True)
    _, rms_rstd = normlab.rms_norm(x, weight=w, return_stats=True)
    return {
        "layer_norm": lambda: normlab.layer_norm(x, weight=w, bias=b),
        "rms_norm": lambda: normlab.rms_norm(x, weight=w),
        "add_layer_norm": lambda: normlab.add_layer_norm(x, r, weight=w, bias=b),
        "add_rms_norm": lambda: normlab.add_rms_norm(x, r, weight=w),
        "layer_norm_backward": lambda: normlab.layer_norm_backward(dy, x, mean, rstd, w),
        "rms_norm_backward": lambda: normlab.rms_norm_backward(dy, x, rms_rstd, w),
    }


def measure() -> dict[str, float]:
    """Every case's best time per call (µs) in this process."""
    results: dict[str, float] = {}
    for family in FAMILIES:
        for rows, cols in SHAPES:
            for op, call in _cases(family, rows, cols).items():
                call()  # compiles, caches the plan and the choice
                timer = timeit.Timer(call)
                number, _ = timer.autorange()
                batches = max(
                    3, int(CASE_SECONDS / max(timer.timeit(number) / number, 1e-9) / number)
                )
                best = min(timer.repeat(repeat=batches, number=number)) / number
                results[f"{op} {family} {rows}x{cols}"] = best * 1e6
    return results


def _round(checkout: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "NORMLAB_QUIET": "1"}
    script = checkout / "benchmarks" / "hot_path.py"
    if not script.exists():  # a checkout from before this script: run this one on its code
        script = HERE
    done = subprocess.run(
        [sys.executable, str(script), "--measure"], env=env, capture_output=True, text=True,
        check=True, cwd=checkout,
    )  # fmt: skip
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="time this checkout once (JSON)")
    parser.add_argument("--before", type=Path, help="the checkout to compare against")
    parser.add_argument("--after", type=Path, default=HERE.parents[1])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    if args.before is None:
        parser.error("--before is required (or --measure)")
    rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for side in order:
            rounds[side].append(_round(getattr(args, side).resolve()))
        print(f"round {i + 1}/{args.rounds} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    medians = {
        side: {case: statistics.median(r[case] for r in runs) for case in runs[0]}
        for side, runs in rounds.items()
    }
    print(f"{'case':<38} {'before µs':>10} {'after µs':>10} {'after/before':>13}")
    for case, before in medians["before"].items():
        after = medians["after"][case]
        print(f"{case:<38} {before:>10.2f} {after:>10.2f} {after / before:>13.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(medians, indent=1) + "\n")


if __name__ == "__main__":
    main()
