"""The CuPy backend: the raw CUDA kernels of ``kernels/`` (LayerNorm and RMSNorm, forward in
``layer_norm.cu``, backward in ``backward.cu``, fused with a residual add in ``add_norm.cu``,
with quantized outputs in ``quantize.cu``), compiled with NVRTC.

Serves CuPy arrays, and CUDA torch tensors when named explicitly (``backend="cupy"``): those are
read and written in place through their raw pointers on torch's current stream, and the result
is a tensor. The kernels record no autograd graph (the record claims no ``autograd``): for
tensors that require grad the core runs this backend through normlab's torch custom ops
(:mod:`normlab.autograd`), which call it with tensors that do not, so that the gradients come
from this backend's backward kernels; a plan that requires grad reaching it is refused. The
kernel for a row length is chosen by :mod:`~normlab.backends.cuda_launch`, compiled for the
device's architecture by :mod:`~normlab.backends.cuda_compile` on first use (cubins are cached
on disk) and kept per (device, specialisation). Nothing here imports CuPy before it is called,
and :func:`device_problem` never raises.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from normlab.backends.cuda_compile import compile_kernels, nvrtc_problem, target_for
from normlab.backends.cuda_launch import (
    QUANTIZING,
    Specialisation,
    plan_backward,
    plan_launch,
    program_of,
)
from normlab.errors import BackendError
from normlab.hookspecs import Plan

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "device_problem",
    "from_numpy",
    "layer_norm",
    "layer_norm_backward",
    "quantized",
    "rms_norm",
    "rms_norm_backward",
    "to_numpy",
]

_STATS: Final = {"float32": np.float32, "float64": np.float64}
#: The kernels' ``mode`` argument of each quantization mode (kernels/quantize.cuh).
_MODES: Final = {"int8": 0, "fp8_e4m3": 1}
_functions: dict[tuple[int, Specialisation], Any] = {}


def device_problem() -> str | None:
    """Why this backend cannot run here (``"no CUDA device (...)"``), or ``None`` when it can."""
    try:
        import cupy
    except Exception as error:  # a broken install must not break normlab
        return f"cupy cannot be imported ({type(error).__name__}: {error})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, an old driver, or no device
        return f"no CUDA device ({error})"
    if count == 0:
        return "no CUDA device"
    return nvrtc_problem()


def _function(device: int, spec: Specialisation) -> Any:
    """The loaded kernel ``spec`` on ``device``. On first use its whole NVRTC program (see
    :func:`~normlab.backends.cuda_launch.program_of`) is compiled, or read from the disk cache,
    and loaded."""
    function = _functions.get((device, spec))
    if function is None:
        import cupy

        with cupy.cuda.Device(device) as dev:
            program = program_of(spec)
            compiled = compile_kernels(program, target_for(int(dev.compute_capability)))
            module = cupy.cuda.function.Module()
            module.load(compiled.image)
            for s in program:
                _functions[device, s] = module.get_function(compiled.functions[s.name])
        function = _functions[device, spec]
    return function


class _Cupy:
    """CuPy arrays: byte addresses, element strides, allocation on x's device."""

    @staticmethod
    def address(a: Any) -> int:
        return int(a.data.ptr)

    @staticmethod
    def row_stride(a: Any) -> int:
        return int(a.strides[0]) // int(a.dtype.itemsize)

    @staticmethod
    def device(a: Any) -> int:
        return int(a.device.id)

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: Any, like: Any) -> Any:
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, dtype=dtype)

    @staticmethod
    def to_float32(a: Any) -> Any:
        return a.astype(np.float32)

    @staticmethod
    def contiguous(a: Any) -> Any:
        import cupy

        return cupy.ascontiguousarray(a)

    @staticmethod
    def stats_dtype(name: str) -> Any:
        return _STATS[name]

    @staticmethod
    def stream(a: Any) -> Any:
        return None  # CuPy's current stream

    @staticmethod
    def q_dtype(mode: str) -> Any:
        return np.int8 if mode == "int8" else np.uint8  # CuPy has no float8: its bits


class _Torch:
    """CUDA torch tensors, through raw pointers on torch's current stream."""

    @staticmethod
    def address(a: Any) -> int:
        return int(a.data_ptr())

    @staticmethod
    def row_stride(a: Any) -> int:
        return int(a.stride(0))

    @staticmethod
    def device(a: Any) -> int:
        return int(a.device.index)

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: Any, like: Any) -> Any:
        import torch

        return torch.empty(shape, dtype=dtype, device=like.device)

    @staticmethod
    def to_float32(a: Any) -> Any:
        return a.float()

    @staticmethod
    def contiguous(a: Any) -> Any:
        return a.contiguous()

    @staticmethod
    def stats_dtype(name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def stream(a: Any) -> Any:
        import cupy
        import torch

        current = torch.cuda.current_stream(a.device)
        if hasattr(current, "__cuda_stream__") and hasattr(cupy.cuda.Stream, "from_external"):
            return cupy.cuda.Stream.from_external(current)  # CuPy 14 and torch 2.6 or newer
        return cupy.cuda.ExternalStream(current.cuda_stream, a.device.index)

    @staticmethod
    def q_dtype(mode: str) -> Any:
        import torch

        return torch.int8 if mode == "int8" else torch.float8_e4m3fn


def layer_norm(
    x: Any, weight: Any, bias: Any, *, plan: Plan, out: Any
) -> tuple[Any, Any | None, Any | None]:
    """Normalize each row of the 2-D ``x`` (unit column stride, any row stride; a CuPy array or,
    named explicitly, a CUDA torch tensor); see :mod:`normlab.hookspecs`. ``out`` may be ``x``.
    Weight and bias of different dtypes are both read as float32."""
    _refuse_grad(plan)
    return _launch(x, weight, bias, plan, out)


def rms_norm(x: Any, weight: Any, *, plan: Plan, out: Any) -> tuple[Any, Any]:
    """RMS-normalize each row of the 2-D ``x``, ``y = x / sqrt(mean(x^2) + eps) * weight``; the
    arrays as for :func:`layer_norm`; ``(y, rstd)``."""
    _refuse_grad(plan)
    y, _, rstd = _launch(x, weight, None, plan, out)
    return y, rstd


def _refuse_grad(plan: Plan) -> None:
    """A plan whose tensors require grad never reaches the kernels: their raw pointers would
    detach the result silently (the core runs such calls through normlab's custom ops)."""
    if plan.requires_grad:
        raise BackendError(
            "the cupy backend records no autograd graph and a tensor of this call requires "
            "grad; call normlab.layer_norm / normlab.rms_norm (which keep the graph through "
            "normlab's custom ops), or pass detached tensors"
        )


def _launch(
    x: Any, weight: Any, bias: Any, plan: Plan, out: Any
) -> tuple[Any, Any | None, Any | None]:
    """Launch the kernel of ``plan.op`` on the 2-D ``x``; ``(y, mean, rstd)`` (mean is None for
    rms_norm, both statistics without return_stats)."""
    import cupy

    arrays = _Torch if plan.family == "torch" else _Cupy
    rows, cols = plan.rows, plan.cols
    w, b, param_dtype = _parameters(arrays, weight, bias, plan)
    y = out if out is not None else arrays.empty((rows, cols), x.dtype, x)
    mean, rstd = _statistics(arrays, plan, x, centre=plan.arithmetic.centred)
    x_at, y_at, w_at, b_at, mean_at, rstd_at = (
        0 if a is None else arrays.address(a) for a in (x, y, w, b, mean, rstd)
    )
    x_stride, y_stride = arrays.row_stride(x), arrays.row_stride(y)
    launch = plan_launch(
        plan.op, cols, plan.dtype, param_dtype, [x_at, y_at, w_at, b_at], [x_stride, y_stride]
    )
    device = arrays.device(x)
    function = _function(device, launch.specialisation)
    pointers = (np.uint64(a) for a in (x_at, w_at, b_at, y_at, mean_at, rstd_at))
    sizes = (np.int64(n) for n in (rows, cols, x_stride, y_stride))
    stats = _STATS[plan.stats_dtype]
    args = (*pointers, *sizes, stats(plan.eps), stats(plan.weight_offset))  # the kernels' order
    with cupy.cuda.Device(device):
        function((launch.grid(rows),), (launch.block,), args, stream=arrays.stream(x))
    return y, mean, rstd


def _statistics(arrays: Any, plan: Plan, x: Any, centre: bool) -> tuple[Any | None, Any | None]:
    """Empty ``(mean, rstd)`` on x's device for ``plan.return_stats`` (mean only with
    ``centre``), else ``(None, None)``."""
    if not plan.return_stats:
        return None, None
    stats = arrays.stats_dtype(plan.stats_dtype)
    mean = arrays.empty((plan.rows,), stats, x) if centre else None
    return mean, arrays.empty((plan.rows,), stats, x)


def add_layer_norm(
    x: Any, residual: Any, weight: Any, bias: Any, *, plan: Plan, out: Any, residual_out: Any
) -> tuple[Any, Any | None, Any | None, Any | None]:
    """``h = x + residual`` (rounded to x's dtype), then LayerNorm of ``h``, in one kernel
    (``kernels/add_norm.cu``); see :mod:`normlab.hookspecs`. The arrays as for
    :func:`layer_norm`; ``out`` may be the memory of x or residual, ``residual_out`` that of
    residual or x. Returns ``(y, h, mean, rstd)``, h None unless ``plan.return_residual``."""
    _refuse_grad(plan)
    return _launch_fused(x, residual, weight, bias, plan, out, residual_out)


def add_rms_norm(
    x: Any, residual: Any, weight: Any, *, plan: Plan, out: Any, residual_out: Any
) -> tuple[Any, Any | None, Any | None]:
    """``h = x + residual``, then RMSNorm of ``h``: as :func:`add_layer_norm`;
    ``(y, h, rstd)``."""
    _refuse_grad(plan)
    y, h, _, rstd = _launch_fused(x, residual, weight, None, plan, out, residual_out)
    return y, h, rstd


def _launch_fused(
    x: Any, residual: Any, weight: Any, bias: Any, plan: Plan, out: Any, residual_out: Any
) -> tuple[Any, Any | None, Any | None, Any | None]:
    """Launch the fused kernel of ``plan.op``; ``(y, h, mean, rstd)``."""
    import cupy

    arrays = _Torch if plan.family == "torch" else _Cupy
    rows, cols = plan.rows, plan.cols
    w, b, param_dtype = _parameters(arrays, weight, bias, plan)
    y = out if out is not None else arrays.empty((rows, cols), x.dtype, x)
    h = None
    if plan.return_residual:
        h = residual_out if residual_out is not None else arrays.empty((rows, cols), x.dtype, x)
    mean, rstd = _statistics(arrays, plan, x, centre=plan.arithmetic.centred)
    x_at, r_at, y_at, h_at, w_at, b_at, mean_at, rstd_at = (
        0 if a is None else arrays.address(a) for a in (x, residual, y, h, w, b, mean, rstd)
    )
    strides = [arrays.row_stride(a) for a in (x, residual, y)]
    strides.append(cols if h is None else arrays.row_stride(h))
    launch = plan_launch(
        plan.op, cols, plan.dtype, param_dtype,
        [x_at, r_at, y_at, h_at or None, w_at or None, b_at or None], strides,
    )  # fmt: skip
    device = arrays.device(x)
    function = _function(device, launch.specialisation)
    pointers = (np.uint64(a) for a in (x_at, r_at, w_at, b_at, y_at, h_at, mean_at, rstd_at))
    sizes = (np.int64(n) for n in (rows, cols, *strides))
    stats = _STATS[plan.stats_dtype]
    args = (*pointers, *sizes, stats(plan.eps), stats(plan.weight_offset))  # the kernels' order
    with cupy.cuda.Device(device):
        function((launch.grid(rows),), (launch.block,), args, stream=arrays.stream(x))
    return y, h, mean, rstd


def quantized(
    x: Any, residual: Any, weight: Any, bias: Any, *, plan: Plan, residual_out: Any
) -> tuple[Any, Any, Any]:
    """q, scale and h of ``plan.op`` (a forward op, or a fused one with ``residual``) in one
    kernel (``kernels/quantize.cu``), y never in memory; see :mod:`normlab.hookspecs`. q is int8,
    or float8 e4m3fn (CuPy: its bits as uint8); y is bitwise this backend's y of x in float32
    (float64 x: its y rounded to float32). ``residual_out`` may be the memory of residual or
    x."""
    import cupy

    _refuse_grad(plan)
    arrays = _Torch if plan.family == "torch" else _Cupy
    rows, cols = plan.rows, plan.cols
    w, b, param_dtype = _parameters(arrays, weight, bias, plan)
    mode = plan.quantize or "int8"
    q = arrays.empty((rows, cols), arrays.q_dtype(mode), x)
    scale = arrays.empty((rows,), arrays.stats_dtype("float32"), x)
    h = None
    if residual is not None and plan.return_residual:
        h = residual_out if residual_out is not None else arrays.empty((rows, cols), x.dtype, x)
    x_at, r_at, q_at, h_at, w_at, b_at, scale_at = (
        0 if a is None else arrays.address(a) for a in (x, residual, q, h, w, b, scale)
    )
    strides = [cols if a is None else arrays.row_stride(a) for a in (x, residual, h)]
    launch = plan_launch(
        QUANTIZING[plan.op], cols, plan.dtype, param_dtype,
        [x_at, r_at or None, q_at, h_at or None, w_at or None, b_at or None], strides,
    )  # fmt: skip
    device = arrays.device(x)
    function = _function(device, launch.specialisation)
    pointers = (np.uint64(a) for a in (x_at, r_at, w_at, b_at, q_at, h_at, scale_at))
    sizes = (np.int64(n) for n in (rows, cols, *strides))
    stats = _STATS[plan.stats_dtype]
    args = (
        *pointers, *sizes, stats(plan.eps), stats(plan.weight_offset),
        np.float32(plan.quantize_scale or 0.0), np.int32(_MODES[mode]),
    )  # fmt: skip  # the kernels' order
    with cupy.cuda.Device(device):
        function((launch.grid(rows),), (launch.block,), args, stream=arrays.stream(x))
    return q, scale, h


def _parameters(arrays: Any, weight: Any, bias: Any, plan: Plan) -> tuple[Any, Any, str | None]:
    """Contiguous weight and bias of one dtype (float32 when theirs differ), and that dtype."""
    if weight is not None and bias is not None and plan.weight_dtype != plan.bias_dtype:
        weight, bias = (
            p if dtype == "float32" else arrays.to_float32(p)
            for p, dtype in ((weight, plan.weight_dtype), (bias, plan.bias_dtype))
        )
        param_dtype: str | None = "float32"
    else:
        param_dtype = plan.weight_dtype or plan.bias_dtype
    weight, bias = (None if p is None else arrays.contiguous(p) for p in (weight, bias))
    return weight, bias, param_dtype


# --------------------------------------------------------------------------------------------
# Backward (see :mod:`normlab.hookspecs` for the contract and kernels/backward.cu for the kernels).


def layer_norm_backward(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, *, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any, Any]:
    """LayerNorm's ``(dx, dweight, dbias)`` of the 2-D ``dy`` and ``x`` (unit column stride,
    any row stride); see :mod:`normlab.hookspecs`. dweight and dbias are deterministic: the same
    bits on every run and every GPU."""
    _refuse_grad(plan)
    return _backward(dy, x, mean, rstd, weight, plan, needs)


def rms_norm_backward(
    dy: Any, x: Any, rstd: Any, weight: Any, *, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any]:
    """RMSNorm's ``(dx, dweight)``, as :func:`layer_norm_backward`."""
    _refuse_grad(plan)
    dx, dweight, _ = _backward(dy, x, None, rstd, weight, plan, needs - {"bias"})
    return dx, dweight


def _backward(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any, Any]:
    """Both backward ops (``mean`` None: RMSNorm). Up to three launches on x's stream:
    ``backward_rows``/``backward_loop`` for dx (and, for LayerNorm's dweight, each row's
    residual ``res``), ``weight_partials`` for the per-chunk sums, ``sum_chunks`` for dweight
    and dbias. dweight without dx still runs the first kernel for ``res`` (LayerNorm)."""
    import cupy

    arrays = _Torch if plan.family == "torch" else _Cupy
    rows, cols = plan.rows, plan.cols
    compute = arrays.stats_dtype(plan.compute_dtype)
    centre = mean is not None
    need_dw, need_db = "weight" in needs, centre and "bias" in needs
    mean, rstd, w = (None if a is None else arrays.contiguous(a) for a in (mean, rstd, weight))
    dx = arrays.empty((rows, cols), x.dtype, x) if "x" in needs else None
    res = arrays.empty((rows,), compute, x) if centre and need_dw else None
    dy_at, x_at, dx_at, w_at = (0 if a is None else arrays.address(a) for a in (dy, x, dx, w))
    strides = [arrays.row_stride(dy), arrays.row_stride(x)]
    dx_stride = cols if dx is None else arrays.row_stride(dx)
    launch = plan_backward(
        plan.op, cols, plan.dtype, plan.weight_dtype, [dy_at, x_at, dx_at or None, w_at or None],
        [*strides, dx_stride],
    )  # fmt: skip
    device, stream = arrays.device(x), arrays.stream(x)
    mean_at, rstd_at, res_at = (0 if a is None else arrays.address(a) for a in (mean, rstd, res))
    sizes = [np.int64(rows), np.int64(cols), *(np.int64(s) for s in strides)]
    with cupy.cuda.Device(device):
        if dx is not None or res is not None:
            kernel = launch.rows
            pointers = (dy_at, x_at, mean_at, rstd_at, w_at, dx_at, res_at)
            _function(device, kernel.specialisation)(
                (kernel.grid(rows),), (kernel.block,),
                (
                    *map(np.uint64, pointers), *sizes, np.int64(dx_stride),
                    _STATS[plan.stats_dtype](plan.weight_offset),
                ),
                stream=stream,
            )  # fmt: skip
        if not (need_dw or need_db):
            return dx, None, None
        chunks = launch.chunks(rows)
        w_parts, b_parts, dweight, dbias = (
            arrays.empty(shape, compute, x) if needed else None
            for shape, needed in (
                ((chunks, cols), need_dw),
                ((chunks, cols), need_db),
                ((cols,), need_dw),
                ((cols,), need_db),
            )
        )
        w_parts_at, b_parts_at, dweight_at, dbias_at = (
            0 if a is None else arrays.address(a) for a in (w_parts, b_parts, dweight, dbias)
        )
        inputs = (dy_at, x_at, mean_at, res_at, rstd_at, w_parts_at, b_parts_at)
        _function(device, launch.partials)(
            (launch.partials_grid(rows),), (launch.partials.block,),
            (*map(np.uint64, inputs), *sizes), stream=stream,
        )  # fmt: skip
        outputs = (w_parts_at, b_parts_at, dweight_at, dbias_at)
        _function(device, launch.sum)(
            launch.sum_grid(2 if need_db else 1), (launch.sum.block,),
            (*map(np.uint64, outputs), np.int64(chunks), np.int64(cols)), stream=stream,
        )  # fmt: skip
    return dx, dweight, dbias


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy copy of a CuPy array (or of a CUDA torch tensor; bfloat16 via ml_dtypes)."""
    if type(a).__module__.startswith("torch"):
        from normlab.backends.torch_backend import to_numpy as torch_to_numpy

        return torch_to_numpy(a)
    import cupy

    return np.asarray(cupy.asnumpy(a))


def from_numpy(a: np.ndarray, like: Any = None) -> Any:
    """A CuPy copy of ``a`` on ``like``'s device (CuPy array or torch tensor), else the current
    device. bfloat16 needs a CuPy with ml_dtypes support (CuPy 14)."""
    import cupy

    if like is None:
        device = cupy.cuda.runtime.getDevice()
    elif type(like).__module__.startswith("torch"):
        device = like.device.index
    else:
        device = like.device.id
    with cupy.cuda.Device(device):
        return cupy.array(np.ascontiguousarray(a), copy=True)
