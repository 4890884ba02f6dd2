"""Deployments: where normlab's compiled kernels are cached, and normlab without a cache.

Each scenario runs in a child interpreter on a copy of the package (an "install" whose
``__pycache__`` folders are regular files, so nothing can be written into it even by root),
with its own cache settings and ``HOME``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import ROOT

pytest.importorskip("numba")


#: A child's program: a few calls on the default backend, then what numba did, as JSON.
CALLS = """
import json, numpy as np, normlab
from normlab.backends import numba_forward
x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16)
y = normlab.layer_norm(x)
y64 = normlab.layer_norm(x.astype(np.float64))
y16 = normlab.layer_norm(x.astype(np.float16))
expected = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
assert np.allclose(y, expected, atol=1e-5), "wrong result"
kernel = numba_forward.layer_norm_rows
print(json.dumps({
    "hits": sum(kernel.stats.cache_hits.values()),
    "misses": sum(kernel.stats.cache_misses.values()),
    "explain": normlab.explain(x),
}))
"""

UNCACHED = "compiling them in this process"


@pytest.fixture
def install(tmp_path: Path) -> Path:
    """A copy of the normlab package that cannot be written into (each ``__pycache__`` is a
    file); returns the folder to put on ``PYTHONPATH``."""
    return _read_only_copy(tmp_path / "site")


def _read_only_copy(site: Path) -> Path:
    shutil.copytree(
        ROOT / "normlab", site / "normlab", ignore=shutil.ignore_patterns("__pycache__")
    )
    for package in (site / "normlab").rglob("__init__.py"):
        (package.parent / "__pycache__").write_text("not a directory\n")
    return site


def child(
    code: str, site: Path, env: dict[str, str], user: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` on the package in ``site`` with only these cache-related settings."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NUMBA_", "NORMLAB_")) and k not in ("HOME", "XDG_CACHE_HOME")
    }
    base.update(
        PYTHONPATH=str(site),
        PYTHONDONTWRITEBYTECODE="1",
        NORMLAB_DISABLE_PLUGIN_AUTOLOAD="1",
        HOME="/dev/null",
    )
    base.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=base,
        cwd=site,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        user=user,
    )


def outcome(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def _kernel_caches(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.nbi"))


def test_no_writable_cache_compiles_in_process_and_says_so_once(
    install: Path, tmp_path: Path
) -> None:
    """No home, a cache directory under a regular file, an install that cannot be written:
    every call works, compiled in the process, and the ``normlab.compile`` logger says so
    once (today: ``BackendError ... no locator available``)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = child(CALLS, install, {"NORMLAB_CACHE_DIR": str(blocker / "cache")})
    found = outcome(result)
    assert found["hits"] == 0 and found["misses"] > 0
    assert "chosen: numba" in found["explain"]
    assert result.stderr.count(UNCACHED) == 1, result.stderr
    # through normlab.notices' handler, shared with the compile notice (NORMLAB_QUIET applies)
    assert "normlab: no usable cache directory" in result.stderr, result.stderr
    assert _kernel_caches(install) == []


def test_kernels_are_cached_in_normlab_cache_dir_and_loaded_from_there(
    install: Path, tmp_path: Path
) -> None:
    """``NORMLAB_CACHE_DIR/numba``, created 0700, holds the kernels; a second process loads
    them from there; nothing is written into the install directory."""
    cache = tmp_path / "cache"
    first = child(CALLS, install, {"NORMLAB_CACHE_DIR": str(cache)})
    assert outcome(first)["misses"] > 0
    assert UNCACHED not in first.stderr
    assert _kernel_caches(cache / "numba"), "no kernel cached"
    for directory in [cache, *(p for p in cache.rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert _kernel_caches(install) == []
    second = outcome(child(CALLS, install, {"NORMLAB_CACHE_DIR": str(cache)}))
    assert second["hits"] > 0 and second["misses"] == 0


def test_numba_cache_dir_wins_and_home_is_the_default(install: Path, tmp_path: Path) -> None:
    numba_dir, xdg, home = tmp_path / "numba-dir", tmp_path / "xdg", tmp_path / "home"
    home.mkdir()
    outcome(
        child(
            CALLS,
            install,
            {"NUMBA_CACHE_DIR": str(numba_dir), "NORMLAB_CACHE_DIR": str(tmp_path / "unused")},
        )
    )
    assert _kernel_caches(numba_dir) and not (tmp_path / "unused").exists()
    outcome(child(CALLS, install, {"XDG_CACHE_HOME": str(xdg), "HOME": str(home)}))
    assert _kernel_caches(xdg / "normlab" / "numba")
    outcome(child(CALLS, install, {"HOME": str(home)}))
    assert _kernel_caches(home / ".cache" / "normlab" / "numba")


def test_the_users_own_numba_functions_keep_numbas_locators(tmp_path: Path) -> None:
    """The locator answers for normlab's kernels only: a user's ``cache=True`` function is
    cached beside its source, as numba does without normlab."""
    from numba.core import caching

    from normlab.backends import numba_cache, numba_forward

    user_file = tmp_path / "user_kernels.py"
    user_file.write_text("def f(x):\n    return x + 1\n")
    namespace: dict[str, Any] = {}
    exec(compile(user_file.read_text(), str(user_file), "exec"), namespace)
    assert numba_cache.KernelCacheLocator.from_function(namespace["f"], str(user_file)) is None
    kernel = numba_forward.layer_norm_rows
    locator = caching.FunctionCache(kernel.py_func)._impl.locator
    assert isinstance(locator, numba_cache.KernelCacheLocator)
    assert not Path(locator.get_cache_path()).is_relative_to(ROOT / "normlab")


#: Prepended to a child's code where permission bits do not bind (root): the file system under
#: ``READ_ONLY`` behaves as a read-only mount (any write raises EROFS).
READ_ONLY_MOUNT = """
import builtins, errno, os
_root = os.environ["READ_ONLY"]
def _refuse(path):
    if os.path.abspath(os.fsdecode(path)).startswith(_root):
        raise OSError(errno.EROFS, "Read-only file system", os.fsdecode(path))
_open, _os_open, _mkdir = builtins.open, os.open, os.mkdir
def _guarded_open(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+"):
        _refuse(file)
    return _open(file, mode, *args, **kwargs)
def _guarded_os_open(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        _refuse(path)
    return _os_open(path, flags, *args, **kwargs)
def _guarded_mkdir(path, *args, **kwargs):
    _refuse(path)
    return _mkdir(path, *args, **kwargs)
builtins.open, os.open, os.mkdir = _guarded_open, _guarded_os_open, _guarded_mkdir
"""


def test_a_read_only_prebuilt_cache_is_used(install: Path, tmp_path: Path) -> None:
    """A cache built into an image, then made read-only, is loaded from; a signature it lacks
    (float64 here) is compiled in process without complaint."""
    cache = tmp_path / "cache"
    build = "import numpy as np, normlab\nnormlab.layer_norm(np.ones((2, 8), np.float32))\n"
    outcome(child(build + "print('{}')", install, {"NORMLAB_CACHE_DIR": str(cache)}))
    for path in [cache, *cache.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        before = sorted(p.name for p in cache.rglob("*"))
        prelude = READ_ONLY_MOUNT if os.geteuid() == 0 else ""
        done = child(
            prelude + CALLS, install, {"NORMLAB_CACHE_DIR": str(cache), "READ_ONLY": str(cache)}
        )
        found = outcome(done)
        assert found["hits"] > 0, "the pre-built cache was not used"
        assert UNCACHED not in done.stderr
        assert sorted(p.name for p in cache.rglob("*")) == before
    finally:
        for path in [cache, *cache.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)


@pytest.mark.skipif(
    not os.environ.get("NORMLAB_TEST_NONROOT_USER"),
    reason="opt-in: set NORMLAB_TEST_NONROOT_USER to a user without write access to the install",
)
def test_a_real_non_root_user_without_a_home() -> None:
    """As a real unprivileged user (as in a non-root container): an install it cannot write,
    no home directory, no cache settings; every call works and says once why it compiles."""
    user = os.environ["NORMLAB_TEST_NONROOT_USER"]
    try:
        pwd.getpwnam(user)
    except KeyError:
        pytest.skip(f"no user {user!r} here")
    if os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != user:
        pytest.skip("switching to another user needs root")
    work = Path(tempfile.mkdtemp(prefix="normlab-nonroot-"))
    try:
        work.chmod(0o755)
        site = work / "site"
        shutil.copytree(ROOT / "normlab", site / "normlab", ignore=shutil.ignore_patterns("*.pyc"))
        for path in [site, *site.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        done = child(CALLS, site, {"HOME": "/nonexistent"}, user=user)
        found = outcome(done)
        assert found["misses"] > 0
        assert done.stderr.count(UNCACHED) == 1, done.stderr
    finally:
        for path in [work, *work.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(work)


def test_ctrl_c_while_numba_imports_falls_back_and_explain_says_so(tmp_path: Path) -> None:
    """Ctrl-C during the first call, while numba is half imported: that call is interrupted;
    later calls run on numpy, and ``explain()`` says numba cannot be used and why (today every
    later call fails with ``module 'numba' has no attribute 'core'``)."""
    code = """
    import importlib.abc, json, sys
    import numpy as np, normlab

    class CtrlC(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "numba.core.typing":
                sys.meta_path.remove(self)
                raise KeyboardInterrupt
            return None

    sys.meta_path.insert(0, CtrlC())
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    try:
        normlab.layer_norm(x)
        first = "finished"
    except KeyboardInterrupt:
        first = "interrupted"
    y = normlab.layer_norm(x)
    expected = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    print(json.dumps({
        "first": first,
        "close": bool(np.allclose(y, expected, atol=1e-5)),
        "explain": normlab.explain(x),
    }))
    """
    found = outcome(child(code, ROOT, {"NORMLAB_CACHE_DIR": str(tmp_path)}))
    assert found["first"] == "interrupted"
    assert found["close"]
    assert "chosen: numpy" in found["explain"]
    assert "numba's import was interrupted; restart the process" in found["explain"]
