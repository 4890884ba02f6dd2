"""The torch backend's backward on CPU, a block of rows at a time: results bitwise those of one
pass over the whole batch, and peak memory of the result plus O(block) (it took 5x the input
in float32 and 11x in float16 when every temporary was batch-sized)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

import normlab

torch = pytest.importorskip("torch")
from normlab.backends import torch_backend  # noqa: E402  (after torch's importorskip)

ONE_PASS = 1 << 62  # ONE_BLOCK_ELEMENTS that makes any batch a single block
DTYPES = ["float32", "float16", "bfloat16", "float64"]
NEEDS = [("x", "weight", "bias"), ("x",), ("weight", "bias")]
SHAPES = [(1, 9), (31, 9), (33, 40000), (65, 24), (97, 130), (200, 64)]


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch reduces a lone row with a split that depends on the thread count (a row among
    others, with one thread per row): two threads show it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _same_bits(a: list[Any], b: list[Any]) -> bool:
    return all(
        (s is None and t is None)
        or (
            s is not None
            and t is not None
            and s.dtype == t.dtype
            and s.shape == t.shape
            and torch.equal(s.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))
        )
        for s, t in zip(a, b, strict=True)
    )


def _gradients(op: str, dtype: str, rows: int, cols: int, needs: tuple[str, ...]) -> list[Any]:
    g = torch.Generator().manual_seed(rows * cols)
    x = (3 + torch.randn(rows, cols, generator=g, dtype=torch.float64)).to(getattr(torch, dtype))
    dy = torch.randn(rows, cols, generator=g, dtype=torch.float64).to(x.dtype)
    weight = torch.randn(cols, generator=g, dtype=torch.float64).to(x.dtype)
    if op == "layer_norm":
        _, mean, rstd = normlab.layer_norm(x, weight=weight, backend="torch", return_stats=True)
        grads = normlab.layer_norm_backward(dy, x, mean, rstd, weight, backend="torch", needs=needs)
    else:
        _, rstd = normlab.rms_norm(x, weight=weight, backend="torch", return_stats=True)
        grads = normlab.rms_norm_backward(
            dy, x, rstd, weight, backend="torch", needs=tuple(n for n in needs if n != "bias")
        )
    return list(grads)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_of_rows_give_the_bits_of_one_pass(
    op: str, dtype: str, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of one chunk (32 rows, the smallest) against one block, on shapes with a short
    last chunk, a last block of one row (33, 65, 97 rows) and a single row."""
    for rows, cols in SHAPES:
        for needs in NEEDS if cols < 1000 else NEEDS[:1]:
            monkeypatch.setattr(torch_backend, "ONE_BLOCK_ELEMENTS", ONE_PASS)
            assert len(torch_backend._row_blocks(rows, cols)) == 2
            one_pass = _gradients(op, dtype, rows, cols, needs)
            monkeypatch.setattr(torch_backend, "ONE_BLOCK_ELEMENTS", 0)
            monkeypatch.setattr(torch_backend, "ROW_BLOCK_ELEMENTS", 1)
            bounds = torch_backend._row_blocks(rows, cols)
            sizes = [stop - start for start, stop in itertools.pairwise(bounds)]
            assert set(sizes[:-1]) <= {32} and sum(sizes) == rows, sizes
            assert rows == 1 or sizes[-1] >= 2, sizes  # a lone last row joins the block before
            blocked = _gradients(op, dtype, rows, cols, needs)
            assert _same_bits(blocked, one_pass), (rows, cols, needs)


PEAK = textwrap.dedent(
    """
    import json, sys
    import torch
    import normlab

    def rss(field):
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith(field))
        return int(line.split()[1]) * 1024

    def inputs(rows, cols):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, cols, generator=g).to(torch.float16)
        dy = torch.randn(rows, cols, generator=g).to(torch.float16)
        weight = torch.randn(cols, generator=g).to(torch.float16)
        _, mean, rstd = normlab.layer_norm(x, weight=weight, backend="torch", return_stats=True)
        return dy, x, mean, rstd, weight

    rows, cols = int(sys.argv[1]), int(sys.argv[2])
    normlab.layer_norm_backward(*inputs(64, cols), backend="torch")  # code loaded
    args = inputs(rows, cols)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak RSS (VmHWM) starts again from the RSS of now
    before = rss("VmRSS:")
    dx, dweight, dbias = normlab.layer_norm_backward(*args, backend="torch")
    print(json.dumps({"growth": rss("VmHWM:") - before, "dx": dx.nbytes}))
    """
)


def test_peak_memory_of_the_backward_is_the_result_plus_a_block() -> None:
    """Measured in a subprocess (peak RSS): the backward of a (2048, 4096) float16 batch
    (16 MiB) needs its 16 MiB dx and at most 32 MiB more (it took 11x the input, 176 MiB,
    before); the block temporaries and the 32-row chunk sums take about 10 MiB."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("the peak RSS is reset through Linux's /proc/self/clear_refs")
    result = subprocess.run(
        [sys.executable, "-c", PEAK, "2048", "4096"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # the lower bound: the measurement saw the result being written (it is not vacuous)
    assert report["dx"] // 2 <= report["growth"] <= report["dx"] + (32 << 20), report
