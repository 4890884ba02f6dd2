"""Every bad input raises its NormlabError subclass, through the backend under test, for each
op the backend provides (the fused ops where it provides them or their base op)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import normlab
from normlab import ArgumentError, BackendError, DtypeError
from normlab.constants import FLOAT_DTYPES
from normlab.ops import FUSED_OPS
from normlab.ops import OPS as TABLE
from normlab.testing.bad_inputs import BAD_INPUTS, FUSED, Inputs, bad_inputs_of
from normlab.testing.cases import OPS
from normlab.testing.conversions import arrange, numpy_dtype
from normlab.testing.subject import Subject, fused_path


def _array(s: Subject, shape: tuple[int, ...] = (3, 4), dtype: str | None = None) -> Any:
    return s.from_numpy(np.ones(shape, numpy_dtype(dtype or s.dtype)))


@pytest.mark.parametrize(
    ("op", "bad"), [(op, bad.name) for op in (*OPS, *sorted(FUSED)) for bad in bad_inputs_of(op)]
)
def test_bad_input(normlab_subject: Subject, op: str, bad: str) -> None:
    """Each bad argument (:data:`normlab.testing.bad_inputs.BAD_INPUTS`) raises the
    NormlabError subclass that names the problem, with a message that says what is wrong;
    for the fused ops, a residual or residual_out unlike x, and residual_out with
    return_residual=False."""
    if op in FUSED:
        normlab_subject.require_fused(op)
    else:
        normlab_subject.require_op(op)
    BAD_INPUTS[bad].check(op, Inputs(normlab_subject), normlab_subject.backend)


@pytest.mark.parametrize("op", OPS)
def test_op_not_provided(normlab_subject: Subject, op: str) -> None:
    """An op the record does not list: the named backend refuses with BackendError, and
    explain() says why."""
    normlab_subject.require_named("a named backend's refusal of an op it lacks")
    if op in normlab_subject.ops:
        pytest.skip(f"backend {normlab_subject.name!r} provides {op}")
    x = _array(normlab_subject)
    with pytest.raises(BackendError, match=f"does not provide {op}"):
        getattr(normlab, op)(x, backend=normlab_subject.backend)
    text = normlab.explain(x, op=op, backend=normlab_subject.backend)
    assert f"does not provide {op}" in text, text


def test_dtype_not_served(normlab_subject: Subject) -> None:
    """x of a float dtype the record does not list: BackendError (named backends are strict)."""
    normlab_subject.require_named("a named backend's refusal of a dtype it lacks")
    missing = [d for d in FLOAT_DTYPES if d not in normlab_subject.dtypes]
    if not missing:
        pytest.skip(f"backend {normlab_subject.name!r} serves every float dtype")
    try:
        x = _array(normlab_subject, dtype=missing[0])
    except Exception as exc:  # the family itself has no such dtype
        pytest.skip(f"{normlab_subject.family} arrays cannot be {missing[0]}: {exc}")
    with pytest.raises(BackendError):
        normlab.layer_norm(x, backend=normlab_subject.backend)


def test_out_zero_stride(normlab_subject: Subject) -> None:
    """A broadcast ``out`` (zero stride, overlapping elements): ArgumentError."""
    normlab_subject.require_layout("broadcast")
    out = arrange(
        np.zeros((3, 4), numpy_dtype(normlab_subject.dtype)), "broadcast", normlab_subject
    )
    with pytest.raises(ArgumentError):
        normlab.layer_norm(_array(normlab_subject), out=out, backend=normlab_subject.backend)


def test_out_partly_overlapping_x(normlab_subject: Subject) -> None:
    """``out`` sharing part of x's memory (not x itself): ArgumentError."""
    normlab_subject.require_layout("padded")
    memory = _array(normlab_subject, (3, 5))
    with pytest.raises(ArgumentError):
        normlab.layer_norm(memory[:, 1:], out=memory[:, :4], backend=normlab_subject.backend)


def test_family_specific(normlab_subject: Subject) -> None:
    """Bad inputs only some families can express: a NumPy masked array (DtypeError) or
    read-only out (ArgumentError); a torch out= while x requires grad (ArgumentError)."""
    x = _array(normlab_subject)
    if normlab_subject.family == "numpy":
        with pytest.raises(DtypeError):
            normlab.layer_norm(np.ma.masked_array(x, mask=x > 2), backend=normlab_subject.backend)
        frozen = np.zeros_like(x)
        frozen.flags.writeable = False
        with pytest.raises(ArgumentError):
            normlab.layer_norm(x, out=frozen, backend=normlab_subject.backend)
    elif normlab_subject.family == "torch":
        x.requires_grad_(True)
        with pytest.raises(ArgumentError):
            normlab.layer_norm(x, out=x.detach().clone(), backend=normlab_subject.backend)
    else:
        pytest.skip(f"no family-specific bad inputs known for {normlab_subject.family} arrays")


def _overlapping(s: Subject, shape: tuple[int, int], row_stride: int) -> Any:
    """A view of the family's memory of ``shape`` whose rows start ``row_stride`` elements
    apart, fewer than a row: rows overlap each other (None: the family makes no such views)."""
    rows, cols = shape
    memory = _array(s, ((rows - 1) * row_stride + cols,))
    if s.family == "numpy":
        size = memory.itemsize
        return np.lib.stride_tricks.as_strided(memory, shape, (row_stride * size, size))
    if s.family == "torch":
        return memory.as_strided(shape, (row_stride, 1))
    if s.family == "cupy":
        import cupy

        size = memory.itemsize
        return cupy.lib.stride_tricks.as_strided(memory, shape, (row_stride * size, size))
    return None


@pytest.mark.parametrize("op", OPS)
def test_out_whose_rows_overlap(normlab_subject: Subject, op: str) -> None:
    """``out`` whose rows share memory (``as_strided`` with a row stride below the row length):
    ArgumentError, never garbage written; so for ``out=x`` on such an x and for the fused
    ops' ``residual_out``."""
    s = normlab_subject
    s.require_op(op)
    s.require_writable()
    out = _overlapping(s, (10, 64), 16)
    if out is None:
        pytest.skip(f"{s.family} arrays: no overlapping views made here")
    x = _array(s, (10, 64))
    function = getattr(normlab, op)
    with pytest.raises(ArgumentError, match="overlap"):
        function(x, out=out, backend=s.backend)
    with pytest.raises(ArgumentError, match="overlap"):
        function(out, out=out, backend=s.backend)
    fused = FUSED_OF[op]
    if fused_path(s.name, fused) is not None:
        with pytest.raises(ArgumentError, match="overlap"):
            getattr(normlab, fused)(x, x, residual_out=out, backend=s.backend)


#: The fused op of each base op.
FUSED_OF = {base: fused for fused in FUSED_OPS if (base := TABLE[fused].base)}


@pytest.mark.parametrize("freed", ["x", "weight"])
@pytest.mark.parametrize("op", OPS)
def test_tensor_without_memory(normlab_subject: Subject, op: str, freed: str) -> None:
    """A torch tensor whose storage was resized to 0 (FSDP's freed parameters) holds no
    memory: a NormlabError naming it, never a read of memory the tensor does not hold."""
    s = normlab_subject
    s.require_op(op)
    if s.family != "torch":
        pytest.skip(
            f"storages resized to 0 are torch tensors'; {s.name!r} is tested with {s.family}"
        )
    tensors = {"x": _array(s, (4, 32)).clone(), "weight": _array(s, (32,)).clone()}
    tensors[freed].untyped_storage().resize_(0)  # clones: storages of their own, resizable
    with pytest.raises(normlab.NormlabError, match=rf"\b{freed}\b"):
        getattr(normlab, op)(tensors["x"], weight=tensors["weight"], backend=s.backend)
