"""A fake ``cupy`` module for the CUDA launch tests without a GPU: host arrays stand in for
device ones (:mod:`tests.support.host_memory`) and the cupy backend's kernels are the test's
own, which compute on the memory behind their pointer arguments."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.support.host_memory import HostArray


def install(monkeypatch: pytest.MonkeyPatch, kernel: Callable[[Any], Any]) -> SimpleNamespace:
    """Put a fake ``cupy`` in ``sys.modules`` (on a device of compute capability
    ``fake.capability``, "90" unless changed) and make ``kernel(specialisation)`` the cupy
    backend's loaded kernel of each specialisation; the fake module."""
    from normlab.backends import cupy_backend

    fake = SimpleNamespace(
        empty=lambda shape, dtype: HostArray(np.empty(shape, dtype)),
        ascontiguousarray=lambda a: HostArray(np.ascontiguousarray(a.a)),
        capability="90",
    )
    fake.cuda = SimpleNamespace(
        Device=lambda i: contextlib.nullcontext(SimpleNamespace(compute_capability=fake.capability))
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cupy_backend, "_function", lambda device, spec: kernel(spec))
    return fake
