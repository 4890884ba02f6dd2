"""Where normlab keeps compiled kernels: one root per user, never the install directory.

``$NORMLAB_CACHE_DIR/<kind>`` when set, else ``$XDG_CACHE_HOME/normlab/<kind>`` (default
``~/.cache/normlab/<kind>``); ``kind`` is ``numba`` or ``cuda``. Numba's kernels honour
``NUMBA_CACHE_DIR`` first (:mod:`normlab.backends.numba_cache`). Directories normlab creates are
private to the user (mode 0700); a directory that exists but cannot be written (a cache baked
into a read-only image) is read, never refused.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Final, Literal

__all__ = ["Access", "access", "cache_root", "make_private_dirs"]

#: What normlab may do with a cache directory: write (and read), only read, or nothing.
Access = Literal["write", "read", "none"]

_PRIVATE: Final = 0o700


def cache_root(kind: str) -> Path | None:
    """The cache directory for ``kind`` (``numba``, ``cuda``), or ``None`` when the user has no
    home directory to put one in."""
    explicit = os.environ.get("NORMLAB_CACHE_DIR")
    if explicit:
        return Path(explicit) / kind
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "normlab" / kind
    home = os.path.expanduser("~")
    if home == "~" or not os.path.isabs(home):
        return None
    return Path(home) / ".cache" / "normlab" / kind


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents with mode 0700; OSError when that is not allowed."""
    missing = []
    for directory in (path, *path.parents):
        if directory.is_dir():
            break
        missing.append(directory)
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=_PRIVATE)
        except FileExistsError:
            if not directory.is_dir():
                raise


def access(path: Path) -> Access:
    """What normlab may do with the cache directory ``path``, creating it (0700) if it can."""
    try:
        make_private_dirs(path)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        if path.is_dir() and os.access(path, os.R_OK | os.X_OK):
            return "read"
        return "none"
    return "write"
