"""Device memory stood in for by host memory, for the CUDA launch tests without a GPU: a fake
``cupy.ndarray`` over a NumPy array, and the NumPy view of raw memory at an address, through which
the fake CuPy's kernels read and write what the launch's pointers point at."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np


class HostArray:
    """Stands in for a cupy.ndarray: host memory with ``data.ptr``, ``strides``, ``device``."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.data = SimpleNamespace(ptr=a.ctypes.data)
        self.strides, self.dtype, self.shape = a.strides, a.dtype, a.shape
        self.device = SimpleNamespace(id=0)

    def astype(self, dtype: Any) -> HostArray:
        return HostArray(self.a.astype(dtype))


def host_view(address: int, rows: int, cols: int, stride: int, dtype: np.dtype) -> np.ndarray:
    """The (rows, cols) array at ``address`` with row stride ``stride`` elements."""
    size = dtype.itemsize
    low = address + min(0, (rows - 1) * stride) * size
    high = address + (max(0, (rows - 1) * stride) + cols) * size
    base = np.frombuffer((ctypes.c_char * (high - low)).from_address(low), dtype)
    start = base[(address - low) // size :]
    return np.lib.stride_tricks.as_strided(start, (rows, cols), (stride * size, size))
