"""Fixtures of the CUDA tests without a GPU."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def torch_module() -> Any:
    """torch, imported before a fake cupy is installed (torch looks for cupy when imported)."""
    return pytest.importorskip("torch")
