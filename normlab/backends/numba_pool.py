"""Numba's threads for the numba backend: who runs a call on them, and loading their kernels.

:data:`POOL` answers how many threads a call runs on (:meth:`Pool.acquire`): 1, the serial
kernels on the calling thread, for inputs of fewer than :data:`SERIAL_ELEMENTS` elements (the
forward of half dtypes: :data:`FORWARD_SERIAL_ELEMENTS`), while another thread is inside the
parallel kernels, and in a child forked after this process went parallel; else
``numba.get_num_threads()``, and the call holds the pool until :meth:`Pool.release`. The
kernels give the same bits on any number of threads, so the answer never changes a result.

:func:`load_serial_first` is called before a parallel driver's first run on its arguments'
types: it loads the serial kernels the driver calls, so that the driver runs those and not its
own copies (see there). Nothing here knows an array family.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import numba
import numpy as np

from normlab.errors import NormlabWarning

if TYPE_CHECKING:
    from normlab.backends.numba_kernel_types import KernelTypes
    from normlab.hookspecs import Plan

__all__ = [
    "FORWARD_SERIAL_ELEMENTS",
    "POOL",
    "SERIAL_ELEMENTS",
    "Pool",
    "always_serial",
    "forward_work",
    "load_serial_first",
]

#: Below this many elements (rows * cols) a call runs on the calling thread: there the thread
#: pool saves under a fifth of the time, and a busy machine can delay its wake-up by
#: milliseconds (measured on 2 cores; see docs/numba.md: at 32 x 768, 2^14.6 elements, two
#: threads saved 5-10% on a lightly loaded machine and cost 100 times the call on a busy one).
SERIAL_ELEMENTS: Final = 1 << 15
#: The forward's limit per dtype, where it differs (:func:`forward_work`): a half row's
#: conversions make a serial call cheaper to keep than a thread's wake-up for longer (measured
#: on the 2-core VM, one thread against two: 16 x 4096 float16 19.5 against 23.2 µs, 128 x 768
#: 28.8 against 22.6; bfloat16 25.4 against 27.2, 38.1 against 31.5).
FORWARD_SERIAL_ELEMENTS: Final = {"float16": 3 << 15, "bfloat16": 3 << 15}


class Pool:
    """Who may start numba's parallel kernels: at most one call at a time, never a forked child.

    :meth:`acquire` answers the number of threads a call runs on: 1 (the serial kernels, on the
    calling thread) or ``numba.get_num_threads()``, in which case the call holds the pool until
    :meth:`release`. It answers 1 for small inputs, while another thread holds the pool (the
    ``workqueue`` layer aborts the process when two threads enter parallel kernels at once;
    ``omp`` and ``tbb`` accept it but would run callers x threads on the cores), and in a child
    forked after this process started parallel kernels (GNU OpenMP kills such a child, and a
    thread pool does not survive ``fork()`` whatever the layer). Results do not depend on it:
    the kernels give the same bits on any number of threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False  # this process (or the parent it was forked from) went parallel
        self._forked = False  # a child forked after that: serial kernels only
        self._count: Callable[[], int] | None = None  # the threading layer's thread count
        #: why numba's threads cannot start here (a threading layer that fails to load), or None
        self.unstartable: str | None = None

    def acquire(self, elements: int) -> int:
        """The threads a call of ``elements`` elements runs on; hold the pool when above 1.
        Where numba's threading layer cannot start (``NUMBA_THREADING_LAYER=tbb`` without tbb),
        every call runs on the calling thread, said once by a :class:`NormlabWarning`."""
        if elements < SERIAL_ELEMENTS or self._forked or self.unstartable is not None:
            return 1
        if not self._lock.acquire(blocking=False):
            return 1
        try:
            threads = self._thread_count()
        except Exception as exc:  # numba's layer did not load: serial kernels from now on
            self.unstartable = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self._lock.release()
            warnings.warn(
                f"numba's threading layer cannot start here ({self.unstartable}); normlab runs "
                "the numba kernels on the calling thread (set NUMBA_THREADING_LAYER to a layer "
                "that is installed, or unset it)",
                NormlabWarning,
                stacklevel=4,
            )
            return 1
        except BaseException:
            self._lock.release()
            raise
        if threads == 1:
            self._lock.release()
            return 1
        self._started = True
        return threads

    def _thread_count(self) -> int:
        """``numba.get_num_threads()`` (the calling thread's count), the first time through
        numba's own function (which starts the threads); then through the threading layer's
        entry it leaves behind, without its lock and checks (a µs less per parallel call)."""
        if self._count is None:
            threads = int(numba.get_num_threads())
            self._count = getattr(_numba_parallel(), "_get_num_threads", None)
            return threads
        threads = int(self._count())
        if threads <= 0:  # not a count: ask numba itself (which raises saying why)
            threads = int(numba.get_num_threads())
        return threads

    def release(self, threads: int) -> None:
        """Give the pool back after a call that :meth:`acquire` gave ``threads``."""
        if threads > 1:
            self._lock.release()

    def after_fork_in_child(self) -> None:
        """In a forked child: serial kernels only if the parent had started the thread pool."""
        self._lock = threading.Lock()  # another thread of the parent may have held it
        self._forked = self._forked or self._started


def _numba_parallel() -> Any:
    """numba's module of the threading layers (its thread count function)."""
    from numba.np.ufunc import parallel

    return parallel


#: The one pool of this process (numba has one set of worker threads per process).
POOL: Final = Pool()
os.register_at_fork(after_in_child=POOL.after_fork_in_child)


def always_serial(plan: Plan, k: KernelTypes) -> bool:
    """Whether a forward call runs on the calling thread whatever the pool's state (short
    rows, and one row or less :func:`forward_work` than :data:`SERIAL_ELEMENTS`)."""
    return not k.long and (plan.rows == 1 or forward_work(plan, k) < SERIAL_ELEMENTS)


def forward_work(plan: Plan, k: KernelTypes) -> int:
    """A forward call's size for the thread pool (:meth:`Pool.acquire`): its elements, scaled
    so that :data:`SERIAL_ELEMENTS` stands for its dtype's :data:`FORWARD_SERIAL_ELEMENTS`."""
    limit = FORWARD_SERIAL_ELEMENTS.get(plan.dtype, SERIAL_ELEMENTS)
    return plan.rows * plan.cols * SERIAL_ELEMENTS // limit


#: Parallel drivers, with their arguments' types, whose serial kernels are loaded.
_SERIAL_LOADED: set[tuple[Any, ...]] = set()


def _numba_type_key(a: Any) -> Any:
    """What numba's type of ``a`` depends on: an array's dtype, dimensions, layout, mutability
    and alignment; the type of anything else."""
    if isinstance(a, np.ndarray):
        f = a.flags
        return a.dtype, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned
    return type(a)


def load_serial_first(
    driver: Any, args: tuple[Any, ...], *serial: tuple[Any, tuple[Any, ...]]
) -> None:
    """Before the parallel ``driver`` runs on ``args``' types for the first time in this process,
    load the serial kernels it calls: ``serial`` holds ``(kernel, arguments)`` pairs, each a
    call that does no work (an empty range of rows).

    Numba puts a copy of every kernel a driver calls into the driver's own machine code, and of
    the copies of one kernel a process runs the one it loaded first. In the process that
    compiles them that is the serial kernel's own (numba compiles a callee before its caller).
    A driver loaded from the on-disk cache before its serial kernels would run its copy instead,
    optimized in the driver's context, whose fast-math sums round differently: rows 1 ulp apart
    from the serial path's (38 of 64 rows of a (64, 1024) float32 batch), so results would
    depend on the thread count and on the other rows in every process but the first.
    """
    load_first((driver, *map(_numba_type_key, args)), *serial)


def load_first(key: tuple[Any, ...], *serial: tuple[Any, tuple[Any, ...]]) -> None:
    """:func:`load_serial_first` for a driver whose arguments' types ``key`` stands for."""
    if key in _SERIAL_LOADED:
        return
    for kernel, arguments in serial:
        kernel(*arguments)
    _SERIAL_LOADED.add(key)
