"""Arrays for tests, fuzzers and benchmarks: dtypes by name, memory layouts, conversions.

One place for what every test module needs around arrays: the NumPy or torch dtype of a dtype
name (bfloat16 from ml_dtypes), an array's dtype name, NumPy copies of NumPy, torch and CuPy
arrays (any device), the memory layouts the suite and the fuzzers test, and the conversions by
which the conformance suite makes and reads a backend's arrays (:func:`conversion`; a backend can
be driven with arrays of a family it serves beside its own, say CUDA torch tensors through ``cupy``:
:func:`drive`). torch, ml_dtypes, CuPy and array_api_compat are imported when used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np

from normlab import reference, registry
from normlab.testing.default_choice import default_family, is_default

__all__ = [
    "LAYOUTS",
    "NUMPY_LAYOUTS",
    "Conversion",
    "LayoutUnavailable",
    "arrange",
    "as_float64",
    "conversion",
    "drive",
    "driven_family",
    "dtype_name",
    "finfo",
    "numpy_dtype",
    "numpy_layout",
    "to_numpy",
    "torch_dtype",
]


# --------------------------------------------------------------------------------------------
# Dtypes


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype called ``name`` (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bfloat16
    return np.dtype(name)


def torch_dtype(name: str) -> Any:
    """The torch dtype called ``name`` (``torch.bfloat16`` for ``"bfloat16"``)."""
    import torch

    return getattr(torch, name)


def finfo(name: str) -> Any:
    """The float limits of dtype ``name`` (``ml_dtypes.finfo`` for bfloat16)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(ml_dtypes.bfloat16)  # type: ignore[no-untyped-call]
    return np.finfo(np.dtype(name))


def dtype_name(a: Any) -> str:
    """The dtype name of a NumPy, CuPy or torch array (``"float32"``, ``"bfloat16"``…)."""
    if type(a).__module__.startswith("torch"):
        return str(a.dtype).removeprefix("torch.")
    return str(np.dtype(a.dtype).name)


# --------------------------------------------------------------------------------------------
# Conversions to NumPy


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy copy of a NumPy, torch (any device) or CuPy array; bfloat16 stays bfloat16."""
    module = type(a).__module__
    if module.startswith("torch"):
        from normlab.backends.torch_backend import to_numpy as torch_to_numpy

        return torch_to_numpy(a)
    if module.startswith("cupy"):
        import cupy

        return np.asarray(cupy.asnumpy(a))
    return np.array(a, copy=True)


def as_float64(a: Any) -> np.ndarray:
    """A float64 NumPy copy of a NumPy, torch or CuPy array of any real dtype."""
    return reference.to_float64(to_numpy(a)).copy()


# --------------------------------------------------------------------------------------------
# Memory layouts

#: Memory layouts of an array of any family (same values, different strides).
LAYOUTS: Final = (
    "c",  # C-contiguous
    "fortran",  # Fortran order (all axes reversed in memory)
    "transposed",  # the last two axes swapped in memory
    "sliced",  # every axis sliced with step 2 out of a larger array (NaN in between)
    "padded",  # the last axis sliced out of a wider array (NaN padding)
    "reversed",  # every axis reversed (negative strides)
    "broadcast",  # axis 0 broadcast from size 1 (zero stride)
)

#: Layouts only NumPy arrays have, besides :data:`LAYOUTS`.
NUMPY_LAYOUTS: Final = (
    "swapped",  # the other byte order
    "readonly",  # not writeable
    "unaligned",  # one byte past an aligned address
    "odd_strides",  # a field of a structured array: strides not a multiple of the item size
)


class LayoutUnavailable(Exception):
    """The array family cannot make this layout (say, no negative strides)."""


class MakesArrays(Protocol):
    """Anything with a ``from_numpy`` (a backend, a :class:`Conversion`, the suite's Subject)."""

    def from_numpy(self, a: np.ndarray) -> Any: ...


def arrange(x: np.ndarray, layout: str, maker: MakesArrays) -> Any:
    """``x`` as an array made by ``maker.from_numpy`` with ``layout``'s strides (see
    :data:`LAYOUTS`) and x's values (broadcast: row 0's). A 0-d x stays C-ordered.

    Raises :class:`LayoutUnavailable` when the family cannot make the layout.
    """
    ndim = x.ndim
    if layout == "c" or (ndim == 0 and layout in LAYOUTS):
        return maker.from_numpy(x)
    if layout in ("fortran", "transposed"):
        order = tuple(range(ndim))[::-1]
        if layout == "transposed":
            order = (*range(ndim - 2), ndim - 1, ndim - 2) if ndim >= 2 else (0,)
        stored = maker.from_numpy(np.ascontiguousarray(x.transpose(order)))
        return _namespace(stored).permute_dims(stored, order)
    if layout in ("sliced", "padded"):
        if layout == "sliced":
            view: tuple[slice, ...] = (slice(None, None, 2),) * ndim
            big = tuple(2 * n for n in x.shape)
        else:
            view = (*(slice(None),) * (ndim - 1), slice(0, x.shape[-1]))
            big = (*x.shape[:-1], x.shape[-1] + 3)
        memory = np.zeros(big, dtype=x.dtype)
        try:
            memory[...] = np.nan
        except (TypeError, ValueError):  # no NaN in the dtype (integers, say): zeros between
            memory[...] = 0
        memory[view] = x
        return maker.from_numpy(memory)[view]
    if layout == "reversed":
        flip = (slice(None, None, -1),) * ndim
        stored = maker.from_numpy(np.ascontiguousarray(x[flip]))
        try:
            return stored[flip]
        except Exception as exc:  # torch: "step must be greater than zero"
            raise LayoutUnavailable(f"{type(exc).__name__}: {exc}") from exc
    if layout == "broadcast":
        stored = maker.from_numpy(np.ascontiguousarray(x[:1]))
        return _namespace(stored).broadcast_to(stored, x.shape)
    raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")


def numpy_layout(a: np.ndarray, layout: str) -> np.ndarray:
    """``a`` re-laid out in NumPy memory: any of :data:`LAYOUTS` and :data:`NUMPY_LAYOUTS`
    (a layout a's dtype cannot have, say another byte order of bool, leaves ``a`` as it is)."""
    if layout == "swapped":
        swappable = a.dtype.kind in "fciu" and a.dtype.itemsize > 1
        return a.astype(a.dtype.newbyteorder()) if swappable else a
    if layout == "readonly":
        frozen = a.copy()
        frozen.flags.writeable = False
        return frozen
    if layout == "unaligned" and a.dtype.kind != "O":
        memory = np.zeros(a.nbytes + 1, np.uint8)[1:].view(a.dtype).reshape(a.shape)
        memory[...] = a
        return memory
    if layout == "odd_strides" and a.dtype.kind != "O":
        padded = np.zeros(a.shape, dtype=[("v", a.dtype), ("pad", np.uint8)])
        padded["v"] = a
        return padded["v"]
    if layout in NUMPY_LAYOUTS:
        return a
    arranged: np.ndarray = arrange(a, layout, _NUMPY)
    return arranged


class _NumpyCopies:
    def from_numpy(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, copy=True)


_NUMPY: Final = _NumpyCopies()


def _namespace(a: Any) -> Any:
    import array_api_compat

    return array_api_compat.array_namespace(a)


# --------------------------------------------------------------------------------------------
# How the conformance suite makes and reads a backend's arrays


@dataclass(frozen=True)
class Conversion:
    """A backend's arrays to and from NumPy, as the suite makes and reads them."""

    #: the array family made (``"numpy"``, ``"cupy"``, ``"torch"``…)
    family: str
    from_numpy: Callable[[np.ndarray], Any]
    to_numpy: Callable[[Any], np.ndarray]


#: backend name -> the family it is driven with, where not its record's own (see drive()).
_DRIVEN: dict[str, str] = {}


def drive(backend: str, family: str | None) -> None:
    """Make the suite drive ``backend`` with arrays of ``family`` (None: its record's own, the
    default), on the backend's device. ``family`` must be one the record serves beside its own
    (``zero_copy_families`` or ``explicit_families``), and a backend that serves it (its
    ``families``) must be registered: its ``from_numpy``/``to_numpy`` convert, then the array
    moves to the device.

    Raises ValueError when the backend does not serve ``family``.
    """
    if family is None:
        _DRIVEN.pop(backend, None)
        return
    record = registry.get(backend)
    borrowed = record.zero_copy_families | record.explicit_families
    if family not in borrowed:
        raise ValueError(
            f"backend {backend!r} is not driven by {family} arrays: its record serves "
            f"{', '.join(sorted(record.families))} arrays, and beside them "
            f"{', '.join(sorted(borrowed)) or 'none'}"
        )
    _owner(family)
    _DRIVEN[backend] = family


def driven_family(backend: str) -> str | None:
    """The family :func:`drive` set for ``backend``, or None (its record's own)."""
    return _DRIVEN.get(backend)


def conversion(backend: str) -> Conversion:
    """How the suite makes and reads ``backend``'s arrays: its record's ``from_numpy`` and
    ``to_numpy``, or, when :func:`drive` named a family, that family's on the backend's device
    (the first device the record lists other than ``cpu``, if any). A default subject
    (``default:FAMILY``) uses the family's own backend's."""
    if is_default(backend):
        family = default_family(backend)
        owner = _owner(family)
        return Conversion(family, owner.from_numpy, owner.to_numpy)
    record = registry.get(backend)
    driven = _DRIVEN.get(backend)
    if driven is None:
        return Conversion(_family_of(record), record.from_numpy, record.to_numpy)
    family = driven
    owner = _owner(family)
    devices = sorted(record.devices - {"cpu"}) or ["cpu"]
    device = devices[0]

    def made(a: np.ndarray) -> Any:
        array = owner.from_numpy(a)
        if device == "cpu":
            return array
        import array_api_compat

        return array_api_compat.to_device(array, device)

    return Conversion(family, made, owner.to_numpy)


def _family_of(record: registry.Backend) -> str:
    families = sorted(record.families)
    return families[0] if len(families) == 1 else "/".join(families)


def _owner(family: str) -> registry.Backend:
    """A registered backend whose record serves ``family`` (its conversions make such arrays)."""
    for b in registry.list_backends():
        if family in b.families:
            return b
    raise ValueError(f"no registered backend serves {family} arrays: none can make them")
