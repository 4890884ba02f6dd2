"""Bitwise equality as a plain bool, so that a failing check reports its own message.

pytest explains a failed ``assert a == b`` between byte strings (or lists of them) with a
diff, and in full when the environment variable ``CI`` is set: for the hundreds of kilobytes
of a batch's output that diff takes hours. Checks of bits therefore assert
``same_bits(a, b)``, whose failure pytest reports with the caller's message alone.
"""

from __future__ import annotations

import numpy as np


def same_bits(a: np.ndarray | bytes | None, b: np.ndarray | bytes | None) -> bool:
    """Whether ``a`` and ``b`` are both None, or hold the same bytes (host arrays also the
    same shape and dtype; an array's bytes are read in C order)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return (a.shape, a.dtype) == (b.shape, b.dtype) and a.tobytes() == b.tobytes()
    return _bytes_of(a) == _bytes_of(b)


def _bytes_of(a: np.ndarray | bytes) -> bytes:
    return a if isinstance(a, bytes) else a.tobytes()
