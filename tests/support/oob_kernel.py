"""A deliberately out-of-bounds Numba kernel: the proof that ``NUMBA_BOUNDSCHECK=1`` is in force.

:func:`sum_one_past_the_end` reads one element past the end of its argument. Given a view into
a larger array (``memory[:n]``) it reads ``memory[n]``: valid memory, so without bounds checks
it silently returns a wrong sum instead of crashing; with them it raises ``IndexError``. It is
cached on disk (``cache=True``) like normlab's kernels, to show that cached machine code keeps
the bounds-check setting it was compiled with.
"""

from __future__ import annotations

from typing import Any

from numba import njit


@njit(cache=True)
def sum_one_past_the_end(a: Any) -> float:
    total = 0.0
    for i in range(a.shape[0] + 1):  # the bug: one element too many
        total += a[i]
    return total
