"""The peers of the full matrix: what a user could call instead of normlab, forwards only.

- ``ort`` and ``ort_iobinding``: ONNX Runtime on the CPU, all cores, running a one-node model
  built here with ``onnx.helper`` (no model file): ``LayerNormalization`` (opset 17) for
  ``layer_norm``; for ``rms_norm``, ``RMSNormalization`` (opset 23) where this onnxruntime has a
  kernel for the dtype, else ORT's own ``SimplifiedLayerNormalization``. ``ort`` is the
  allocating ``session.run`` with NumPy feeds (bfloat16, which NumPy cannot hand to ORT, goes
  through ``run_with_ort_values`` on OrtValues made once); ``ort_iobinding`` writes into a
  preallocated output through an io_binding made once. The model has x's static shape;
  ``weight`` and ``bias`` are given in x's dtype (the ONNX ops take them so). Sessions keep
  ORT's defaults otherwise (as a user gets them), on every core.
- ``torch_compile``: ``torch.compile(dynamic=False)`` (inductor) of the very call the torch
  eager reference times, compiled (and run once) before the timing, on the dtypes of
  :data:`COMPILE_DTYPES` and a subset of shapes (``bench_matrix.COMPILE_SHAPES``): every new
  shape is a compile of its own. For the fused ops (``add_layer_norm``, ``add_rms_norm``) it is
  the only peer: the compiled unfused pair ``h = x + residual; (F.layer_norm(h, ...), h)``, on
  every fused shape.

:func:`unavailable` says at collection time why a peer cannot run here (the library is not
installed, ORT has no kernel for the dtype); :func:`call` raises :class:`PeerUnavailable` when
the peer fails to build on the input itself (torch.compile without a working C++ compiler).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from benchmarks.workloads import EPS, Workload, torch_forward

__all__ = [
    "COMPILE_DTYPES",
    "PEERS",
    "PeerUnavailable",
    "call",
    "onnx_op",
    "unavailable",
]

#: The peers of each op, in report order (the backwards have none here).
PEERS: Final = {
    "layer_norm": ("ort", "ort_iobinding", "torch_compile"),
    "rms_norm": ("ort", "ort_iobinding", "torch_compile"),
    "add_layer_norm": ("torch_compile",),
    "add_rms_norm": ("torch_compile",),
}
#: The dtypes torch.compile is measured on (every (shape, dtype) is a compile of its own).
COMPILE_DTYPES: Final = ("float32", "float16")
LAYER_NORM_OPSET: Final = 17
RMS_NORM_OPSET: Final = 23
#: The IR version the models declare: opset 23's, below what onnx 1.23 writes by default (14)
#: and what onnxruntime 1.31 reads (13 at most).
IR_VERSION: Final = 11
_ONNX_TYPES: Final = {"float32": 1, "float16": 10, "float64": 11, "bfloat16": 16}  # TensorProto
#: ORT's severity levels: 3 keeps errors only (no notices about optimized graphs).
_ORT_ERRORS_ONLY: Final = 3
#: A skip reason quotes this much of ORT's error at most.
_REASON_CHARS: Final = 160


class PeerUnavailable(Exception):
    """The peer cannot run on this input here; the message says why (the case is skipped)."""


def _missing(module: str) -> str | None:
    try:
        __import__(module)
    except ImportError as exc:
        return f"needs {module} ({exc})"
    return None


def unavailable(op: str, name: str, dtype: str) -> str | None:
    """Why the peer ``name`` of ``op`` cannot be measured on ``dtype`` here, or ``None``."""
    if name not in PEERS.get(op, ()):
        raise ValueError(f"unknown peer {name!r} of {op!r}; known: {', '.join(PEERS.get(op, ()))}")
    if name == "torch_compile":
        if dtype not in COMPILE_DTYPES:
            return f"torch.compile is measured on {', '.join(COMPILE_DTYPES)} only"
        return _missing("torch")
    missing = _missing("onnxruntime") or _missing("onnx")
    if missing:
        return f"ONNX Runtime {missing}"
    if dtype not in _ONNX_TYPES:
        return f"ONNX has no {dtype} tensors"
    if dtype == "bfloat16" and _missing("ml_dtypes"):
        return "bfloat16 needs ml_dtypes"
    return _kernel_refusal(op, dtype)


@functools.cache
def _kernel_refusal(op: str, dtype: str) -> str | None:
    """Why ORT cannot run ``op`` on ``dtype`` here (a session on a tiny input fails), or None."""
    try:
        _session(op, dtype, (1, 8))
    except PeerUnavailable as exc:
        return str(exc)
    return None


@functools.cache
def onnx_op(op: str, dtype: str) -> str:
    """The ONNX operator that stands for ``op`` on ``dtype`` in this onnxruntime."""
    if op == "layer_norm":
        return "LayerNormalization"
    try:
        _build_session("RMSNormalization", dtype, (1, 8))
    except Exception:  # no kernel for the dtype: ORT expands the function into missing ops
        return "SimplifiedLayerNormalization"
    return "RMSNormalization"


def _model_bytes(onnx_name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    """A one-node ONNX model: ``y = onnx_name(x, weight[, bias])`` over the last axis."""
    from onnx import helper

    element = _ONNX_TYPES[dtype]
    cols = shape[-1]
    names = ["x", "weight"] + (["bias"] if onnx_name == "LayerNormalization" else [])
    inputs = [helper.make_tensor_value_info("x", element, list(shape))]
    inputs += [helper.make_tensor_value_info(n, element, [cols]) for n in names[1:]]
    output = helper.make_tensor_value_info("y", element, list(shape))
    node = helper.make_node(onnx_name, names, ["y"], axis=-1, epsilon=EPS)
    graph = helper.make_graph([node], f"normlab_peer_{onnx_name}", inputs, [output])
    opset = RMS_NORM_OPSET if onnx_name == "RMSNormalization" else LAYER_NORM_OPSET
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION
    )
    return bytes(model.SerializeToString())


def _build_session(onnx_name: str, dtype: str, shape: tuple[int, ...]) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1  # all cores, like the torch peer
    options.log_severity_level = _ORT_ERRORS_ONLY
    # ORT's idle intra-op threads spin by default, taking the cores from whichever contender
    # the interleaved matrix times next (an out= call of numba's measured 4x slower after it)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(
        _model_bytes(onnx_name, dtype, shape), options, providers=["CPUExecutionProvider"]
    )


def _session(op: str, dtype: str, shape: tuple[int, ...]) -> Any:
    name = onnx_op(op, dtype)
    try:
        return _build_session(name, dtype, shape)
    except Exception as exc:  # ORT says which kernel it lacks; the case is skipped with that
        said = " ".join(str(exc).split())[:_REASON_CHARS] or type(exc).__name__
        raise PeerUnavailable(f"ONNX Runtime cannot run {name} on {dtype} here: {said}") from exc


def _ort_value(a: np.ndarray) -> Any:
    """An OrtValue over ``a``'s memory (bfloat16 through its bits, which NumPy cannot hand on)."""
    from onnxruntime import OrtValue

    if a.dtype.name == "bfloat16":
        return OrtValue.ortvalue_from_numpy_with_onnx_type(
            a.view(np.uint16), _ONNX_TYPES["bfloat16"]
        )
    return OrtValue.ortvalue_from_numpy(a)


@dataclass(frozen=True, slots=True)
class _BoundCall:
    """One io_binding run writing ``y``; holds the OrtValues (and arrays) the binding uses."""

    session: Any
    binding: Any
    values: dict[str, Any]
    y: np.ndarray

    def __call__(self) -> np.ndarray:
        self.session.run_with_iobinding(self.binding)
        return self.y


def _ort_call(op: str, name: str, data: Workload) -> Callable[[], Any]:
    session = _session(op, data.dtype, data.shape)
    params = [data.weight] + ([data.bias] if op == "layer_norm" else [])
    arrays = {"x": data.x}
    arrays.update(zip(("weight", "bias"), (p.astype(data.x.dtype) for p in params), strict=False))
    if name == "ort_iobinding":
        y = np.empty_like(data.x)
        values = {key: _ort_value(a) for key, a in arrays.items()}
        values["y"] = _ort_value(y)
        binding = session.io_binding()
        for key, value in values.items():
            if key == "y":
                binding.bind_ortvalue_output(key, value)
            else:
                binding.bind_ortvalue_input(key, value)
        return _BoundCall(session, binding, values, y)
    if data.dtype == "bfloat16":
        values = {key: _ort_value(a) for key, a in arrays.items()}
        return lambda: session.run_with_ort_values(["y"], values)
    return lambda: session.run(None, arrays)


def _compiled_call(op: str, data: Workload) -> Callable[[], Any]:
    import torch

    function, args = torch_forward(op, data)
    torch._dynamo.reset()  # a fresh cache: each shape compiles once, never hits the limit
    compiled = torch.compile(function, dynamic=False)
    try:
        compiled(*args)  # the compile, outside the timing
    except Exception as exc:  # no C++ compiler, an inductor gap: the case is skipped
        raise PeerUnavailable(f"torch.compile failed: {type(exc).__name__}: {exc}") from exc
    return lambda: compiled(*args)


def call(op: str, name: str, data: Workload) -> Callable[[], Any]:
    """The peer ``name`` of ``op`` on ``data``, built (and compiled) outside the timing."""
    why = unavailable(op, name, data.dtype)
    if why is not None:
        raise PeerUnavailable(why)
    if name == "torch_compile":
        return _compiled_call(op, data)
    return _ort_call(op, name, data)
