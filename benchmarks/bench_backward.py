"""LayerNorm forward + backward beside torch on CPU: a pytest-benchmark group per shape and dtype.

Each group times, on the same ``x``, ``dy``, weight and bias (all cores):

* ``torch``: ``torch.nn.functional.layer_norm`` on tensors that require grad, then
  ``y.backward(dy)`` (torch's own kernels and autograd);
* ``numba``: ``normlab.layer_norm(..., return_stats=True)`` then ``normlab.layer_norm_backward``
  on NumPy arrays, ``backend="numba"``;
* ``numba_autograd``: ``normlab.torch.LayerNorm(backend="numba")`` on tensors that require grad,
  then ``y.backward(dy)`` (normlab's custom ops inside torch autograd);
* ``numpy`` and ``normlab_torch``: the same two public calls on the numpy and torch backends;
* ``torch_backward`` and ``numba_backward``: the backward alone, from saved statistics
  (``torch.ops.aten.native_layer_norm_backward`` and ``normlab.layer_norm_backward``).

GB/s in ``extra_info`` count the backward's traffic, ``x`` and ``dy`` read and ``dx`` written
(3 x the bytes of x), over the median time, in every row, so rows compare directly. Each
contender gets an untimed warm-up call (JIT compilation excluded). Run with::

    python -m pytest benchmarks/bench_backward.py --benchmark-only -q
    python benchmarks/bench_backward.py          # the same, then a table of ratios to torch
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import registry

torch = pytest.importorskip("torch")

SHAPES: Final = ((8192, 1024), (2048, 4096), (32768, 768), (32, 768))
DTYPES: Final = ("float32", "bfloat16")
CONTENDERS: Final = (
    "torch",
    "numba",
    "numba_autograd",
    "numpy",
    "normlab_torch",
    "torch_backward",
    "numba_backward",
)
#: Timed rounds per case; small inputs repeat within a round.
ROUNDS: Final = 15
SMALL_ELEMENTS: Final = 1 << 16
SMALL_ITERATIONS: Final = 50
EPS: Final = 1e-5

_inputs: dict[tuple[tuple[int, int], str], dict[str, Any]] = {}


def _input(shape: tuple[int, int], dtype: str) -> dict[str, Any]:
    """x, dy, weight and bias as tensors (float32 parameters for bfloat16 x), made once."""
    key = (shape, dtype)
    if key not in _inputs:
        _inputs.clear()  # one large input at a time
        generator = torch.Generator().manual_seed(0)
        tdtype = getattr(torch, dtype)
        _inputs[key] = {
            "x": torch.randn(shape, generator=generator).to(tdtype),
            "dy": torch.randn(shape, generator=generator).to(tdtype),
            "weight": torch.randn(shape[1], generator=generator),
            "bias": torch.randn(shape[1], generator=generator),
        }
    return _inputs[key]


def _numpy(t: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor (bfloat16 through ml_dtypes)."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # type: ignore[no-any-return]
    return t.numpy()  # type: ignore[no-any-return]


def _require(backend: str, capability: str | None = None) -> None:
    record = registry.get(backend)
    if not record.available:
        pytest.skip(f"backend {backend!r} is unavailable: {record.reason}")
    if "layer_norm_backward" not in record.ops:
        pytest.skip(f"backend {backend!r} does not provide layer_norm_backward")
    if capability is not None and capability not in record.capabilities:
        pytest.skip(f"backend {backend!r} does not claim {capability!r}")


def _call(contender: str, data: dict[str, Any]) -> Callable[[], Any]:
    """A no-argument callable running ``contender`` on ``data``."""
    x, dy, weight, bias = data["x"], data["dy"], data["weight"], data["bias"]
    cols = (x.shape[1],)
    if contender in ("torch", "numba_autograd"):
        xg = x.detach().requires_grad_()
        if contender == "torch":
            wg, bg = weight.detach().requires_grad_(), bias.detach().requires_grad_()

            def forward() -> Any:
                return torch.nn.functional.layer_norm(xg, cols, wg, bg, EPS)

        else:
            _require("numba", "autograd")
            import normlab.torch as normlab_torch

            module = normlab_torch.LayerNorm(cols, EPS, backend="numba")
            with torch.no_grad():
                module.weight.copy_(weight)
                module.bias.copy_(bias)

            def forward() -> Any:
                return module(xg)

        return lambda: forward().backward(dy)
    if contender == "torch_backward":
        w, b = weight.to(x.dtype), bias.to(x.dtype)
        _, mean, rstd = torch.native_layer_norm(x, cols, w, b, EPS)
        mask = (True, True, True)
        return lambda: torch.ops.aten.native_layer_norm_backward(
            dy, x, cols, mean, rstd, w, b, mask
        )
    backend = {"numba": "numba", "numba_backward": "numba", "numpy": "numpy"}.get(
        contender, "torch"
    )
    _require(backend)
    arrays = (
        [_numpy(t) for t in (x, dy, weight, bias)] if backend != "torch" else [x, dy, weight, bias]
    )
    xa, dya, wa, ba = arrays
    if contender == "numba_backward":
        _, mean, rstd = normlab.layer_norm(
            xa, None, wa, ba, EPS, backend="numba", return_stats=True
        )
        return lambda: normlab.layer_norm_backward(dya, xa, mean, rstd, wa, backend="numba")

    def forward_backward() -> Any:
        _, mean, rstd = normlab.layer_norm(
            xa, None, wa, ba, EPS, backend=backend, return_stats=True
        )
        return normlab.layer_norm_backward(dya, xa, mean, rstd, wa, backend=backend)

    return forward_backward


@pytest.mark.parametrize("contender", CONTENDERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_backward(benchmark: Any, shape: tuple[int, int], dtype: str, contender: str) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    data = _input(shape, dtype)
    benchmark.group = f"backward {dtype} {shape[0]}x{shape[1]}"
    call = _call(contender, data)
    call()  # warm-up: JIT compilation (or the cache load) and first-touch page faults
    small = shape[0] * shape[1] < SMALL_ELEMENTS
    iterations = SMALL_ITERATIONS if small else 1
    benchmark.pedantic(call, rounds=ROUNDS, iterations=iterations, warmup_rounds=1)
    nbytes = 3 * data["x"].numel() * data["x"].element_size()
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        {
            "kind": "backward",
            "subject": contender,
            "shape": list(shape),
            "dtype": dtype,
            "bytes": nbytes,
            "gbps": nbytes / median / 1e9,
        }
    )


def ratios(path: Path) -> str:
    """A table of each contender's median time over torch's, per group, from a saved run."""
    runs = json.loads(path.read_text())["benchmarks"]
    groups: dict[str, dict[str, float]] = {}
    for run in runs:
        groups.setdefault(run["group"], {})[run["extra_info"]["subject"]] = run["stats"]["median"]
    lines = [f"{'group':<30} {'contender':<16} {'ms':>9} {'torch / it':>11} {'GB/s':>7}"]
    for group, times in groups.items():
        for subject, seconds in times.items():
            peer = times.get("torch_backward" if subject.endswith("_backward") else "torch")
            ratio = f"{peer / seconds:11.2f}" if peer else f"{'-':>11}"
            gbps = next(
                r["extra_info"]["gbps"] for r in runs
                if r["group"] == group and r["extra_info"]["subject"] == subject
            )  # fmt: skip
            lines.append(f"{group:<30} {subject:<16} {seconds * 1e3:9.3f} {ratio} {gbps:7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        saved = Path(folder) / "backward.json"
        status = pytest.main(
            [__file__, "--benchmark-only", "-q", "-p", "no:cacheprovider",
             f"--benchmark-json={saved}", *sys.argv[1:]]
        )  # fmt: skip
        if saved.exists():
            print(ratios(saved))
    sys.exit(int(status))
