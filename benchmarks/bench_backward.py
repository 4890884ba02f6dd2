"""A training step's normalization inside torch autograd: normlab's modules beside torch's, on CPU.

The matrix (``bench_matrix.py``) times the backward kernels alone against torch autograd's
backward (see docs/performance.md). This file times what it does not: the forward and the
backward together through autograd, module against module, as in training. Each group, on the
same ``x``, ``dy`` and parameters (all cores), times ``module(x).backward(dy)`` for

* ``torch``: ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``;
* each backend that keeps the graph of torch tensors on the op (``normlab.dispatch.keeps_graph``):
  ``normlab.torch.LayerNorm`` / ``RMSNorm`` with ``backend=`` that name (the core runs numba
  through normlab's custom ops, forward and backward kernels inside autograd; the torch backend
  through torch's own functions).

GB/s in ``extra_info`` count ``x`` read and ``y`` written by the forward, ``x`` and ``dy`` read
and ``dx`` written by the backward (5 x the bytes of x), over the median time. Each contender
gets an untimed warm-up call (JIT compilation excluded). Run with::

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

import pytest

import normlab
from normlab import dispatch

torch = pytest.importorskip("torch")

SHAPES: Final = ((8192, 1024), (2048, 4096), (32768, 768), (32, 768))
DTYPES: Final = ("float32", "bfloat16")
MODULES: Final = {"layer_norm": "LayerNorm", "rms_norm": "RMSNorm"}
#: Timed rounds per case; small inputs repeat within a round.
ROUNDS: Final = 15
SMALL_ELEMENTS: Final = 1 << 16
SMALL_ITERATIONS: Final = 50
EPS: Final = 1e-5


def _contenders() -> list[Any]:
    """``(op, name)`` for torch and each backend that keeps the graph of torch tensors on the
    op (``normlab.dispatch.keeps_graph``; unavailable: a skip)."""
    params = []
    for op in MODULES:
        params.append(pytest.param((op, "torch-module"), id=f"{op}-torch-module"))
        for backend in normlab.list_backends():
            case = (op, backend.name)
            torch_family = "torch" in backend.families | backend.explicit_families
            if not torch_family or op not in backend.ops or not dispatch.keeps_graph(backend, op):
                continue
            marks = []
            if not backend.available:
                reason = f"backend {backend.name!r} is unavailable: {backend.reason}"
                marks.append(pytest.mark.skip(reason=reason))
            params.append(pytest.param(case, id=f"{op}-{backend.name}", marks=marks))
    return params


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


def _call(op: str, name: str, data: dict[str, Any]) -> Callable[[], Any]:
    """``module(x).backward(dy)`` for torch's module or normlab's on backend ``name``."""
    x, dy, weight, bias = data["x"], data["dy"], data["weight"], data["bias"]
    cols = (x.shape[1],)
    if name == "torch-module":
        module = getattr(torch.nn, MODULES[op])(cols, EPS)
    else:
        import normlab.torch as normlab_torch

        module = getattr(normlab_torch, MODULES[op])(cols, EPS, backend=name)
    with torch.no_grad():
        module.weight.copy_(weight)
        if op == "layer_norm":
            module.bias.copy_(bias)
    xg = x.detach().requires_grad_()
    return lambda: module(xg).backward(dy)


@pytest.mark.parametrize("contender", _contenders())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_autograd(
    benchmark: Any, shape: tuple[int, int], dtype: str, contender: tuple[str, str]
) -> None:
    op, name = contender
    torch.set_num_threads(os.cpu_count() or 1)
    data = _input(shape, dtype)
    benchmark.group = f"{op} autograd {dtype} {shape[0]}x{shape[1]}"
    call = _call(op, name, data)
    call()  # warm-up: JIT compilation (or the cache load) and first-touch page faults
    small = shape[0] * shape[1] < SMALL_ELEMENTS
    iterations = SMALL_ITERATIONS if small else 1
    benchmark.pedantic(call, rounds=ROUNDS, iterations=iterations, warmup_rounds=1)
    nbytes = 5 * data["x"].numel() * data["x"].element_size()
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        {
            "kind": "autograd",
            "op": op,
            "subject": name,
            "shape": list(shape),
            "dtype": dtype,
            "bytes": nbytes,
            "gbps": nbytes / median / 1e9,
        }
    )


def ratios(path: Path) -> str:
    """A table of torch's module's median time over each contender's, per group."""
    runs = json.loads(path.read_text())["benchmarks"]
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run["group"], {})[run["extra_info"]["subject"]] = run
    lines = [f"{'group':<36} {'contender':<14} {'ms':>9} {'torch / it':>11} {'GB/s':>7}"]
    for group, subjects in groups.items():
        peer = subjects.get("torch-module")
        for subject, run in subjects.items():
            seconds = run["stats"]["median"]
            ratio = f"{peer['stats']['median'] / seconds:11.2f}" if peer else f"{'-':>11}"
            gbps = run["extra_info"]["gbps"]
            lines.append(f"{group:<36} {subject:<14} {seconds * 1e3:9.3f} {ratio} {gbps:7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        saved = Path(folder) / "autograd.json"
        status = pytest.main(
            [__file__, "--benchmark-only", "-q", "-p", "no:cacheprovider",
             f"--benchmark-json={saved}", *sys.argv[1:]]
        )  # fmt: skip
        if saved.exists():
            print(ratios(saved))
    sys.exit(int(status))
