"""Notices to a person waiting: the ``normlab.compile`` logger, and the numba compile watcher.

It lives beside the backends because they use it (numba's cache and first compiles report on
it) and backends import nothing above them; :mod:`normlab.notices` re-exports it for the core.

A first call of a new numba specialization compiles for a second or two (far longer on a
loaded machine) without a word; in a notebook that looks like a hang. :func:`watch_numba_compiles`
says it while it happens: when a compile of one of normlab's kernels has been running for
:data:`NOTICE_AFTER_S`, one line on the ``normlab.compile`` logger says what is compiling, that
it is cached afterwards and that ``normlab warmup`` compiles ahead. Loads from numba's cache are
not compiles (numba fires no compile event for them) and stay silent. Each specialization is
announced at most once per process, whatever the number of threads.

The logger writes INFO records to stderr by default. It is silenced by ``NORMLAB_QUIET=1`` (read
when a notice is due, not at import), or by logging configuration: once the application has
configured logging (a handler on the root logger, or on ``normlab``/``normlab.compile``), records
go only where that configuration sends them, so ``logging.basicConfig(level=logging.WARNING)``
or ``logging.getLogger("normlab.compile").setLevel(logging.WARNING)`` hides them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

__all__ = [
    "COMPILE_LOGGER",
    "NOTICE_AFTER_S",
    "compile_logger",
    "compile_notices_silenced",
    "watch_numba_compiles",
]

COMPILE_LOGGER: Final = "normlab.compile"
#: Seconds a compile runs before the notice is given (cache loads take far less).
NOTICE_AFTER_S: Final = 0.5

_setup_lock = threading.Lock()


class _DefaultStderr(logging.Handler):
    """Writes to stderr only while nobody has configured logging and NORMLAB_QUIET is unset."""

    def emit(self, record: logging.LogRecord) -> None:
        if os.environ.get("NORMLAB_QUIET", "") not in ("", "0") or _configured_elsewhere():
            return
        try:
            sys.stderr.write(f"normlab: {self.format(record)}\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr must not break the call that is compiling
            self.handleError(record)


def _configured_elsewhere() -> bool:
    """Whether the application has put a handler where these records propagate."""
    if logging.getLogger().handlers or logging.getLogger("normlab").handlers:
        return True
    own = logging.getLogger(COMPILE_LOGGER).handlers
    return any(not isinstance(h, _DefaultStderr) for h in own)


def compile_logger() -> logging.Logger:
    """The ``normlab.compile`` logger, with its default stderr handler (set up once).

    Its level is set to INFO only if nobody has set one, so an application's own setting wins.
    """
    logger = logging.getLogger(COMPILE_LOGGER)
    if not any(isinstance(h, _DefaultStderr) for h in logger.handlers):
        with _setup_lock:
            if not any(isinstance(h, _DefaultStderr) for h in logger.handlers):
                if logger.level == logging.NOTSET:
                    logger.setLevel(logging.INFO)
                logger.addHandler(_DefaultStderr())
    return logger


class _CompileWatcher:
    """A numba event listener: a timer per outermost compile of a normlab kernel."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._announced: set[tuple[str, str]] = set()
        self._silenced = 0
        self._local = threading.local()

    def on_start(self, name: str, signature: str) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:  # a helper compiled inside a kernel's compile: the kernel's timer covers it
            return
        timer = threading.Timer(NOTICE_AFTER_S, self._announce, (name, signature))
        timer.daemon = True
        self._local.timer = timer
        timer.start()

    def on_end(self) -> None:
        self._local.depth = max(getattr(self._local, "depth", 1) - 1, 0)
        if self._local.depth == 0:
            timer = getattr(self._local, "timer", None)
            if timer is not None:
                timer.cancel()
                self._local.timer = None

    @contextmanager
    def silenced(self) -> Iterator[None]:
        """No notices inside this block (from any thread): the caller shows its own progress."""
        with self._lock:
            self._silenced += 1
        try:
            yield
        finally:
            with self._lock:
                self._silenced -= 1

    def _announce(self, name: str, signature: str) -> None:
        with self._lock:
            if self._silenced or (name, signature) in self._announced:
                return
            self._announced.add((name, signature))
        compile_logger().info(
            "compiling the numba kernel %s for %s (once: it is cached on disk afterwards; "
            "`normlab warmup` compiles ahead of time)",
            name,
            signature,
        )


_watcher: Final = _CompileWatcher()
_watching = False


def compile_notices_silenced() -> Any:
    """A context manager: no compile notices inside it (``normlab warmup`` shows progress)."""
    return _watcher.silenced()


def watch_numba_compiles() -> None:
    """Announce slow compiles of normlab's numba kernels (idempotent; imports numba)."""
    global _watching
    with _setup_lock:
        if _watching:
            return
        from numba.core import event

        class Listener(event.Listener):
            def on_start(self, ev: Any) -> None:
                function = ev.data["dispatcher"].py_func
                if function.__module__.startswith("normlab."):
                    _watcher.on_start(function.__name__, _signature(ev.data["args"]))

            def on_end(self, ev: Any) -> None:
                if ev.data["dispatcher"].py_func.__module__.startswith("normlab."):
                    _watcher.on_end()

        event.register("numba:compile", Listener())  # type: ignore[no-untyped-call]
        _watching = True


#: The kernels read float16 and bfloat16 as their bit patterns (int16, uint16).
_BITS_OF: Final = {"int16": "float16", "uint16": "bfloat16"}


def _signature(args: Any) -> str:
    """The kernel's input as a reader knows it: ``"float16 contiguous rows"`` (the dtype of
    the first argument; strided when any 2-D array argument is not C-contiguous)."""
    x = args[0] if args else None
    dtype = str(getattr(x, "dtype", ""))
    if not dtype:
        return str(x)
    rows = [a for a in args if getattr(a, "ndim", 0) == 2]
    layout = "strided" if any(getattr(a, "layout", "C") != "C" for a in rows) else "contiguous"
    return f"{_BITS_OF.get(dtype, dtype)} {layout} rows"
