"""CPU torch tensors through the numba kernels, zero-copy: the torch family's adapter,
:data:`TENSORS`.

Tensors are read and written in place; the results are tensors. A C-contiguous tensor of short
rows (with ``out`` a separate C-contiguous tensor, or none; for the fused ops ``out`` and
``residual_out`` C-contiguous, the memory of an input or separate) goes to the kernels by
address: ``Tensor.data_ptr()`` integers that the entries of
:mod:`normlab.backends.numba_addressed` view as arrays and hand to the same serial kernels — on
the calling thread, or split over the pool's threads — so the result is bit for bit the NumPy
call's, without the ``Tensor.numpy()`` and ``torch.from_numpy`` crossings (about 0.6 µs each).
A weight and bias of the compute dtype, or both of x's half dtype (widened inside the entry),
go by address too; others are converted first. Every other tensor (strided, misaligned, in
place, long rows) runs the NumPy family's functions (:mod:`normlab.backends.numba_arrays`) on
``Tensor.numpy()`` views of the same memory. A large new output (1 MiB or more) comes from the
output pool, as for NumPy arrays.

The kernels record no autograd graph (the record claims no ``autograd``): for tensors that
require grad the core runs this backend through normlab's torch custom ops
(:mod:`normlab.autograd`), which call it with tensors that do not; a tensor that requires grad
reaching it is refused (:class:`BackendError`), never detached. Nothing here imports torch
before a tensor arrives.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from normlab.backends import numba_arrays, output_pool
from normlab.backends.numba_addressed import (
    add_norm_rows_at,
    add_norm_rows_parallel_at,
    layer_norm_rows_at,
    layer_norm_rows_parallel_at,
)
from normlab.backends.numba_family import Family
from normlab.backends.numba_forward import layer_norm_rows
from normlab.backends.numba_fused import add_norm_rows
from normlab.backends.numba_kernel_types import BITS, KernelTypes, stand_in
from normlab.backends.numba_pool import POOL, always_serial, forward_work
from normlab.errors import BackendError
from normlab.hookspecs import Plan

__all__ = [
    "TENSORS",
    "add_normalize",
    "backward",
    "normalize",
    "serial_add_rows",
    "serial_rows",
]

#: Weight and bias as the address entries take them: (weight's address, bias's, an empty array
#: of the type they are stored in); see :func:`_tensor_params`.
_Params = tuple[int, int, np.ndarray]


def normalize(
    x: Any, weight: Any, bias: Any, plan: Plan, k: KernelTypes, out: Any, centre: bool
) -> tuple[Any, Any, Any]:
    """Both norms on CPU tensors: by address where the entries read them, else
    :func:`numba_arrays.normalize` on NumPy views."""
    _refuse_graph(plan)
    n = k.element.itemsize
    if (
        not k.long
        and _addressable(x, n)
        # out: separate memory (the core passes x's very memory or none of it), as the
        # kernels write y beside x; in place goes through the views, which pass no y
        and (out is None or (_addressable(out, n) and out.data_ptr() != x.data_ptr()))
    ):
        return _normalize_at(x, weight, bias, plan, k, centre, out)
    bfloat16 = plan.dtype == "bfloat16"
    x_np = _tensor_as_numpy(x, bfloat16)
    out_np = None if out is None else _tensor_as_numpy(out, bfloat16)
    weight = _tensor_parameter(weight, k.compute)
    bias = _tensor_parameter(bias, k.compute)
    y_np, mean, rstd = numba_arrays.normalize(x_np, weight, bias, plan, k, out_np, centre)
    import torch

    y = out if out is not None else _numpy_as_tensor(y_np, plan.dtype)
    return (
        y,
        None if mean is None else torch.from_numpy(mean),
        None if rstd is None else torch.from_numpy(rstd),
    )


def add_normalize(
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    plan: Plan,
    k: KernelTypes,
    out: Any,
    residual_out: Any,
    centre: bool,
) -> tuple[Any, Any, Any, Any]:
    """Both fused ops on CPU tensors: by address where the entries read them, else
    :func:`numba_arrays.add_normalize` on NumPy views."""
    _refuse_graph(plan)
    n = k.element.itemsize
    h_dtype = plan.residual_dtype or plan.dtype
    r_n = residual.element_size()
    if (  # the fused kernels write y and h over x or residual themselves (in place)
        not k.long
        and _addressable(x, n)
        and _addressable(residual, r_n)
        and (out is None or _addressable(out, n))
        and (residual_out is None or _addressable(residual_out, r_n))
    ):
        return _add_normalize_at(x, residual, weight, bias, plan, k, centre, out, residual_out)
    bfloat16, h_bfloat16 = plan.dtype == "bfloat16", h_dtype == "bfloat16"
    x_np, r_np = _tensor_as_numpy(x, bfloat16), _tensor_as_numpy(residual, h_bfloat16)
    out_np = None if out is None else _tensor_as_numpy(out, bfloat16)
    h_out_np = None if residual_out is None else _tensor_as_numpy(residual_out, h_bfloat16)
    weight = _tensor_parameter(weight, k.compute)
    bias = _tensor_parameter(bias, k.compute)
    y_np, h_np, mean, rstd = numba_arrays.add_normalize(
        x_np, r_np, weight, bias, plan, k, out_np, h_out_np, centre
    )
    import torch

    y = out if out is not None else _numpy_as_tensor(y_np, plan.dtype)
    h = None
    if h_np is not None:
        h = residual_out if residual_out is not None else _numpy_as_tensor(h_np, h_dtype)
    return (
        y,
        h,
        None if mean is None else torch.from_numpy(mean),
        None if rstd is None else torch.from_numpy(rstd),
    )


def backward(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, plan: Plan, needs: frozenset[str]
) -> tuple[Any, Any, Any]:
    """Both backward ops on CPU tensors: :func:`numba_arrays.backward` on zero-copy NumPy
    views, tensors out (none may require grad)."""
    import torch

    _refuse_grad(dy, x, mean, rstd, weight)
    compute = np.float64 if plan.compute_dtype == "float64" else np.float32
    dx, dweight, dbias = numba_arrays.backward(
        _tensor_as_numpy(dy, plan.dtype == "bfloat16"),
        _tensor_as_numpy(x, plan.dtype == "bfloat16"),
        None if mean is None else mean.numpy(),
        rstd.numpy(),
        _tensor_parameter(weight, compute),
        plan,
        needs,
    )
    return (
        None if dx is None else _numpy_as_tensor(dx, plan.dtype),
        None if dweight is None else torch.from_numpy(dweight),
        None if dbias is None else torch.from_numpy(dbias),
    )


# --------------------------------------------------------------------------------------------
# By address: C-contiguous tensors of short rows


def _normalize_at(
    x: Any, weight: Any, bias: Any, plan: Plan, k: KernelTypes, centre: bool, out: Any
) -> tuple[Any, Any, Any]:
    """:func:`normalize` of a C-contiguous tensor ``x`` of short rows, without NumPy views:
    the tensors' addresses go to :func:`numba_addressed.layer_norm_rows_at` on the calling
    thread, or :func:`numba_addressed.layer_norm_rows_parallel_at` on the pool's threads.
    ``y`` is ``out`` (C-contiguous, separate from x) or a new tensor (pooled when large); the
    statistics are NumPy arrays the kernel writes, returned as tensors."""
    params, kept = _tensor_params(weight, bias, k, _torch_compute(k.compute), x), None
    if params is None:
        params, kept = _converted_params(weight, bias, k)
    w_at, b_at, p_like = params
    return_stats = plan.return_stats
    mean = np.empty(plan.rows, k.stats) if return_stats and centre else k.no_stats
    rstd = np.empty(plan.rows, k.stats) if return_stats else k.no_stats
    e = k.element
    threads = 1 if always_serial(plan, k) else POOL.acquire(forward_work(plan, k))
    try:
        y = _tensor_output(x, plan.dtype, plan) if out is None else out
        args = (
            e, k.compute_like, p_like, x.data_ptr(), y.data_ptr(), w_at, b_at,
            float(plan.weight_offset), plan.rows, plan.cols, float(plan.eps), mean, rstd, centre,
        )  # fmt: skip
        kernel: Any = layer_norm_rows_at if threads == 1 else layer_norm_rows_parallel_at
        tail = (0, plan.rows) if threads == 1 else (threads,)
        name = _entry_name(kernel.__name__, k, p_like)
        entry = k.entries.get(name)
        if entry is not None:
            entry(*args, *tail)
        else:  # see load_serial_first: the kernel's own copy runs
            layer_norm_rows(e, e, k.ones, k.zeros, 0.0, k.no_stats, k.no_stats, centre, 0, 0)
            k.entries[name] = _entry_point(kernel, (*args, *tail))
    finally:
        POOL.release(threads)
    del kept  # converted weight and bias lived until the kernel returned
    if not return_stats:
        return y, None, None
    return y, _torch().from_numpy(mean) if centre else None, _torch().from_numpy(rstd)


def _add_normalize_at(
    x: Any,
    residual: Any,
    weight: Any,
    bias: Any,
    plan: Plan,
    k: KernelTypes,
    centre: bool,
    out: Any,
    residual_out: Any,
) -> tuple[Any, Any, Any, Any]:
    """:func:`add_normalize` of C-contiguous tensors ``x`` and ``residual`` of short rows,
    without NumPy views (as :func:`_normalize_at`, with :func:`numba_addressed.add_norm_rows_at`
    or :func:`numba_addressed.add_norm_rows_parallel_at`); ``y`` is ``out`` and ``h``
    ``residual_out`` (C-contiguous; the memory of an input or separate), else new tensors."""
    params, kept = _tensor_params(weight, bias, k, _torch_compute(k.compute), x), None
    if params is None:
        params, kept = _converted_params(weight, bias, k)
    w_at, b_at, p_like = params
    mean = np.empty(plan.rows, k.stats) if plan.return_stats and centre else k.no_stats
    rstd = np.empty(plan.rows, k.stats) if plan.return_stats else k.no_stats
    e = k.element
    threads = 1 if always_serial(plan, k) else POOL.acquire(forward_work(plan, k))
    try:
        y = _tensor_output(x, plan.dtype, plan) if out is None else out
        h = residual_out
        if h is None and plan.return_residual:
            h = _tensor_output(residual, plan.residual_dtype or plan.dtype, plan)
        r_like = e if plan.residual_dtype is None else _STREAM
        h_like = None if h is None else r_like
        args = (
            e, k.compute_like, p_like, r_like, h_like, x.data_ptr(), residual.data_ptr(),
            y.data_ptr(),
            0 if h is None else h.data_ptr(), w_at, b_at, float(plan.weight_offset),
            plan.rows, plan.cols, float(plan.eps), mean, rstd, centre,
        )  # fmt: skip
        kernel: Any = add_norm_rows_at if threads == 1 else add_norm_rows_parallel_at
        tail = (0, plan.rows) if threads == 1 else (threads,)
        name = _entry_name(_add_entry(kernel.__name__, h is not None, plan), k, p_like)
        entry = k.entries.get(name)
        if entry is not None:
            entry(*args, *tail)
        else:  # see load_serial_first: the kernel's own copy runs
            add_norm_rows(
                e, r_like, e, h_like, k.ones, k.zeros, 0.0, k.no_stats, k.no_stats, centre, 0, 0
            )
            k.entries[name] = _entry_point(kernel, (*args, *tail))
    finally:
        POOL.release(threads)
    del kept  # converted weight and bias lived until the kernel returned
    if not plan.return_stats:
        return y, h, None, None
    torch = _torch()
    return y, h, torch.from_numpy(mean) if centre else None, torch.from_numpy(rstd)


def serial_rows(plan: Plan, k: KernelTypes, centre: bool) -> Callable[..., Any]:
    """The serial norm entry of ``plan`` on tensors as they are (see
    :class:`~normlab.backends.numba_family.Family`): :func:`_normalize_at` without out or
    statistics, for C-contiguous aligned tensors and weights as :func:`_tensor_params` reads
    them, through the entry point its first call took."""
    empty_like, itemsize = _torch().empty_like, k.element.itemsize
    element, compute_like, compute = k.element, k.compute_like, _torch_compute(k.compute)
    rows, cols, eps, no_stats = plan.rows, plan.cols, float(plan.eps), k.no_stats
    offset = float(plan.weight_offset)
    entries, name = k.entries, "layer_norm_rows_at"
    half_name = _entry_name(name, k, element)
    stored: dict[int, Any] = {}  # entries by id(p_like), for parameters in other types
    entry, half_entry = entries.get(name), entries.get(half_name)

    def run(x: Any, weight: Any, bias: Any) -> tuple[Any, ...] | None:
        nonlocal entry, half_entry
        x_at = x.data_ptr()
        params = _tensor_params(weight, bias, k, compute, x)
        if params is None or x_at % itemsize or not x.is_contiguous():
            return None
        w_at, b_at, p_like = params
        if p_like is compute_like:
            kernel = entry
        else:
            kernel = half_entry if p_like is element else stored.get(id(p_like))
        if kernel is None:  # not taken yet (the op's function takes it on its first call)
            entry, half_entry = entries.get(name), entries.get(half_name)
            kernel = entries.get(_entry_name(name, k, p_like))
            if kernel is None:
                return None
            stored[id(p_like)] = kernel
        y = empty_like(x)
        kernel(
            element, compute_like, p_like, x_at, y.data_ptr(), w_at, b_at, offset,
            rows, cols, eps, no_stats, no_stats, centre, 0, rows,
        )  # fmt: skip
        return (y, None, None) if centre else (y, None)

    return run


def serial_add_rows(plan: Plan, k: KernelTypes, centre: bool) -> Callable[..., Any]:
    """The serial fused entry of ``plan`` on tensors as they are: :func:`_add_normalize_at`
    without outputs given or statistics, for C-contiguous aligned tensors and weights as
    :func:`_tensor_params` reads them, through the entry point its first call took."""
    empty_like, itemsize, keep_h = _torch().empty_like, k.element.itemsize, plan.return_residual
    element, compute_like, compute = k.element, k.compute_like, _torch_compute(k.compute)
    r_like = element if plan.residual_dtype is None else _STREAM
    r_itemsize, h_like = r_like.itemsize, r_like if keep_h else None
    rows, cols, eps, no_stats = plan.rows, plan.cols, float(plan.eps), k.no_stats
    offset = float(plan.weight_offset)
    entries, name = k.entries, _add_entry("add_norm_rows_at", keep_h, plan)
    half_name = _entry_name(name, k, element)
    stored: dict[int, Any] = {}  # entries by id(p_like), for parameters in other types
    entry, half_entry = entries.get(name), entries.get(half_name)

    def run(x: Any, residual: Any, weight: Any, bias: Any) -> tuple[Any, ...] | None:
        nonlocal entry, half_entry
        x_at, r_at = x.data_ptr(), residual.data_ptr()
        params = _tensor_params(weight, bias, k, compute, x)
        if (
            params is None
            or x_at % itemsize
            or r_at % r_itemsize
            or not x.is_contiguous()
            or not residual.is_contiguous()
        ):
            return None
        w_at, b_at, p_like = params
        if p_like is compute_like:
            kernel = entry
        else:
            kernel = half_entry if p_like is element else stored.get(id(p_like))
        if kernel is None:  # not taken yet (the op's function takes it on its first call)
            entry, half_entry = entries.get(name), entries.get(half_name)
            kernel = entries.get(_entry_name(name, k, p_like))
            if kernel is None:
                return None
            stored[id(p_like)] = kernel
        y = empty_like(x)
        h = empty_like(residual) if keep_h else None
        kernel(
            element, compute_like, p_like, r_like, h_like, x_at, r_at, y.data_ptr(),
            0 if h is None else h.data_ptr(), w_at, b_at, offset,
            rows, cols, eps, no_stats, no_stats, centre, 0, rows,
        )  # fmt: skip
        return (y, h, None, None) if centre else (y, h, None)

    return run


def _tensor_params(weight: Any, bias: Any, k: KernelTypes, compute: Any, x: Any) -> _Params | None:
    """Weight and bias as the address entries read them: their addresses (the stand-ins' for
    absent ones) and an empty array of the type they are stored in (``p_like``): the compute
    dtype (``compute``, a torch dtype), or another float dtype (x's half dtype, a bfloat16
    weight beside float32 x, …), which the entries convert themselves. None when one must be
    converted first (:func:`_converted_params`: the two stored differently, strided,
    misaligned)."""
    if weight is not None:
        stored = weight.dtype
    elif bias is not None:
        stored = bias.dtype
    else:
        return k.ones_at, k.zeros_at, k.compute_like
    if stored is compute:
        like, w_at, b_at = k.compute_like, k.ones_at, k.zeros_at
    elif k.bits is not None and stored is x.dtype:
        like, w_at, b_at = k.element, k.half_ones_at, k.half_zeros_at
    else:
        stand_ins = _stored_stand_ins(stored, k)
        if stand_ins is None:
            return None
        like, w_at, b_at = stand_ins
    size = like.itemsize
    if weight is not None:
        w_at = weight.data_ptr()
        if w_at % size or not weight.is_contiguous():
            return None
    if bias is not None:
        b_at = bias.data_ptr()
        if bias.dtype is not stored or b_at % size or not bias.is_contiguous():
            return None
    return w_at, b_at, like


def _converted_params(weight: Any, bias: Any, k: KernelTypes) -> tuple[_Params, Any]:
    """:func:`_tensor_params` of weight and bias converted to contiguous compute-dtype tensors
    where needed, with the converted copies to keep alive while the kernel runs."""
    w_at, w_kept = _tensor_address(weight, k, k.ones_at)
    b_at, b_kept = _tensor_address(bias, k, k.zeros_at)
    return (w_at, b_at, k.compute_like), (w_kept, b_kept)


def _tensor_address(p: Any, k: KernelTypes, absent: int) -> tuple[int, Any]:
    """The address of a weight or bias tensor as ``cols`` contiguous compute-dtype elements
    (``absent`` when ``p`` is None), and the converted copy to keep alive while the kernel
    runs (None when ``p`` is read in place)."""
    if p is None:
        return absent, None
    if p.dtype is _torch_compute(k.compute) and p.is_contiguous():
        address = p.data_ptr()
        if address % k.compute.itemsize == 0:
            return address, None
    # Tensor.float() / .double(): half the time of .to(dtype); a no-op on the target dtype
    kept = p.float() if k.compute.itemsize == 4 else p.double()
    if not _addressable(kept, k.compute.itemsize):  # strided or misaligned
        kept = kept.clone(memory_format=_torch().contiguous_format)
    return kept.data_ptr(), kept


def _add_entry(kernel: str, keep_h: bool, plan: Plan) -> str:
    """The name of a fused address entry for ``plan``: with h or without, on a float32 stream
    or a residual of x's dtype (each another specialization)."""
    stream = "" if plan.residual_dtype is None else " on a float32 stream"
    return f"{kernel}{' with h' if keep_h else ''}{stream}"


#: The residual's (and h's) type for the fused address entries on a float32 stream.
_STREAM: Final = np.empty((0, 0), np.float32)


def _stored_stand_ins(stored: Any, k: KernelTypes) -> tuple[np.ndarray, int, int] | None:
    """For parameters stored as the torch float dtype ``stored`` (neither the compute dtype nor
    x's half dtype): the empty array of their type in the entries (``p_like``) and the
    addresses of ``cols`` ones and zeros stored so (an absent weight's and bias's stand-ins);
    None for a dtype the entries do not read. Kept in ``k.stored`` (the stand-ins live as long
    as the call's ``k``): a repeated call reads one entry."""
    found = k.stored.get(stored)
    if found is not None:
        return found[:3]  # type: ignore[no-any-return]
    torch = _torch()
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
    name = (names | {torch.float32: "float32", torch.float64: "float64"}).get(stored)
    if name is None:
        return None
    cols = k.ones.shape[0]  # short rows: the stand-ins are cols long
    ones, zeros = stand_in(cols, name, 1.0), stand_in(cols, name, 0.0)
    like = np.empty((0, 0), BITS[name] if name in BITS else np.dtype(name))
    k.stored[stored] = (like, ones.ctypes.data, zeros.ctypes.data, ones, zeros)
    return like, ones.ctypes.data, zeros.ctypes.data


def _entry_name(name: str, k: KernelTypes, p_like: Any) -> str:
    """The key in ``k.entries`` of the address entry ``name`` for parameters stored as
    ``p_like``: those stored in another type than the compute dtype make another
    specialization each."""
    return name if p_like is k.compute_like else f"{name}, parameters of {p_like.dtype}"


def _entry_point(kernel: Any, args: tuple[Any, ...]) -> Any:
    """Run ``kernel`` on ``args`` through numba's dispatcher (which compiles or loads the
    signature of their types) and return that signature's entry point: the compiled function
    itself, without the dispatcher's typing of every argument (about a third of a µs of 14).

    Only for the address entries, where every array argument is the backend's own (the
    kernel-type stand-ins, the statistics: each of one fixed numba type per
    :class:`KernelTypes`), the caller's memory travels as integers and eps as a float: the
    types of a later call's arguments are those of ``args``, so numba's dispatch would pick
    this very entry."""
    kernel(*args)
    return kernel.get_overload(tuple(kernel.typeof_pyval(a) for a in args))


def _addressable(t: Any, itemsize: int) -> bool:
    """Whether the tensor ``t`` is C-contiguous memory aligned to ``itemsize``, as
    :mod:`numba_addressed` reads it: its values in that memory as they are (not a negated
    view), and memory there at all (a storage resized to 0 has address 0)."""
    if not t.is_contiguous() or t.is_neg():
        return False
    address = t.data_ptr()
    return address != 0 and address % itemsize == 0  # type: ignore[no-any-return]


def _tensor_output(like: Any, dtype: str, plan: Plan) -> Any:
    """A new C-contiguous tensor like ``like`` (of dtype ``dtype``, ``(plan.rows, plan.cols)``):
    from the output pool when it is large (a fresh large tensor page-faults), else
    ``torch.empty_like``."""
    if plan.rows * plan.cols * like.element_size() < output_pool.MIN_BYTES:
        return _torch().empty_like(like, memory_format=_torch().contiguous_format)
    stored = _TENSOR_STORAGE[dtype]
    return _numpy_as_tensor(output_pool.POOL.empty((plan.rows, plan.cols), stored), dtype)


#: The NumPy dtype a pooled tensor output of each dtype is made from (bfloat16: its bits).
_TENSOR_STORAGE: Final[dict[str, np.dtype[Any]]] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.int16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


# --------------------------------------------------------------------------------------------
# Autograd: refused, never detached


def _refuse_graph(plan: Plan) -> None:
    """A forward call whose tensors require grad, in grad mode, never reaches the kernels (the
    core runs such calls through normlab's custom ops, with detached tensors): refused, never
    detached."""
    if plan.requires_grad and _torch().is_grad_enabled():
        raise BackendError(_NO_GRAPH)


def _refuse_grad(*tensors: Any) -> None:
    """:func:`_refuse_graph` of a backward call, from its tensors."""
    import torch

    needs_graph = tensors[0].requires_grad
    if not needs_graph and torch.is_grad_enabled():
        for t in tensors[1:]:  # a loop: any() over a generator costs a third of a µs more
            if t is not None and t.requires_grad:
                needs_graph = True
                break
    if needs_graph:
        raise BackendError(_NO_GRAPH)


_NO_GRAPH: Final = (
    "the numba backend does not record autograd graphs, and a tensor of this call requires "
    "grad; call normlab's functions (which keep the graph through normlab's custom ops), use "
    "backend='torch', or pass detached tensors"
)


# --------------------------------------------------------------------------------------------
# Tensors as NumPy arrays and back, and torch's dtypes


#: torch's dtype of each NumPy compute dtype, filled on the first tensor call (an import
#: statement per call costs more than the lookup).
_TORCH_COMPUTE: dict[np.dtype[Any], Any] = {}


def _tensor_parameter(p: Any, compute: Any) -> np.ndarray | None:
    """A weight or bias tensor as a compute-dtype NumPy array (``cols`` elements; a copy only
    when its dtype differs). Detaching is safe here: grad mode is off if ``p`` requires grad."""
    if p is None:
        return None
    target = _torch_compute(compute)
    if p.dtype is target and not p.requires_grad:
        return p.numpy()  # type: ignore[no-any-return]
    return np.asarray(p.detach().to(target).numpy())


def _torch_compute(compute: np.dtype[Any]) -> Any:
    """torch's dtype of the NumPy compute dtype ``compute``."""
    target = _TORCH_COMPUTE.get(compute)
    if target is None:
        torch = _torch()
        target = _TORCH_COMPUTE[compute] = torch.float64 if compute == np.float64 else torch.float32
    return target


def _torch() -> Any:
    """The torch module (imported by the caller: these arguments are tensors)."""
    return sys.modules["torch"]


def _tensor_as_numpy(t: Any, bfloat16: bool) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory, strides kept; a ``bfloat16`` tensor (the plan's
    dtype says which) as uint16 bit patterns."""
    if bfloat16:
        import torch

        return np.asarray(t.view(torch.int16).numpy()).view(np.uint16)
    return t.numpy()  # type: ignore[no-any-return]


def _numpy_as_tensor(a: np.ndarray, dtype: str) -> Any:
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


#: The torch family's adapter.
TENSORS: Final = Family(
    normalize=normalize,
    add_normalize=add_normalize,
    backward=backward,
    serial_rows=serial_rows,
    serial_add_rows=serial_add_rows,
)
