"""The inputs every benchmark reads and the calls it times: normlab ops and reference points.

Shared by the matrix (``bench_matrix.py``) and the peak-memory probe (``memory.py``), so both
measure the very same calls. Four ops are timed (:data:`OPS`): the forwards ``layer_norm`` and
``rms_norm``, and the backwards ``layer_norm_backward`` and ``rms_norm_backward`` (the backward
alone, from the statistics the forward returned). The reference points, on the same inputs:

- ``torch``: the peer on a zero-copy view of the inputs, on all cores:
  ``torch.nn.functional.layer_norm`` / ``rms_norm`` for the forwards; for the backwards, torch
  autograd's backward of the same call alone: ``torch.autograd.grad(y, (x, weight[, bias]), dy,
  retain_graph=True)`` on a ``y`` computed once beforehand (the forward is not timed);
- ``textbook`` (layer_norm only): ``(x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1,
  keepdims=True) + eps) * w + b`` in NumPy;
- ``copy`` and ``copyto`` (:data:`LIMITS`, shared by every op of an input): a copy round trip of
  ``x`` (the limit), into a new array (``x.copy()``, matched to allocating calls) and into an
  existing one (``np.copyto``, matched to ``out=`` calls).

The full matrix adds the peers of the forwards (:data:`peers.PEERS`: ONNX Runtime allocating and
through an io_binding, ``torch.compile``), built by ``peers.py`` on these inputs and called by
the matrix beside the references.

The fused ops (:data:`FUSED`: ``add_layer_norm``, ``add_rms_norm``) are timed on CPU torch
tensors (views of the same NumPy inputs plus a ``residual``) by :func:`fused_call`: normlab's
fused call with numba named (pre-norm ``(y, h)``, and the post-norm form ``y`` alone) and with
no backend named; their references (:data:`FUSED_REFERENCES`) are the unfused pair on the same
tensors: torch eager's add then ``normlab.layer_norm``/``rms_norm`` on numba (``add_numba``),
and torch eager's add then ``F.layer_norm``/``F.rms_norm`` (``torch``); the full matrix adds
``torch.compile`` of that torch pair.

The backwards get ``dy`` and the statistics (``return_stats=True`` of the forward) from the
:class:`Workload`; all ops read the same ``x``, ``weight`` and ``bias``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any, Final

import numpy as np

import normlab
from normlab.ops import BACKWARD_OPS, FORWARD_OPS, FUSED_OPS
from normlab.registry import Backend
from normlab.testing.conversions import numpy_dtype

__all__ = [
    "EPS",
    "FUSED",
    "FUSED_REFERENCES",
    "LIMITS",
    "OPS",
    "REFERENCES",
    "Workload",
    "backend_call",
    "completing",
    "fused_call",
    "make_input",
    "make_params",
    "moved_bytes",
    "reference_call",
    "torch_forward",
]

EPS: Final = 1e-5
OPS: Final = FORWARD_OPS + BACKWARD_OPS
#: The reference points of each op, besides the copy limits that every op shares.
REFERENCES: Final = {
    "layer_norm": ("torch", "textbook"),
    "rms_norm": ("torch",),
    "layer_norm_backward": ("torch",),
    "rms_norm_backward": ("torch",),
}
LIMITS: Final = ("copy", "copyto")
#: The fused ops (residual add + norm) and the unfused pairs they are measured against.
FUSED: Final = FUSED_OPS
FUSED_REFERENCES: Final = ("add_numba", "torch")
#: A fused call's modes: ``alloc`` returns ``(y, h)`` (pre-norm), ``post`` returns ``y`` alone
#: (``return_residual=False``, post-norm: ``h`` is never written).
FUSED_MODES: Final = ("alloc", "post")
#: Elements generated per random chunk: keeps the generator's temporaries small.
_CHUNK_ELEMENTS: Final = 1 << 20

Call = Callable[[], Any]


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


class Workload:
    """The NumPy operands of one (shape, dtype): ``x``, ``weight`` and ``bias`` at once;
    ``dy`` and the forward's statistics when a backward first asks for them."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.shape = shape
        self.dtype = dtype
        self.x = make_input(shape, dtype)
        self.weight, self.bias = make_params(shape[-1], dtype)

    @cached_property
    def residual(self) -> np.ndarray:
        """The residual stream the fused ops add to ``x``: standard normal, like ``x``."""
        return make_input(self.shape, self.dtype, seed=3)

    @cached_property
    def dy(self) -> np.ndarray:
        """The upstream gradient: standard normal, like ``x``."""
        return make_input(self.shape, self.dtype, seed=2)

    @cached_property
    def layer_norm_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """``(mean, rstd)`` of ``layer_norm(x, weight, bias)``, keepdims-shaped."""
        _, mean, rstd = normlab.layer_norm(
            self.x, None, self.weight, self.bias, EPS, return_stats=True
        )
        return np.asarray(mean), np.asarray(rstd)

    @cached_property
    def rms_norm_stats(self) -> np.ndarray:
        """``rstd`` of ``rms_norm(x, weight)``, keepdims-shaped."""
        _, rstd = normlab.rms_norm(self.x, None, self.weight, EPS, return_stats=True)
        return np.asarray(rstd)


def moved_bytes(op: str, data: Workload, mode: str = "alloc") -> int:
    """The bytes a call of ``op`` must move at least: the numerator of its GB/s.

    Forwards: ``x`` read and ``y`` written. Fused ops: ``x`` and ``residual`` read, ``h`` and
    ``y`` written (``mode="post"``: no ``h``); the unfused pairs they are compared with count
    the same bytes (they move more: ``h`` written and read again). Backwards: ``x`` and ``dy``
    read and ``dx`` written, plus the small per-row and per-column traffic: the statistics
    read (``mean`` and ``rstd``, or ``rstd``), ``weight`` read and its gradients written
    (``dweight``, and ``dbias`` for layer_norm). Scratch inside a kernel (partial sums) is not
    counted.
    """
    rows = data.x.size // data.shape[-1]
    if op in ("layer_norm", "rms_norm"):
        return 2 * data.x.nbytes
    if op in FUSED:
        return (3 if mode == "post" else 4) * data.x.nbytes
    stats = 2 if op == "layer_norm_backward" else 1
    stats_itemsize = 8 if data.dtype == "float64" else 4
    grads = 2 if op == "layer_norm_backward" else 1
    return 3 * data.x.nbytes + stats * rows * stats_itemsize + (1 + grads) * data.weight.nbytes


def backend_call(op: str, backend: Backend, data: Workload, out: bool) -> Call:
    """``normlab.<op>`` through ``backend`` (named, so strict), on its own copies of the inputs.

    ``out``: the forward writes into an existing array (the backwards have no ``out=``).
    """
    name = backend.name
    xb, wb, bb = (backend.from_numpy(a) for a in (data.x, data.weight, data.bias))
    if op == "layer_norm_backward":
        dyb = backend.from_numpy(data.dy)
        mean, rstd = (backend.from_numpy(a) for a in data.layer_norm_stats)
        return completing(
            lambda: normlab.layer_norm_backward(dyb, xb, mean, rstd, wb, backend=name), xb
        )
    if op == "rms_norm_backward":
        dyb = backend.from_numpy(data.dy)
        rstd = backend.from_numpy(data.rms_norm_stats)
        return completing(lambda: normlab.rms_norm_backward(dyb, xb, rstd, wb, backend=name), xb)
    yb = backend.from_numpy(np.empty_like(data.x)) if out else None
    if op == "rms_norm":
        return completing(lambda: normlab.rms_norm(xb, None, wb, EPS, backend=name, out=yb), xb)
    if op == "layer_norm":
        return completing(
            lambda: normlab.layer_norm(xb, None, wb, bb, EPS, backend=name, out=yb), xb
        )
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


#: normlab's own choice (no backend named) on inputs of each family: the matrix's "auto" rows.
AUTO: Final = {"auto": "numpy", "auto-torch": "torch"}
#: Backends timed on CPU torch tensors, which they serve zero-copy beside their own arrays (the
#: rows that ``auto-torch`` is judged against with the torch backend's), by row name.
ON_TORCH: Final = {"numba-torch": "numba"}


def auto_call(op: str, subject: str, data: Workload) -> Call:
    """``normlab.<op>`` on inputs of the family of ``subject``, dispatch included: with no
    backend named (:data:`AUTO`: what a user calling normlab gets), or on CPU torch tensors
    with the backend of :data:`ON_TORCH` named."""
    family = AUTO.get(subject, "torch")
    named = ON_TORCH.get(subject)
    convert = (lambda a: a) if family == "numpy" else _torch_view
    x, weight, bias = (convert(a) for a in (data.x, data.weight, data.bias))
    if op == "layer_norm_backward":
        dy = convert(data.dy)
        mean, rstd = (convert(a) for a in data.layer_norm_stats)
        return lambda: normlab.layer_norm_backward(dy, x, mean, rstd, weight, backend=named)
    if op == "rms_norm_backward":
        dy, rstd = convert(data.dy), convert(data.rms_norm_stats)
        return lambda: normlab.rms_norm_backward(dy, x, rstd, weight, backend=named)
    if op == "rms_norm":
        return lambda: normlab.rms_norm(x, None, weight, EPS, backend=named)
    if op == "layer_norm":
        return lambda: normlab.layer_norm(x, None, weight, bias, EPS, backend=named)
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def fused_call(op: str, subject: str, mode: str, data: Workload) -> Call:
    """A fused op's contender on CPU torch tensors viewing ``data`` (``x``, ``residual``,
    ``weight`` and ``bias``, shared by every contender of the input).

    ``subject``: a backend named (``"numba"``) or ``"auto-torch"`` (none named): normlab's
    fused call, returning ``(y, h)``, or ``y`` alone when ``mode`` is ``"post"``. The
    references (:data:`FUSED_REFERENCES`): ``"add_numba"``, torch eager's ``x + residual``
    then normlab's base op on numba; ``"torch"``, the same add then ``F.layer_norm`` /
    ``F.rms_norm`` (its weight in x's dtype, as for the rms_norm reference). Both return
    ``(y, h)``.
    """
    import torch.nn.functional as F

    x, residual = _torch_view(data.x), _torch_view(data.residual)
    weight, bias = _torch_view(data.weight), _torch_view(data.bias)
    shape = (data.shape[-1],)
    layer = op == "add_layer_norm"
    weight_x = weight.to(x.dtype)

    # The pairs call their ops directly (no helper in between): no extra Python call is timed.
    def torch_layer_norm() -> tuple[Any, Any]:
        h = x + residual
        return F.layer_norm(h, shape, weight, bias, EPS), h

    def torch_rms_norm() -> tuple[Any, Any]:
        h = x + residual
        return F.rms_norm(h, shape, weight_x, EPS), h

    def numba_layer_norm() -> tuple[Any, Any]:
        h = x + residual
        return normlab.layer_norm(h, None, weight, bias, EPS, backend="numba"), h

    def numba_rms_norm() -> tuple[Any, Any]:
        h = x + residual
        return normlab.rms_norm(h, None, weight, EPS, backend="numba"), h

    if subject == "torch":
        return torch_layer_norm if layer else torch_rms_norm
    if subject == "add_numba":
        return numba_layer_norm if layer else numba_rms_norm
    named = None if subject in AUTO else subject
    keep = mode != "post"
    if layer:
        return lambda: normlab.add_layer_norm(
            x, residual, None, weight, bias, EPS, backend=named, return_residual=keep
        )
    return lambda: normlab.add_rms_norm(
        x, residual, None, weight, EPS, backend=named, return_residual=keep
    )


def completing(call: Call, sample: Any) -> Call:
    """``call``, made to wait for its result when arrays like ``sample`` are asynchronous.

    JAX returns before the work is done (``block_until_ready`` waits) and Dask returns a lazy
    graph (``compute`` runs it); either way the timer must see the work itself. A call that
    returns a tuple (a backward's gradients, a backend function's ``(y, mean, rstd)``) is
    waited for on its first entry.
    """
    method = next((m for m in ("block_until_ready", "compute") if hasattr(sample, m)), None)
    if method is None:
        return call
    return lambda: getattr(_first(call()), method)()


def _first(result: Any) -> Any:
    return result[0] if isinstance(result, tuple) else result


def reference_call(op: str, name: str, data: Workload) -> Call:
    """The reference point ``name`` of ``op`` (see :data:`REFERENCES`, :data:`LIMITS`); the
    peers of the full matrix are ``peers.call``'s."""
    x, weight, bias = data.x, data.weight, data.bias
    if name == "copy":
        return x.copy
    if name == "copyto":
        y = np.empty_like(x)
        return lambda: np.copyto(y, x)
    if name not in REFERENCES.get(op, ()):
        known = ", ".join((*REFERENCES.get(op, ()), *LIMITS))
        raise ValueError(f"unknown reference {name!r} of {op!r}; known: {known}")
    if name == "textbook":
        return lambda: (
            (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS) * weight
            + bias
        )
    return _torch_call(op, data)


def _torch_call(op: str, data: Workload) -> Call:
    """torch's forward, or torch autograd's backward alone, on views of ``data``.

    Called directly, not through :func:`torch_forward`'s function: no extra Python call is
    timed. torch's rms_norm gets its weight in x's dtype: with a float32 weight on half input
    it warns and takes a slower path, and ``torch.nn.RMSNorm(dtype=...)`` holds it so anyway.
    """
    import torch
    import torch.nn.functional as F

    shape = (data.shape[-1],)
    x = _torch_view(data.x)
    weight = _torch_view(data.weight)
    if op.startswith("rms_norm"):
        weight = weight.to(x.dtype)
    bias = _torch_view(data.bias)
    if op == "layer_norm":
        return lambda: F.layer_norm(x, shape, weight, bias, EPS)
    if op == "rms_norm":
        return lambda: F.rms_norm(x, shape, weight, EPS)
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    if op == "layer_norm_backward":
        y = F.layer_norm(leaves[0], shape, leaves[1], leaves[2], EPS)
    else:
        leaves = leaves[:2]
        y = F.rms_norm(leaves[0], shape, leaves[1], EPS)
    dy = _torch_view(data.dy)
    return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)


def torch_forward(op: str, data: Workload) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """torch's forward of ``op`` as a function and its arguments (views of ``data``): the
    torch eager reference's call, for the ``torch_compile`` peer to compile (rms_norm's weight
    in x's dtype, as there); for a fused op, the unfused pair returning ``(y, h)``."""
    import torch.nn.functional as F

    shape = (data.shape[-1],)
    x, weight = _torch_view(data.x), _torch_view(data.weight)
    if op == "add_layer_norm":

        def add_layer_norm(x: Any, residual: Any, weight: Any, bias: Any) -> Any:
            h = x + residual
            return F.layer_norm(h, shape, weight, bias, EPS), h

        residual, bias = _torch_view(data.residual), _torch_view(data.bias)
        return add_layer_norm, (x, residual, weight, bias)
    if op == "add_rms_norm":

        def add_rms_norm(x: Any, residual: Any, weight: Any) -> Any:
            h = x + residual
            return F.rms_norm(h, shape, weight, EPS), h

        return add_rms_norm, (x, _torch_view(data.residual), weight.to(x.dtype))
    if op == "layer_norm":
        bias = _torch_view(data.bias)

        def layer_norm(x: Any, weight: Any, bias: Any) -> Any:
            return F.layer_norm(x, shape, weight, bias, EPS)

        return layer_norm, (x, weight, bias)
    if op == "rms_norm":

        def rms_norm(x: Any, weight: Any) -> Any:
            return F.rms_norm(x, shape, weight, EPS)

        return rms_norm, (x, weight.to(x.dtype))
    raise ValueError(f"no torch forward for {op!r}")


def _torch_view(a: np.ndarray) -> Any:
    """A tensor sharing ``a``'s memory (bfloat16 reinterpreted through int16)."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
