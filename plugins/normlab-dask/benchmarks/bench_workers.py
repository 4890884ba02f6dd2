"""Throughput of ``normlab.layer_norm`` on a many-chunk Dask array: 1 worker against 2.

For each worker count a ``LocalCluster`` of worker processes (one thread each, NumPy, BLAS and
Numba held to one thread, on 127.0.0.1) is started; ``x`` is made and persisted on the workers,
then the best of ``--repeats`` timed runs of ``persist(normlab.layer_norm(x))`` is taken. The
result stays on the workers (no transfer to this process), and each run gets fresh task keys.
A copy of the same chunks (``np.copy`` per chunk) is timed alongside as the memory-bound limit.
GB/s counts the bytes of x read and y written. Each chunk is served by normlab's dispatch on
its worker (numba when installed), or by ``--chunk-backend``.

Run: ``python plugins/normlab-dask/benchmarks/bench_workers.py [--rows N --cols N ...]``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import dask.array as da
import normlab
import numpy as np
from dask.graph_manipulation import clone
from distributed import Client, LocalCluster, wait

#: Environment of each worker process: one thread per worker, so workers are the only
#: parallelism measured.
SINGLE_THREAD = {
    "NUMBA_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _best_seconds(client: Client, make: Callable[[], da.Array], x: da.Array, repeats: int) -> float:
    """Best wall time of persisting ``make()`` on the cluster, after one warm-up run. Each run
    gets fresh keys (a clone of the graph above ``x``), so no result is reused."""
    best = float("inf")
    for run in range(repeats + 1):  # run 0 warms up: JIT compilation, imports on every worker
        start = time.perf_counter()
        result = client.persist(clone(make(), omit=x, seed=run))
        wait(result)
        if run:
            best = min(best, time.perf_counter() - start)
        client.cancel(result)
    return best


def measure(workers: int, args: argparse.Namespace) -> dict[str, float]:
    """GB/s of layer_norm and of a chunk copy on a cluster of ``workers`` processes."""
    env = dict(SINGLE_THREAD)
    if args.chunk_backend:
        env["NORMLAB_BACKEND"] = args.chunk_backend
    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            env=env,
        ) as cluster,
        Client(cluster) as client,
    ):
        rng = da.random.default_rng(0)
        shape, chunks = (args.rows, args.cols), (args.chunk_rows, args.cols)
        x = client.persist(rng.standard_normal(shape, chunks=chunks, dtype=args.dtype))
        wait(x)
        moved = 2 * x.nbytes / 1e9
        rates: dict[str, float] = {}
        makers: dict[str, Callable[[], Any]] = {
            "layer_norm": lambda: normlab.layer_norm(x),
            "copy": lambda: x.map_blocks(np.copy),
        }
        for name, make in makers.items():
            rates[name] = moved / _best_seconds(client, make, x, args.repeats)
        return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1 << 17)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-backend", default=None, help="NORMLAB_BACKEND on the workers")
    args = parser.parse_args()
    itemsize = np.dtype(args.dtype).itemsize
    chunks = -(-args.rows // args.chunk_rows)
    print(
        f"machine: {os.cpu_count()} CPU cores; x: {args.dtype} ({args.rows}, {args.cols}) = "
        f"{args.rows * args.cols * itemsize / 2**20:.0f} MiB in {chunks} chunks of "
        f"{args.chunk_rows * args.cols * itemsize / 2**20:.0f} MiB; chunk backend: "
        f"{args.chunk_backend or 'normlab dispatch'}; best of {args.repeats}"
    )
    results = {workers: measure(workers, args) for workers in (1, 2)}
    print(f"{'workers':>7}  {'layer_norm GB/s':>15}  {'copy GB/s':>9}  {'layer_norm/copy':>15}")
    for workers, rates in results.items():
        print(
            f"{workers:>7}  {rates['layer_norm']:>15.2f}  {rates['copy']:>9.2f}  "
            f"{rates['layer_norm'] / rates['copy']:>15.2f}"
        )
    speedup = {name: results[2][name] / results[1][name] for name in ("layer_norm", "copy")}
    print(
        f"2 workers / 1 worker: layer_norm {speedup['layer_norm']:.2f}x, "
        f"copy {speedup['copy']:.2f}x"
    )


if __name__ == "__main__":
    main()
