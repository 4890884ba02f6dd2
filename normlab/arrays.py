"""What kind of array is this, and the few things the core does to one, per array family.

An array's *family* is the library it belongs to (``"numpy"``, ``"torch"``, ``"cupy"``, ``"jax"``,
``"dask"``, or the top-level module name of anything else). It is read from the module names on
the array type's MRO, so a NumPy subclass is still ``"numpy"`` and no library is ever imported
here. Each array type gets one :class:`Inspector`, cached per type, which reads the metadata that
validation and dispatch need (a cheap hashable ``key`` for the call cache, and a full
:class:`ArrayInfo` on a cache miss) and performs the family's layout operations for the core
(:func:`permute`, :func:`reshape`, :func:`contiguous`, :func:`copy_into`, :func:`mark_written`,
:func:`astype`), each in the library's own terms.

Where an inspector comes from, for a type's family: the core's own for NumPy, PyTorch and CuPy;
else one that a backend record supplies (``BackendRecord.inspector``, looked up through
:func:`use_supplied_inspectors`, which the registry installs: normlab-jax and normlab-dask supply
theirs); else :class:`ArrayApiInspector` for a type that exposes ``__array_namespace__``; else
the generic :class:`Inspector`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from normlab.errors import DtypeError, LayoutError

__all__ = [
    "ArrayApiInspector",
    "ArrayInfo",
    "Inspector",
    "array_api_families",
    "astype",
    "comparable_devices",
    "contiguous",
    "copy_into",
    "detach",
    "family_of",
    "forget_inspectors",
    "info",
    "inspector",
    "is_array",
    "mark_written",
    "permute",
    "reshape",
    "use_supplied_inspectors",
]

KNOWN_FAMILIES: Final = ("numpy", "torch", "cupy", "jax", "dask")
#: The families whose inspector is the core's own: a record cannot supply one for them.
CORE_FAMILIES: Final = frozenset({"numpy", "torch", "cupy"})
_MODULE_ALIASES: Final = {"jaxlib": "jax"}
_MAX_TYPES: Final = 512


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    """Metadata of one array, as validation and dispatch see it.

    ``strides`` are in elements (``None`` when the library has no strided memory, as JAX and
    Dask, or when a byte stride is not a whole number of elements). ``device`` is a full name
    (``"cpu"``, ``"cuda:0"``); ``device_kind`` its kind (``"cpu"``, ``"cuda"``).
    """

    family: str
    type_name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    itemsize: int
    device: str
    device_kind: str
    requires_grad: bool = False
    writeable: bool = True
    masked: bool = False
    native_byte_order: bool = True

    @property
    def ndim(self) -> int:
        return len(self.shape)


class Memory(NamedTuple):
    """Where an array's elements lie: the address of element 0, the shape, the strides in bytes
    and the item size. Device addresses too: they are compared, never dereferenced."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    def extent(self) -> tuple[int, int] | None:
        """The bytes ``[first, last + 1)`` the elements span; None when there is none."""
        low = high = self.address
        for n, s in zip(self.shape, self.strides, strict=True):
            if n == 0:
                return None
            if s < 0:
                low += (n - 1) * s
            else:
                high += (n - 1) * s
        return low, high + self.itemsize


def _dtype_name(dtype: Any) -> str:
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    text = str(dtype)
    return text.removeprefix("torch.")


class Inspector:
    """Reads metadata of arrays of one type and performs the core's layout operations on them;
    subclasses know one family each. A plugin may subclass it for its family and name the
    subclass in its record (``BackendRecord.inspector``); the methods below are what it may
    override, each with the contract stated here.

    The operations run only on arrays of this inspector's type, whose library is imported.
    """

    family: str = "unknown"

    def __init__(self, array_type: type, family: str) -> None:
        self.array_type = array_type
        self.family = family
        self.type_name = f"{array_type.__module__}.{array_type.__qualname__}"

    def key(self, x: Any) -> tuple[Any, ...]:
        """A hashable summary of everything validation depends on (dtype, shape, layout, device)."""
        return (str(x.dtype), tuple(x.shape), self._device(x))

    def info(self, x: Any) -> ArrayInfo:
        """The full metadata of ``x``."""
        device = self._device(x)
        return ArrayInfo(
            family=self.family,
            type_name=self.type_name,
            dtype=_dtype_name(x.dtype),
            shape=tuple(int(n) for n in x.shape),
            strides=None,
            itemsize=int(getattr(x.dtype, "itemsize", 0) or 0),
            device=device,
            device_kind=_device_kind(device),
        )

    def address(self, x: Any) -> int | None:
        """The address of element 0, or ``None`` when the library has no addressable memory."""
        return None

    def memory(self, x: Any) -> Memory | None:
        """Where ``x``'s elements lie (for overlap tests), or ``None`` without addressable memory
        or strides."""
        address = self.address(x)
        info = self.info(x)
        if address is None or info.strides is None:
            return None
        strides = tuple(s * info.itemsize for s in info.strides)
        return Memory(address, info.shape, strides, info.itemsize)

    def extent(self, x: Any) -> tuple[int, int] | None:
        """The bytes ``[first, last + 1)`` ``x``'s elements span (:meth:`Memory.extent`); None
        without addressable memory or elements. Overlap tests read it first: disjoint extents
        settle most pairs without the full layout."""
        memory = self.memory(x)
        return None if memory is None else memory.extent()

    def _device(self, x: Any) -> str:
        import array_api_compat

        try:
            return str(array_api_compat.device(x))
        except Exception:  # a library array_api_compat does not know: assume host memory
            return "cpu"

    # The family operations: what layout and the backward do to a caller's arrays.

    def permute(self, a: Any, order: tuple[int, ...]) -> Any:
        """``a`` with its axes in ``order`` (a view where the library has views)."""
        import array_api_compat

        return array_api_compat.array_namespace(a).permute_dims(a, order)

    def reshape(self, a: Any, shape: tuple[int, ...]) -> Any:
        """``a`` with shape ``shape`` (a view where its layout allows)."""
        return a.reshape(shape)

    def contiguous(self, a: Any) -> Any:
        """``a`` in C order, in native byte order (``a`` itself when it already is, or when the
        library has no strided memory)."""
        return a

    def copy_into(self, dst: Any, src: Any) -> None:
        """Write ``src``'s elements into ``dst`` (same shape) in place."""
        dst[...] = src

    def mark_written(self, a: Any) -> None:
        """Tell the library that a backend wrote ``a`` through its memory, behind its back.
        Nothing to tell by default."""

    def astype(self, a: Any, dtype: Any) -> Any:
        """``a`` converted to ``dtype`` (a dtype object of the library; ``a`` when it has it)."""
        return a.astype(dtype)

    def detach(self, a: Any) -> Any:
        """``a``'s values without its autograd history (``a`` itself in a library without
        one)."""
        return a


def _device_kind(device: str) -> str:
    lowered = device.lower()
    if "cuda" in lowered or "gpu" in lowered:
        return "cuda"
    if "cpu" in lowered:
        return "cpu"
    return lowered.split(":")[0] if lowered else "cpu"


class NumpyInspector(Inspector):
    """NumPy arrays and their subclasses. A subclass (``np.memmap``, a user's own) is read as
    the ndarray it is and the result is a plain ``np.ndarray``; ``np.matrix`` is refused, since
    it is always 2-D and its ``*`` is a matrix product, so no result could honestly be one."""

    def key(self, x: Any) -> tuple[Any, ...]:
        return (x.dtype, x.shape, x.strides)

    def info(self, x: Any) -> ArrayInfo:
        if any(
            c.__name__ == "matrix" and c.__module__.startswith("numpy") for c in type(x).__mro__
        ):
            raise DtypeError(
                "np.matrix is not accepted (it is always 2-D and its * is a matrix product); "
                "use np.asarray(x) to pass its data as an ndarray"
            )
        itemsize = x.dtype.itemsize
        strides: tuple[int, ...] | None = tuple(s // itemsize for s in x.strides)
        if any(s % itemsize for s in x.strides):
            strides = None
        return ArrayInfo(
            family="numpy",
            type_name=self.type_name,
            dtype=x.dtype.name,
            shape=x.shape,
            strides=strides,
            itemsize=itemsize,
            device="cpu",
            device_kind="cpu",
            writeable=bool(x.flags.writeable),
            masked=type(x).__module__.startswith("numpy.ma"),
            native_byte_order=x.dtype.isnative,
        )

    def address(self, x: Any) -> int:
        return int(x.__array_interface__["data"][0])

    def memory(self, x: Any) -> Memory:
        return Memory(self.address(x), x.shape, x.strides, x.itemsize)

    def permute(self, a: Any, order: tuple[int, ...]) -> Any:
        return a.transpose(order)

    def contiguous(self, a: Any) -> Any:
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        return sys.modules["numpy"].ascontiguousarray(a)

    def copy_into(self, dst: Any, src: Any) -> None:
        sys.modules["numpy"].copyto(dst, src)


class TorchInspector(Inspector):
    def key(self, x: Any) -> tuple[Any, ...]:
        # "cpu" for a CPU tensor's device: a torch.device hashes and compares slowly (per call)
        device = "cpu" if x.is_cpu else x.device
        return (x.dtype, x.shape, x.stride(), device, x.requires_grad)

    def info(self, x: Any) -> ArrayInfo:
        if getattr(x, "is_nested", False):
            raise LayoutError(
                "a nested tensor has no single (rows, cols) layout; normlab normalizes dense "
                "(torch.strided) tensors: normalize each component of x.unbind(), or, for a "
                "jagged tensor normalized over its last dim, x.values()"
            )
        if str(x.layout) != "torch.strided":
            raise LayoutError(
                f"a tensor with layout {x.layout} (sparse) is not dense; normlab normalizes dense "
                "(torch.strided) tensors: convert with x.to_dense() (normalizing would fill "
                "the zeros anyway)"
            )
        device = str(x.device)
        return ArrayInfo(
            family="torch",
            type_name=self.type_name,
            dtype=str(x.dtype).removeprefix("torch."),
            shape=tuple(x.shape),
            strides=tuple(x.stride()),
            itemsize=x.element_size(),
            device=device,
            device_kind=x.device.type,
            requires_grad=bool(x.requires_grad),
        )

    def address(self, x: Any) -> int | None:
        try:
            return int(x.data_ptr())
        except RuntimeError:  # a fake or functional tensor (a trace's): no memory of its own
            return None

    def memory(self, x: Any) -> Memory | None:
        address = self.address(x)
        if address is None:
            return None
        size = x.element_size()
        return Memory(address, tuple(x.shape), tuple(s * size for s in x.stride()), size)

    def extent(self, x: Any) -> tuple[int, int] | None:
        if x.is_contiguous():  # without the layout: the common case of out= costs less
            n = x.numel()
            start = self.address(x) if n else None
            return None if start is None else (start, start + n * x.element_size())
        return super().extent(x)

    def permute(self, a: Any, order: tuple[int, ...]) -> Any:
        return a.permute(order)

    def contiguous(self, a: Any) -> Any:
        return a.contiguous()

    def copy_into(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def mark_written(self, a: Any) -> None:
        """The tensor's version counter is bumped, as torch's own in-place operations do, so
        that a graph which saved ``a`` for its backward refuses the modified values instead of
        using them. (Copies into ``out`` made with :meth:`copy_into` count already.)"""
        sys.modules["torch"].autograd.graph.increment_version(a)

    def astype(self, a: Any, dtype: Any) -> Any:
        return a.to(dtype)

    def detach(self, a: Any) -> Any:
        return a.detach()


class CupyInspector(Inspector):
    def key(self, x: Any) -> tuple[Any, ...]:
        return (x.dtype, x.shape, x.strides, x.device.id)

    def info(self, x: Any) -> ArrayInfo:
        itemsize = x.dtype.itemsize
        strides: tuple[int, ...] | None = tuple(s // itemsize for s in x.strides)
        if any(s % itemsize for s in x.strides):
            strides = None
        return ArrayInfo(
            family="cupy",
            type_name=self.type_name,
            dtype=x.dtype.name,
            shape=x.shape,
            strides=strides,
            itemsize=itemsize,
            device=f"cuda:{x.device.id}",
            device_kind="cuda",
            native_byte_order=x.dtype.isnative,
        )

    def address(self, x: Any) -> int:
        return int(x.data.ptr)

    def memory(self, x: Any) -> Memory:
        return Memory(self.address(x), x.shape, x.strides, x.itemsize)

    def permute(self, a: Any, order: tuple[int, ...]) -> Any:
        return a.transpose(order)

    def contiguous(self, a: Any) -> Any:
        return sys.modules["cupy"].ascontiguousarray(a)

    def copy_into(self, dst: Any, src: Any) -> None:
        sys.modules["cupy"].copyto(dst, src)


class ArrayApiInspector(Inspector):
    """Arrays of any other library that exposes the Array API standard (``__array_namespace__``):
    dtypes named as the namespace names them (``float64``, not ``array_api_strict.float64``),
    the device named as the library names it, and every layout operation done with the
    namespace's own functions (such an array need have no ``reshape`` or ``astype`` method).
    """

    def key(self, x: Any) -> tuple[Any, ...]:
        return (x.dtype, tuple(x.shape), x.device)

    def info(self, x: Any) -> ArrayInfo:
        xp = x.__array_namespace__()
        device = _array_api_device(x.device)
        return ArrayInfo(
            family=self.family,
            type_name=self.type_name,
            dtype=_array_api_dtype_name(xp, x.dtype),
            shape=tuple(int(n) for n in x.shape),
            strides=None,
            itemsize=_array_api_itemsize(xp, x.dtype),
            device=device,
            device_kind=_device_kind(device),
        )

    def _device(self, x: Any) -> str:
        return _array_api_device(x.device)

    def permute(self, a: Any, order: tuple[int, ...]) -> Any:
        return a.__array_namespace__().permute_dims(a, order)

    def reshape(self, a: Any, shape: tuple[int, ...]) -> Any:
        return a.__array_namespace__().reshape(a, shape)

    def astype(self, a: Any, dtype: Any) -> Any:
        return a.__array_namespace__().astype(a, dtype)


#: The dtype names of the Array API standard, and two that some namespaces add.
_ARRAY_API_DTYPES: Final = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
)


def _array_api_dtype_name(xp: Any, dtype: Any) -> str:
    """The name under which namespace ``xp`` defines ``dtype`` (``"float64"``); for a dtype
    it defines under no standard name, its own name without the module prefix."""
    for name in _ARRAY_API_DTYPES:
        candidate = getattr(xp, name, None)
        if candidate is not None and dtype == candidate:
            return name
    return _dtype_name(dtype).rpartition(".")[2]


def _array_api_itemsize(xp: Any, dtype: Any) -> int:
    """Bytes per element of ``dtype``, from the namespace's ``finfo``/``iinfo`` (0 when
    neither knows it, as for ``bool``)."""
    for kind in (xp.finfo, xp.iinfo):
        try:
            return int(kind(dtype).bits) // 8
        except Exception:  # not a dtype of this kind
            continue
    return 0


def _array_api_device(device: Any) -> str:
    """A device as the library names it: ``array_api_strict.Device('CPU_DEVICE')`` is
    ``"CPU_DEVICE"``; a plain name (``"cuda:0"``) stays as it is."""
    text = str(device)
    _, quote, rest = text.partition("('")
    if quote and rest.endswith("')"):
        return rest[:-2]
    return text


def comparable_devices(a: str, b: str) -> bool:
    """Whether arrays on devices ``a`` and ``b`` may be used together: the same device, or a
    device that is only known when the computation runs (a JAX tracer or a sharded array)."""
    if a == b:
        return True
    unknown = (":traced", ":sharded")
    return a.split(":")[0] == b.split(":")[0] and (a.endswith(unknown) or b.endswith(unknown))


_CORE_INSPECTORS: Final[dict[str, type[Inspector]]] = {
    "numpy": NumpyInspector,
    "torch": TorchInspector,
    "cupy": CupyInspector,
}


@functools.lru_cache(maxsize=_MAX_TYPES)
def _family_of_type(array_type: Any) -> str:
    for cls in array_type.__mro__:
        root = _root_module(cls)
        if root in KNOWN_FAMILIES:
            return root
    return _root_module(array_type)


def _root_module(cls: type) -> str:
    root = str(cls.__module__).split(".")[0]
    return _MODULE_ALIASES.get(root, root)


def family_of(x: Any) -> str:
    """The array library ``x`` belongs to, by module name (``"numpy"``, ``"torch"``, …)."""
    return inspector(type(x)).family


_by_type: dict[type, Inspector] = {}
#: The families read through :class:`ArrayApiInspector` so far (replaced, never mutated: read
#: by dispatch while another thread may add one).
_array_api_families: frozenset[str] = frozenset()


def _no_supplied_inspector(family: str) -> type[Inspector] | None:
    return None


_supplied: Callable[[str], type[Inspector] | None] = _no_supplied_inspector


def use_supplied_inspectors(lookup: Callable[[str], type[Inspector] | None]) -> None:
    """Install ``lookup(family)``: the :class:`Inspector` subclass a backend record supplies for
    ``family``, or ``None``. The registry installs it (this module imports nothing above it);
    it is asked once per array type of a family that is not NumPy, PyTorch or CuPy."""
    global _supplied
    _supplied = lookup
    forget_inspectors()


def forget_inspectors() -> None:
    """Forget every cached inspector (plugins came or went: a family's inspector may change)."""
    _by_type.clear()


def _inspector_class(array_type: type, family: str) -> type[Inspector]:
    core = _CORE_INSPECTORS.get(family)
    if core is not None:
        return core
    supplied = _supplied(family)
    if supplied is not None:
        return supplied
    if hasattr(array_type, "__array_namespace__"):
        global _array_api_families
        _array_api_families = _array_api_families | {family}
        return ArrayApiInspector
    return Inspector


def inspector(array_type: type) -> Inspector:
    """The :class:`Inspector` for arrays of ``array_type`` (one per type, cached)."""
    found = _by_type.get(array_type)
    if found is None:
        family = _family_of_type(array_type)
        found = _inspector_class(array_type, family)(array_type, family)
        if len(_by_type) >= _MAX_TYPES:
            _by_type.clear()
        _by_type[array_type] = found
    return found


def array_api_families() -> frozenset[str]:
    """The families met so far whose arrays are read through the Array API
    (:class:`ArrayApiInspector`): no inspector of their own, ``__array_namespace__`` exposed."""
    return _array_api_families


# The family operations, on any array (its inspector performs them).


def _of(a: Any) -> Inspector:
    """``a``'s inspector: :func:`inspector` without its call on a cached type (the family
    operations run several times per call)."""
    try:
        return _by_type[type(a)]
    except KeyError:
        return inspector(type(a))


def permute(a: Any, order: tuple[int, ...]) -> Any:
    """``a`` with its axes in ``order``; see :meth:`Inspector.permute`."""
    return _of(a).permute(a, order)


def reshape(a: Any, shape: tuple[int, ...]) -> Any:
    """``a`` with shape ``shape``; see :meth:`Inspector.reshape`."""
    return _of(a).reshape(a, shape)


def contiguous(a: Any) -> Any:
    """``a`` in C order and native byte order; see :meth:`Inspector.contiguous`."""
    return _of(a).contiguous(a)


def copy_into(dst: Any, src: Any) -> None:
    """Write ``src`` into ``dst`` in place; see :meth:`Inspector.copy_into`."""
    _of(dst).copy_into(dst, src)


def mark_written(a: Any) -> None:
    """Tell ``a``'s library a backend wrote it directly; see :meth:`Inspector.mark_written`."""
    _of(a).mark_written(a)


def astype(a: Any, dtype: Any) -> Any:
    """``a`` converted to ``dtype``; see :meth:`Inspector.astype`."""
    return _of(a).astype(a, dtype)


def detach(a: Any) -> Any:
    """``a`` without its autograd history; see :meth:`Inspector.detach`."""
    return _of(a).detach(a)


def info(x: Any) -> ArrayInfo:
    """The full :class:`ArrayInfo` of ``x``."""
    return inspector(type(x)).info(x)


def is_array(x: Any) -> bool:
    """Whether ``x`` looks like an array (has ``shape`` and ``dtype``).

    An object whose ``shape`` cannot even be read (a nested tensor) counts as an array here, so
    that reading its metadata reports what is wrong with it.
    """
    try:
        return hasattr(x, "shape") and hasattr(x, "dtype")
    except Exception:
        return True
