"""The inputs every benchmark reads and the calls it times: normlab backends and reference points.

Shared by the matrix (``bench_matrix.py``) and the peak-memory probe (``memory.py``), so both
measure the very same calls. The reference points, on the same inputs:

- ``torch``: ``torch.nn.functional.layer_norm`` (the peer), on a zero-copy view of ``x``;
- ``textbook``: ``(x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
  * w + b`` in NumPy;
- ``copy`` and ``copyto``: a copy round trip of the same bytes (the limit), into a new array
  (``x.copy()``, matched to allocating calls) and into an existing one (``np.copyto``, matched
  to ``out=`` calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np

import normlab
from normlab.registry import Backend

__all__ = [
    "EPS",
    "REFERENCES",
    "backend_call",
    "completing",
    "make_input",
    "make_params",
    "numpy_dtype",
    "reference_call",
]

EPS: Final = 1e-5
REFERENCES: Final = ("torch", "textbook", "copy", "copyto")
#: Elements generated per random chunk: keeps the generator's temporaries small.
_CHUNK_ELEMENTS: Final = 1 << 20

Call = Callable[[], Any]


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype called ``name`` (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def make_input(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Standard-normal activations of ``shape`` and ``dtype``, filled chunk by chunk.

    Filling in chunks keeps the peak memory of making ``x`` at ``x`` plus a few MiB, which the
    peak-memory probe relies on.
    """
    x = np.empty(shape, numpy_dtype(dtype))
    rows = x.reshape(-1, shape[-1])
    step = max(1, _CHUNK_ELEMENTS // shape[-1])
    rng = np.random.default_rng(seed)
    for start in range(0, rows.shape[0], step):
        block = rows[start : start + step]
        block[...] = rng.standard_normal(block.shape, np.float32)
    return x


def make_params(cols: int, dtype: str, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` and ``bias`` near 1 and 0, in x's dtype or float32 for half types."""
    param_dtype = np.dtype(np.float32 if dtype in ("float16", "bfloat16") else dtype)
    rng = np.random.default_rng(seed)
    weight = (1 + 0.1 * rng.standard_normal(cols)).astype(param_dtype)
    bias = (0.1 * rng.standard_normal(cols)).astype(param_dtype)
    return weight, bias


def backend_call(
    backend: Backend, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, out: bool
) -> Call:
    """``normlab.layer_norm`` through ``backend``, on its own copies of the inputs."""
    xb, wb, bb = (backend.from_numpy(a) for a in (x, weight, bias))
    name = backend.name
    if out:
        yb = backend.from_numpy(np.empty_like(x))
        return completing(
            lambda: normlab.layer_norm(xb, weight=wb, bias=bb, backend=name, out=yb), xb
        )
    return completing(lambda: normlab.layer_norm(xb, weight=wb, bias=bb, backend=name), xb)


def completing(call: Call, sample: Any) -> Call:
    """``call``, made to wait for its result when arrays like ``sample`` are asynchronous.

    JAX returns before the work is done (``block_until_ready`` waits) and Dask returns a lazy
    graph (``compute`` runs it); either way the timer must see the work itself. A backend
    function called directly returns ``(y, mean, rstd)``: its ``y`` is waited for.
    """
    method = next((m for m in ("block_until_ready", "compute") if hasattr(sample, m)), None)
    if method is None:
        return call
    return lambda: getattr(_y(call()), method)()


def _y(result: Any) -> Any:
    return result[0] if isinstance(result, tuple) else result


def reference_call(name: str, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> Call:
    """The reference point ``name`` (one of :data:`REFERENCES`) on these inputs."""
    if name == "torch":
        import torch

        xt, wt, bt = (_torch_view(a) for a in (x, weight, bias))
        shape = (x.shape[-1],)
        return lambda: torch.nn.functional.layer_norm(xt, shape, wt, bt, EPS)
    if name == "textbook":
        return lambda: (
            (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS) * weight
            + bias
        )
    if name == "copy":
        return x.copy
    if name == "copyto":
        y = np.empty_like(x)
        return lambda: np.copyto(y, x)
    raise ValueError(f"unknown reference {name!r}; known: {', '.join(REFERENCES)}")


def _torch_view(a: np.ndarray) -> Any:
    """A tensor sharing ``a``'s memory (bfloat16 reinterpreted through int16)."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
