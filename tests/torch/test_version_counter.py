"""A backend that writes a torch tensor through its memory (numba on CPU tensors, cupy on CUDA
tensors) bumps the tensor's version counter, as torch's own in-place operations do: a graph
that saved the tensor refuses the modified values instead of using them silently."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import normlab
from tests.support.plugins_for_tests import record

torch = pytest.importorskip("torch")


def _saved_for_backward() -> tuple[Any, Any]:
    """``(t, loss)``: loss's backward needs t's values (``loss = sum(w * t)`` saves t)."""
    t = torch.randn(4, 8)
    w = torch.randn(4, 8, requires_grad=True)
    return t, (w * t).sum()


@pytest.mark.parametrize("in_place", [False, True])
def test_numba_writing_a_tensor_bumps_its_version(in_place: bool) -> None:
    t, loss = _saved_for_backward()
    before = t._version
    x = t if in_place else torch.randn(4, 8)
    normlab.layer_norm(x, out=t, backend="numba")
    assert t._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_rms_norm_with_stats_outs_bumps_every_written_tensor() -> None:
    t, loss = _saved_for_backward()
    rstd = torch.empty(4, 1)
    before = (t._version, rstd._version)
    normlab.rms_norm(torch.randn(4, 8), return_stats=True, out=(t, rstd), backend="numba")
    assert t._version > before[0] and rstd._version > before[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def layer_norm(x: Any, weight: Any, bias: Any, *, plan: Any, out: Any) -> Any:
    """A stand-in for cupy writing a CUDA tensor through its raw pointer: this writes a CPU
    tensor through a NumPy view of its memory, which torch does not see."""
    rows = x.numpy()
    y = (rows - rows.mean(1, keepdims=True)) / np.sqrt(rows.var(1, keepdims=True) + plan.eps)
    out.numpy()[...] = y
    return out, None, None


def test_any_backend_writing_torch_memory_directly_bumps_the_version(
    register: Callable[..., Any],
) -> None:
    """The core bumps the version, whatever the backend (cupy included)."""
    register(
        record(
            "raw_pointer",
            families=frozenset({"torch"}),
            capabilities=frozenset({"out", "strided"}),
            module=__name__,
        )
    )
    t, loss = _saved_for_backward()
    x = torch.randn(4, 8)
    normlab.layer_norm(x, out=t, backend="raw_pointer")
    np.testing.assert_allclose(t.numpy(), torch.nn.functional.layer_norm(x, (8,)), atol=1e-5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
