"""What kind of array is this? Family, device and layout, without importing any array library.

An array's *family* is the library it belongs to (``"numpy"``, ``"torch"``, ``"cupy"``, ``"jax"``,
``"dask"``, or the top-level module name of anything else). It is read from the module names on
the array type's MRO, so a NumPy subclass is still ``"numpy"`` and no library is ever imported
here. Each array type gets one :class:`Inspector`, cached per type, which reads the metadata that
validation and dispatch need: a cheap hashable ``key`` for the call cache, and a full
:class:`ArrayInfo` on a cache miss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from normlab.errors import DtypeError, LayoutError

__all__ = [
    "ArrayInfo",
    "Inspector",
    "comparable_devices",
    "family_of",
    "info",
    "inspector",
    "is_array",
]

KNOWN_FAMILIES: Final = ("numpy", "torch", "cupy", "jax", "dask")
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


def _dtype_name(dtype: Any) -> str:
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    text = str(dtype)
    return text.removeprefix("torch.")


class Inspector:
    """Reads metadata of arrays of one type; subclasses know one family each."""

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

    def _device(self, x: Any) -> str:
        import array_api_compat

        try:
            return str(array_api_compat.device(x))
        except Exception:  # a library array_api_compat does not know: assume host memory
            return "cpu"


def _device_kind(device: str) -> str:
    lowered = device.lower()
    if "cuda" in lowered or "gpu" in lowered:
        return "cuda"
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


class TorchInspector(Inspector):
    def key(self, x: Any) -> tuple[Any, ...]:
        return (x.dtype, x.shape, x.stride(), x.device, x.requires_grad)

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

    def address(self, x: Any) -> int:
        return int(x.data_ptr())

    def memory(self, x: Any) -> Memory:
        size = x.element_size()
        return Memory(x.data_ptr(), tuple(x.shape), tuple(s * size for s in x.stride()), size)


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


class JaxInspector(Inspector):
    """JAX arrays: immutable, no strides; a tracer (inside ``jit``/``grad``/``vmap``) has no
    concrete device and is named ``"<kind>:traced"``, a sharded array ``"<kind>:sharded"``."""

    def key(self, x: Any) -> tuple[Any, ...]:
        return (x.dtype, x.shape, self._device(x))

    def info(self, x: Any) -> ArrayInfo:
        device = self._device(x)
        return ArrayInfo(
            family="jax",
            type_name=self.type_name,
            dtype=_dtype_name(x.dtype),
            shape=tuple(x.shape),
            strides=None,
            itemsize=x.dtype.itemsize,
            device=device,
            device_kind=device.split(":")[0],
            writeable=False,
        )

    def _device(self, x: Any) -> str:
        try:
            devices = x.devices()
        except Exception:  # a tracer: placement is decided by JAX when it runs
            import jax

            return f"{_platform_kind(jax.default_backend())}:traced"
        if len(devices) != 1:
            return f"{_platform_kind(next(iter(devices)).platform)}:sharded"
        device = next(iter(devices))
        return f"{_platform_kind(device.platform)}:{device.id}"


class DaskInspector(Inspector):
    """Dask arrays: lazy, immutable; the device is that of the chunk type (``_meta``)."""

    def key(self, x: Any) -> tuple[Any, ...]:
        return (x.dtype, x.shape, type(getattr(x, "_meta", None)))

    def info(self, x: Any) -> ArrayInfo:
        meta_type: Any = type(getattr(x, "_meta", None))
        chunk_family = _family_of_type(meta_type)
        device = "cuda" if chunk_family == "cupy" else "cpu"
        return ArrayInfo(
            family="dask",
            type_name=self.type_name,
            dtype=_dtype_name(x.dtype),
            shape=tuple(x.shape),
            strides=None,
            itemsize=x.dtype.itemsize,
            device=device,
            device_kind=device,
            writeable=False,
        )


def _platform_kind(platform: str) -> str:
    return "cuda" if platform in ("gpu", "cuda", "rocm") else platform


def comparable_devices(a: str, b: str) -> bool:
    """Whether arrays on devices ``a`` and ``b`` may be used together: the same device, or a
    device that is only known when the computation runs (a JAX tracer or a sharded array)."""
    if a == b:
        return True
    unknown = (":traced", ":sharded")
    return a.split(":")[0] == b.split(":")[0] and (a.endswith(unknown) or b.endswith(unknown))


_INSPECTORS: Final[dict[str, type[Inspector]]] = {
    "numpy": NumpyInspector,
    "torch": TorchInspector,
    "cupy": CupyInspector,
    "jax": JaxInspector,
    "dask": DaskInspector,
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


def inspector(array_type: type) -> Inspector:
    """The :class:`Inspector` for arrays of ``array_type`` (one per type, cached)."""
    found = _by_type.get(array_type)
    if found is None:
        family = _family_of_type(array_type)
        found = _INSPECTORS.get(family, Inspector)(array_type, family)
        if len(_by_type) >= _MAX_TYPES:
            _by_type.clear()
        _by_type[array_type] = found
    return found


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
