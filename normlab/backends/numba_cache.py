"""Numba's on-disk cache for normlab's own kernels: where it lives, and running without one.

Numba finds a cache directory through its "locators". :class:`KernelCacheLocator`, put first in
numba's list when this module is imported, answers only for source files inside the normlab
package, so a user's own ``cache=True`` functions keep numba's usual places. For normlab's
kernels the directory is ``NUMBA_CACHE_DIR`` when set, else ``$NORMLAB_CACHE_DIR/numba``, else
the per-user ``~/.cache/normlab/numba`` (:mod:`normlab.backends.cache_dirs`): never the install
directory, which may be read-only or shared.

:func:`adopt` then gives each kernel of a module the cache its directory allows:

- writable (created 0700): load and save;
- readable only (a cache built into a read-only image): load; a signature not in it is compiled
  in the process and not saved;
- neither (no home directory, a read-only file system): every kernel is compiled in the process,
  and the ``normlab.compile`` logger (:mod:`normlab.backends.compile_notices`:
  stderr by default, ``NORMLAB_QUIET=1`` silences it) says so once, at WARNING.

Processes may share the directory: entries are saved by :class:`_EntryFiles` and compiled
one process at a time (:class:`_CompileLock`), so concurrent first calls neither mix up
entries nor leave callers and callees from different compiles.

Numba keys a cache entry by the kernel's own bytecode and the CPU it was compiled for, not by
the functions it calls (compiled into it): an entry made before an edit to ``half_bits.py`` or
``half_hw.py`` would keep the old conversions. So normlab's entries are also keyed by
:func:`backend_sources_digest`, of every source file of this package and ``constants.py``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Final, cast

try:
    import fcntl
except ImportError:  # Windows: no lock; entries may be lost to a race, never mixed up
    fcntl = None  # type: ignore[assignment]

from numba.core import caching, config, sigutils
from numba.core.dispatcher import Dispatcher

from normlab.backends.cache_dirs import access, cache_root, make_private_dirs
from normlab.backends.compile_notices import compile_logger

__all__ = [
    "KernelCacheLocator",
    "adopt",
    "backend_sources_digest",
    "kernel_cache_root",
    "sources_digest",
]


_PACKAGE: Final = Path(__file__).resolve().parents[1]
_said_uncached = False
_said_lock = threading.Lock()


def kernel_cache_root() -> Path | None:
    """Where normlab's Numba kernels are cached: ``NUMBA_CACHE_DIR``, else
    ``$NORMLAB_CACHE_DIR/numba``, else the per-user cache directory (``None``: no home)."""
    numba_dir: str = getattr(config, "CACHE_DIR", "")
    if numba_dir:
        return Path(numba_dir)
    return cache_root("numba")


def _is_normlab_source(py_file: str) -> bool:
    try:
        return Path(py_file).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        return False


class KernelCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """The cache directory of a normlab kernel (and of no other function)."""

    def __init__(self, py_func: Any, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        root = kernel_cache_root()
        # With no home directory the path names nothing: reads find no index, writes fail.
        base = root if root is not None else Path(os.devnull) / "normlab-numba"
        self._cache_path = str(base / self.get_suitable_cache_subpath(py_file))  # type: ignore[no-untyped-call]

    def get_cache_path(self) -> str:
        return self._cache_path

    def ensure_cache_path(self) -> None:
        path = Path(self._cache_path)
        make_private_dirs(path)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"cache directory {path} is not writable")

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> KernelCacheLocator | None:
        """A locator for ``py_func`` if it is one of normlab's kernels, else ``None`` (numba's
        own locators then decide). Always one for normlab's kernels, writable or not: the
        install directory is never the fallback."""
        if not _is_normlab_source(py_file):
            return None
        return cls(py_func, py_file)


def sources_digest(package: Path) -> str:
    """SHA-256 of the ``.py`` files under ``package`` (sorted by path) and of
    ``constants.py`` beside it (constants the kernels may read)."""
    digest = hashlib.sha256()
    for path in [*sorted(package.rglob("*.py")), package.parent / "constants.py"]:
        digest.update(path.relative_to(package.parent).as_posix().encode())
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()


@functools.cache
def backend_sources_digest() -> str:
    """:func:`sources_digest` of ``normlab.backends``: what a kernel may call. Once a process."""
    return sources_digest(Path(__file__).resolve().parent)


class _EntryFiles(caching.IndexDataCacheFile):
    """One kernel's index and data files, safe for processes that share the cache directory.

    Numba names a new entry's data file ``<kernel>.<n>.nbc`` by the first number its index
    does not use, reading and writing the index without a lock: two processes compiling two
    signatures at once both take the same number, and the index can end up naming the other
    signature's code, which is then loaded and called with the wrong array types (seen as
    results that differ in the last bits, or worse). Here a data file is named by a digest of
    its entry's key, so it only ever holds that entry, and is written before the index names
    it; the index is read, updated and written under an exclusive lock on a file beside it, so
    no process's entry is lost either. Loading is numba's."""

    def __init__(self, cache_path: str, filename_base: str, source_stamp: Any) -> None:
        super().__init__(cache_path, filename_base, source_stamp)  # type: ignore[no-untyped-call]
        self._filename_base = filename_base

    def save(self, key: Any, data: Any) -> None:
        digest = hashlib.sha256(self._dump(key)).hexdigest()[:24]  # type: ignore[no-untyped-call]
        name = f"{self._filename_base}.{digest}.nbc"
        self._save_data(name, data)  # type: ignore[no-untyped-call]
        with self._index_lock():
            overloads = self._load_index()
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)  # type: ignore[no-untyped-call]

    def _load_index(self) -> dict[Any, Any]:
        """numba's index, or an empty one when the file is corrupt or truncated (its entries
        are then compiled again, and the index written anew, atomically, by :meth:`save`)."""
        try:
            index: dict[Any, Any] = super()._load_index()  # type: ignore[no-untyped-call]
        except OSError:
            raise
        except Exception as exc:  # unpickling a damaged file: any error
            _say_damaged(self._index_path, exc)
            return {}
        return index

    def _load_data(self, name: str) -> Any:
        """numba's entry, read; a corrupt or truncated data file is an OSError, which numba
        takes for a missing entry: the kernel is compiled again and the file replaced."""
        try:
            return super()._load_data(name)  # type: ignore[no-untyped-call]
        except OSError:
            raise
        except Exception as exc:
            _say_damaged(self._data_path(name), exc)  # type: ignore[no-untyped-call]
            raise OSError(f"damaged cache entry {name}") from exc

    @contextlib.contextmanager
    def _index_lock(self) -> Iterator[None]:
        if fcntl is None:
            yield
            return
        fd = os.open(f"{self._index_path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # and the lock with it


class _KernelCache(caching.FunctionCache):
    """Numba's per-function cache, for a directory that may be read-only: a kernel that cannot
    be saved (or a cache that cannot be read) is compiled in the process instead of failing.
    Entries are also keyed by :func:`backend_sources_digest`, and saved by
    :class:`_EntryFiles`, so processes may share the directory."""

    def __init__(self, py_func: Any) -> None:
        super().__init__(py_func)  # type: ignore[no-untyped-call]
        self._cache_file = _EntryFiles(
            self._cache_path, self._impl.filename_base, self._impl.locator.get_source_stamp()
        )

    def _index_key(self, sig: Any, codegen: Any) -> Any:
        return (*super()._index_key(sig, codegen), backend_sources_digest())  # type: ignore[no-untyped-call]

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        try:
            return super().load_overload(sig, target_context)  # type: ignore[no-untyped-call]
        except OSError as exc:
            _say_uncached(self.cache_path, exc)
            return None

    def save_overload(self, sig: Any, data: Any) -> None:
        try:
            super().save_overload(sig, data)  # type: ignore[no-untyped-call]
        except OSError as exc:
            if access(Path(self.cache_path)) == "read":
                compile_logger().debug(
                    "read-only kernel cache %s: %s compiled in process", self.cache_path, sig
                )
            else:
                _say_uncached(self.cache_path, exc)


def _say_damaged(path: str, why: Exception) -> None:
    """A cache file that cannot be read (truncated, overwritten): said at WARNING, once per
    file; the kernel is compiled again."""
    compile_logger().warning(
        "normlab's numba cache file %s is damaged (%s: %s); compiling its kernel again",
        path,
        type(why).__name__,
        why,
    )


def _say_uncached(path: str, why: object) -> None:
    global _said_uncached
    with _said_lock:
        if _said_uncached:
            return
        _said_uncached = True
    compile_logger().warning(
        "no usable cache directory for normlab's Numba kernels (%s: %s); compiling them in "
        "this process, which costs seconds on the first call of each kind. Set "
        "NORMLAB_CACHE_DIR to a writable directory to cache them.",
        path,
        why,
    )


class _CompileLock:
    """Compiling and saving normlab's kernels, one process at a time per cache directory.

    numba names a compiled function's symbol with a per-process counter (``...B2v7...``), and a
    kernel that calls another (a parallel driver, an address entry) is saved calling its
    callee by that name. Two processes that compile into one fresh cache at once save callees
    and callers with different numbers; a later process that loads them finds no callee of the
    name its caller wants, so the caller runs its own copy of the callee, optimized in the
    caller's context: rows 1 ulp off the serial path's, results depending on the thread count,
    in every later process. Under this lock (an exclusive ``flock`` on ``compile.lock`` in the
    cache root, taken only when a kernel has no overload for the signature in this process) a
    process looks in the cache, and compiles and saves only what is still missing, so the
    entries of one cache are consistent. Re-entrant: compiling a driver compiles its callees.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    @contextlib.contextmanager
    def held(self, root: Path) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._fd = self._take(root)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    os.close(self._fd)  # and the lock with it
                    self._fd = None

    @staticmethod
    def _take(root: Path) -> int | None:
        """The locked file's descriptor; ``None`` where no lock can be had (no ``fcntl``, a
        cache that cannot be written: nothing is saved there, so there is nothing to order)."""
        if fcntl is None:
            return None
        try:
            fd = os.open(root / "compile.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def reset_after_fork(self) -> None:
        """A forked child holds no lock, whatever thread of its parent held it, and closes its
        copy of the parent's locked file (else the parent's lock would outlive its own close,
        held by the open file they share, until the child exits)."""
        if self._fd is not None:
            os.close(self._fd)
        self._lock = threading.RLock()
        self._depth = 0
        self._fd = None


_compile_lock = _CompileLock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_compile_lock.reset_after_fork)


def _compile_in_order(kernel: Any, root: Path) -> None:
    """Make ``kernel.compile`` (numba's entry to load-or-compile a signature) take
    :data:`_compile_lock` unless the signature is already in this process."""
    compile_unlocked = kernel.compile

    def compile_locked(sig: Any) -> Any:
        args, _ = sigutils.normalize_signature(sig)  # type: ignore[no-untyped-call]
        if tuple(args) in kernel.overloads:
            return compile_unlocked(sig)
        with _compile_lock.held(root):
            return compile_unlocked(sig)

    kernel.compile = compile_locked


def adopt(*modules: ModuleType) -> None:
    """Give each ``cache=True`` kernel defined in ``modules`` the cache its directory allows:
    read and write, read only, or none (compiled in process, said once); a writable cache's
    kernels compile in order with other processes' (:class:`_CompileLock`)."""
    for module in modules:
        for kernel in vars(module).values():
            if not (
                isinstance(kernel, Dispatcher)
                and kernel.py_func.__module__ == module.__name__
                and isinstance(getattr(kernel, "_cache", None), caching.FunctionCache)
            ):
                continue
            kernel = cast(Any, kernel)
            path = Path(kernel._cache.cache_path)
            can = access(path)
            if can == "none":
                _say_uncached(str(path), "cannot be created or read")
                kernel._cache = caching.NullCache()
                continue
            kernel._cache = _KernelCache(kernel.py_func)
            root = kernel_cache_root()
            if can == "write" and root is not None:
                _compile_in_order(kernel, root)


def _install() -> None:
    # numba < 0.68 calls it _CacheImpl
    impl: Any = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")  # noqa: B009
    locators = impl._locator_classes
    if KernelCacheLocator not in locators:
        locators.insert(0, KernelCacheLocator)


_install()  # before any kernel module is decorated: this module is imported by them first
