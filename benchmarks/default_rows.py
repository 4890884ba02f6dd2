"""The default call on CPU torch tensors against the number of rows, for two checkouts side by side.

``normlab.layer_norm(x, weight=w, bias=b)`` (and ``rms_norm``) with no backend named, on float32,
float16 and bfloat16 tensors of 1 … 4096 rows of 768 and 4096, parameters in x's dtype: what a
model's norm layer calls. Each checkout is timed in processes of its own (no other kernels'
threads in them), the two interleaved round by round; a case's time is its best batch over a
round, and the report takes each case's median over the rounds::

    python benchmarks/default_rows.py --before /path/to/old/checkout --rounds 5

runs this checkout (``--after``, default: the one holding this file) against ``--before`` and
prints, per case, both times and their ratio (after / before: above 1 is slower), with the
backend each default chose; ``--json FILE`` keeps the figures. One process measures
(``--measure``) and prints JSON; it is what the rounds run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

from normlab.ops import FORWARD_OPS

ROWS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
HIDDEN: Final = (768, 4096)
DTYPES: Final = ("float32", "float16", "bfloat16")
OPS: Final = FORWARD_OPS
#: Seconds each case is timed per round, in batches of calls.
CASE_SECONDS: Final = 0.25
HERE: Final = Path(__file__).resolve()


def measure(only: str | None = None) -> dict[str, dict[str, Any]]:
    """Every case's best time per call (µs) in this process, with the backend chosen; only
    the cases whose name (``"layer_norm bfloat16 64x768"``) matches the regular expression
    ``only``, when given."""
    import re

    import torch

    import normlab

    results: dict[str, dict[str, Any]] = {}
    for op in OPS:
        function = getattr(normlab, op)
        for dtype in DTYPES:
            for cols in HIDDEN:
                for rows in ROWS:
                    name = f"{op} {dtype} {rows}x{cols}"
                    if only is not None and not re.search(only, name):
                        continue
                    x = torch.randn(rows, cols, dtype=getattr(torch, dtype))
                    kwargs = {"weight": torch.randn(cols, dtype=x.dtype)}
                    if op == "layer_norm":
                        kwargs["bias"] = torch.randn(cols, dtype=x.dtype)
                    text = normlab.explain(x, op=op, **kwargs)
                    chosen = re.search(r"chosen: (\w+)", text)
                    call = functools.partial(function, x, **kwargs)
                    results[name] = {
                        "us": _best_us(call, rows * cols),
                        "backend": chosen.group(1) if chosen else "?",
                    }
    return results


def _best_us(call: Any, elements: int) -> float:
    for _ in range(3):
        call()
    per_batch = max(3, int(2e6 / elements))
    best = float("inf")
    deadline = time.perf_counter() + CASE_SECONDS
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(per_batch):
            call()
        best = min(best, (time.perf_counter() - start) / per_batch)
    return best * 1e6


def _round(checkout: Path, only: str | None) -> dict[str, dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(checkout), NORMLAB_QUIET="1")
    command = [sys.executable, str(HERE), "--measure", *(["--only", only] if only else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{checkout}: {done.stderr[-2000:]}")
    result: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def compare(before: Path, after: Path, rounds: int, only: str | None = None) -> dict[str, Any]:
    """Interleaved rounds of both checkouts; per case the median of the rounds' bests."""
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {"before": [], "after": []}
    for _ in range(rounds):
        for name, checkout in (("before", before), ("after", after)):
            runs[name].append(_round(checkout, only))
    cases = list(runs["after"][0])
    table = {}
    for case in cases:
        entry = {}
        for name in runs:
            entry[name] = statistics.median(run[case]["us"] for run in runs[name])
            entry[f"{name}_backend"] = runs[name][0][case]["backend"]
        entry["ratio"] = entry["after"] / entry["before"]
        table[case] = entry
    return {"rounds": rounds, "load": os.getloadavg(), "cases": table}


def _print(result: dict[str, Any]) -> None:
    print(f"rounds {result['rounds']}, load average after {result['load']}")
    print(
        f"{'case':32s} {'before µs':>10s} {'':6s} {'after µs':>10s} {'':6s} {'after/before':>12s}"
    )
    for case, e in result["cases"].items():
        print(
            f"{case:32s} {e['before']:10.1f} {e['before_backend'][:6]:6s} "
            f"{e['after']:10.1f} {e['after_backend'][:6]:6s} {e['ratio']:12.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="one process's timings, as JSON")
    parser.add_argument("--before", type=Path, help="the checkout to compare against")
    parser.add_argument("--after", type=Path, default=HERE.parents[1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--only", help="only the cases matching this regular expression")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.only)))
        return
    if args.before is None:
        parser.error("--before is required (or --measure)")
    result = compare(args.before, args.after, args.rounds, args.only)
    _print(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
