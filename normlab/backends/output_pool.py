"""Recycled memory for large outputs: a fresh ``numpy.empty`` of many MiB costs a page fault and
the kernel's zeroing of every page on first touch — as much time as writing the result again.

``POOL.empty`` (:meth:`OutputPool.empty`) hands out an array whose memory comes from a buffer
the caller has already released, when one of the same size is free, else a new one. The
array's base object (:class:`_Lease`) returns the buffer to the pool when it is deallocated,
that is when the caller's result and every view of it are gone: memory is never handed out
while anything can still read it through a result. Buffers are matched by exact size (a
serving loop repeats its shapes) and the pool holds at most ``NORMLAB_OUTPUT_POOL_MIB`` MiB
(default 256; 0 turns it off): a released buffer that does not fit in the room left makes room
by freeing the buffers released longest ago (the shapes a process has moved on from), and one
larger than the whole pool is freed. Outputs below
:data:`MIN_BYTES` come from ``numpy.empty`` directly: the C allocator already reuses warm
memory for those.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Any, Final

import numpy as np

from normlab.errors import NormlabWarning

__all__ = ["MIN_BYTES", "POOL", "OutputPool"]

#: Outputs smaller than this are plain ``numpy.empty`` arrays.
MIN_BYTES: Final = 1 << 20
_DEFAULT_MIB: Final = 256


class _Lease:
    """The base object of a pooled array: exposes the buffer's memory to NumPy and gives the
    buffer back to its pool when it is deallocated."""

    __slots__ = ("__array_interface__", "_buffer", "_pool")

    def __init__(self, buffer: np.ndarray, pool: OutputPool) -> None:
        self._buffer = buffer
        self._pool = pool
        self.__array_interface__ = {
            "version": 3,
            "shape": (buffer.nbytes,),
            "typestr": "|u1",
            "data": (buffer.ctypes.data, False),
        }

    def __del__(self) -> None:
        self._pool.give_back(self._buffer)


class OutputPool:
    """Released output buffers by size, at most ``capacity`` bytes in all."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[np.ndarray] = []  # released buffers, the longest released first
        self._held = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype``, uninitialized (as ``numpy.empty``):
        from the pool when it has room for its size, else (small ones too) plain."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or nbytes > self.capacity:
            return np.empty(shape, dtype)
        return self._take(shape, dtype, nbytes)

    def _take(self, shape: tuple[int, ...], dtype: np.dtype[Any], nbytes: int) -> np.ndarray:
        """A pooled array of ``nbytes`` bytes (a released buffer of that size, else a new one)."""
        buffer = None
        with self._lock:  # nothing the garbage collector tracks is made while it is held: a
            # collection there could run a _Lease's __del__, whose give_back would wait for it
            for i in range(len(self._free) - 1, -1, -1):  # the latest released: warmest
                if self._free[i].nbytes == nbytes:
                    buffer = self._free.pop(i)
                    self._held -= nbytes
                    break
        if buffer is None:
            buffer = np.empty(nbytes, np.uint8)
        leased: np.ndarray = np.asarray(_Lease(buffer, self)).view(dtype).reshape(shape)
        return leased

    def give_back(self, buffer: np.ndarray) -> None:
        """Keep ``buffer`` for a later output of its size, freeing the buffers released longest
        ago as far as it needs room; a buffer larger than the pool is freed."""
        nbytes = buffer.nbytes
        with self._lock:  # a buffer freed here is a plain array: freeing it runs no Python code
            if nbytes > self.capacity:
                return
            while self._held + nbytes > self.capacity:
                self._held -= self._free.pop(0).nbytes
            self._free.append(buffer)
            self._held += nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes kept for reuse now."""
        return self._held

    def clear(self) -> None:
        """Free every kept buffer."""
        with self._lock:
            self._free.clear()
            self._held = 0

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()  # a lock held by another thread at fork() stays held


def _capacity() -> int:
    value = os.environ.get("NORMLAB_OUTPUT_POOL_MIB", "").strip()
    if not value:
        return _DEFAULT_MIB << 20
    try:
        mib = float(value)
        if not math.isfinite(mib) or mib < 0:
            raise ValueError
    except ValueError:
        warnings.warn(
            f"NORMLAB_OUTPUT_POOL_MIB={value!r} is not a number of MiB >= 0; using the "
            f"default, {_DEFAULT_MIB}",
            NormlabWarning,
            stacklevel=2,
        )
        return _DEFAULT_MIB << 20
    return int(mib * (1 << 20))


#: The pool of this process's large outputs.
POOL: Final = OutputPool(_capacity())
os.register_at_fork(after_in_child=POOL._after_fork_in_child)
