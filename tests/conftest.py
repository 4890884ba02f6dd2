"""Shared fixtures: a backend preference that keeps tests independent of the winning CPU backend,
fake-plugin registration with clean-up, and the NumPy / PyTorch array families.

Hypothesis runs under the profile named by ``NORMLAB_HYPOTHESIS_PROFILE``: ``ci`` (the default)
draws the same examples on every run, with no example database, so one commit always gives one
verdict; ``explore`` draws new examples each run, ten times as many, and remembers failures in
the example database (``.hypothesis/``), for hunting by hand.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

from tests.support import plugins_for_tests


def _own_kernel_cache_per_xdist_worker() -> None:
    """Under pytest-xdist, each worker compiles into a Numba cache directory of its own (below
    the one it was given). One shared cache would be safe (processes compile in turn: see
    normlab.backends.numba_cache._CompileLock), but a worker would then wait for the other's
    compiles, and the benchmark smoke tests' time budgets ran out waiting. Before normlab or
    numba is imported: numba reads ``NUMBA_CACHE_DIR`` once."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    from normlab.backends.cache_dirs import cache_root  # imports neither numba nor a backend

    base = os.environ.get("NUMBA_CACHE_DIR") or str(cache_root("numba") or "")
    if base:
        os.environ["NUMBA_CACHE_DIR"] = os.path.join(base, f"xdist-{worker}")


_own_kernel_cache_per_xdist_worker()

import normlab  # noqa: E402
from normlab import dispatch, registry, spec  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile(
    "explore", derandomize=False, max_examples=1000, deadline=None, print_blob=True
)
settings.load_profile(os.environ.get("NORMLAB_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _prefer_numpy_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """NumPy arrays go to the numpy backend (whether or not numba is installed); other families
    fall back to priority. Dispatch tests that need no preference use ``no_preference``."""
    monkeypatch.setenv("NORMLAB_BACKEND", "numpy")
    dispatch.clear_caches()
    yield
    dispatch.clear_caches()


@pytest.fixture(autouse=True)
def _module_rng_seeded_by_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test module's ``RNG`` (a NumPy Generator) starts each test seeded by the test's own
    name, so a test draws the same data whichever tests ran before it in its process (under
    pytest-xdist, that differs from run to run) and one commit gives one verdict. The name is
    the module's file name and the test's, so moving a module to another folder keeps its data."""
    module = request.module
    if not isinstance(getattr(module, "RNG", None), np.random.Generator):
        yield
        return
    shared = module.RNG
    basename = module.__name__.rpartition(".")[2]
    module.RNG = np.random.default_rng(zlib.crc32(f"{basename}::{request.node.name}".encode()))
    yield
    module.RNG = shared


@pytest.fixture
def no_preference(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``NORMLAB_BACKEND``: choice by priority alone."""
    monkeypatch.delenv("NORMLAB_BACKEND", raising=False)
    dispatch.clear_caches()


@pytest.fixture
def register() -> Iterator[Callable[..., ModuleType]]:
    """``register(*records, name=None)`` registers a fake plugin for this test only."""
    plugins: list[ModuleType] = []

    def _register(*records: Any, name: str | None = None) -> ModuleType:
        plugin = plugins_for_tests.plugin(*records, name=name)
        normlab.register_plugin(plugin)
        plugins.append(plugin)
        return plugin

    yield _register
    for plugin in plugins:
        if registry.registry().manager.is_registered(plugin):
            normlab.unregister_plugin(plugin)
    plugins_for_tests.CALLS.clear()
    spec.clear_cache()
    dispatch.clear_caches()


@pytest.fixture(scope="session")
def cuda_cache_root(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A ``NORMLAB_CACHE_DIR`` whose ``cuda`` folder holds the cubins every NVRTC test shares
    (compiling all kernels for one architecture takes more than a minute): in pytest's cache,
    so they persist between runs and between xdist workers, else a temporary folder."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return tmp_path_factory.mktemp("normlab-cache")
    return Path(cache.mkdir("normlab-cubins"))


@pytest.fixture(scope="session")
def cubins(cuda_cache_root: Path) -> Callable[[str], list[Any]]:
    """``cubins(arch)``: every CUDA kernel compiled for ``arch`` into the shared cubin cache
    (:func:`cuda_cache_root`) and its reports, once for all xdist workers: a worker holds a
    lock on the architecture while it compiles, and the others load what it compiled (compiling
    one architecture takes minutes; two workers compiling it at once took twice that)."""
    import fcntl

    from normlab.backends import cuda_compile

    compiled: dict[str, list[Any]] = {}

    def compile_once(arch: str) -> list[Any]:
        if arch not in compiled:
            with (cuda_cache_root / f"{arch}.lock").open("w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                compiled[arch] = cuda_compile.compile_all(arch, cache_dir=cuda_cache_root / "cuda")
        return compiled[arch]

    return compile_once


@pytest.fixture(params=["numpy", "torch"])
def lib(request: pytest.FixtureRequest) -> registry.Backend:
    """The built-in backend of one array family; its ``from_numpy``/``to_numpy`` convert arrays."""
    if request.param == "torch":
        pytest.importorskip("torch")
    return registry.get(request.param)
