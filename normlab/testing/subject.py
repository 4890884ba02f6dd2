"""The backend under test: what its record claims and what its array family can express.

Tests ask the :class:`Subject` before exercising something optional; what the record does not
claim, or the family cannot express, is skipped with the reason, never passed silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import normlab.testing.default_choice as default_choice
from normlab import arrays, dispatch, registry
from normlab.constants import FLOAT_DTYPES
from normlab.ops import OPS
from normlab.registry import Backend
from normlab.testing.conversions import (
    LAYOUTS,
    Conversion,
    LayoutUnavailable,
    arrange,
    conversion,
    numpy_dtype,
)

__all__ = ["Subject", "fused_path"]


def fused_path(name: str, op: str) -> str | None:
    """How the suite's tests of the fused ``op`` (``"add_layer_norm"``, ``"add_rms_norm"``)
    reach backend ``name``: ``"kernel"`` (its record lists the op: its own one-pass function),
    ``"composed"`` (it lists only the base op: the core adds x + residual with x's library,
    then runs its base op), ``"default"`` (a default subject: whichever the choice gives), or
    None (neither: the tests are skipped)."""
    if default_choice.is_default(name):
        return "default"
    ops = registry.get(name).ops
    if op in ops:
        return "kernel"
    base = OPS[op].base
    return "composed" if base is not None and base in ops else None


@dataclass(frozen=True)
class Subject:
    """A backend and the facts about it that decide which tests apply."""

    name: str
    family: str
    #: the float dtypes the record lists and the family can make here
    dtypes: tuple[str, ...]
    #: dtype -> why the family cannot make it here (say, JAX's float64 without x64 mode)
    unmakeable: dict[str, str]
    capabilities: frozenset[str]
    #: the ops the record lists
    ops: frozenset[str]
    #: layout -> None when the family can make it, else the reason it cannot.
    layouts: dict[str, str | None]
    #: the record declares that its platform flushes subnormals to zero
    flushes_subnormals: bool = False
    #: the family's arrays have memory normlab can address (strides): outputs can be written
    addressable: bool = True
    #: the record promises batch invariance (``batch_invariant``; a default: every candidate)
    batch_invariant: bool = True

    @classmethod
    def of(cls, name: str) -> Subject:
        """The subject for backend ``name`` (or the default subject ``default:FAMILY``, see
        :mod:`.default_choice`); skips (with the reason) when it cannot run here."""
        convert = conversion(name)
        if default_choice.is_default(name):
            family = default_choice.default_family(name)
            chosen = default_choice.candidates(family)
            if not chosen:
                pytest.skip(f"no available backend serves {family} arrays by default")
            backend = _Claims.common(chosen)
        else:
            backend = _Claims.of(registry.get(name))
        if backend.unavailable is not None:
            pytest.skip(f"backend {name!r} is unavailable here: {backend.unavailable}")
        if "layer_norm" not in backend.ops:
            pytest.skip(f"backend {name!r} does not provide layer_norm")
        unmakeable: dict[str, str] = {}
        for dtype in (d for d in FLOAT_DTYPES if d in backend.dtypes):
            try:
                convert.from_numpy(np.zeros(2, numpy_dtype(dtype)))
            except Exception as exc:
                unmakeable[dtype] = f"{type(exc).__name__}: {exc}"
        dtypes = tuple(d for d in FLOAT_DTYPES if d in backend.dtypes and d not in unmakeable)
        if not dtypes:
            pytest.skip(f"backend {name!r}: no float dtype it serves can be made ({unmakeable})")
        probe = np.arange(6.0).reshape(2, 3).astype(numpy_dtype(dtypes[-1]))
        made = convert.from_numpy(probe)
        return cls(
            name=name,
            family=arrays.family_of(made),
            dtypes=dtypes,
            unmakeable=unmakeable,
            capabilities=frozenset(backend.capabilities),
            ops=frozenset(backend.ops),
            layouts={layout: _layout_problem(probe, layout, convert) for layout in LAYOUTS},
            flushes_subnormals=backend.flushes_subnormals,
            addressable=arrays.info(made).strides is not None,
            batch_invariant=backend.batch_invariant,
        )

    @property
    def is_default(self) -> bool:
        """Whether this is a default subject (``default:FAMILY``): calls name no backend."""
        return default_choice.is_default(self.name)

    @property
    def backend(self) -> str | None:
        """What the suite's calls pass as ``backend=``: the name, or None for a default
        subject (the dispatcher chooses)."""
        return default_choice.call_backend(self.name)

    def require_named(self, what: str) -> None:
        """Skip for a default subject: ``what`` concerns a backend named with ``backend=``."""
        if self.is_default:
            pytest.skip(f"{self.name} names no backend: {what} is checked per backend")

    def require_batch_invariance(self) -> None:
        """Skip unless the record promises batch invariance (``batch_invariant``, the default);
        the report names the area whose every test was skipped."""
        if not self.batch_invariant:
            pytest.skip(
                f"backend {self.name!r} declares batch_invariant=False: a row's bits may depend "
                "on the rest of its batch"
            )

    @property
    def dtype(self) -> str:
        """The dtype of tests about something else than dtypes: float32, else the widest."""
        return "float32" if "float32" in self.dtypes else self.dtypes[-1]

    @property
    def usable_layouts(self) -> tuple[str, ...]:
        return tuple(layout for layout, problem in self.layouts.items() if problem is None)

    def require_dtype(self, dtype: str) -> None:
        """Skip unless the backend serves ``dtype`` and its family can make such arrays."""
        if dtype in self.unmakeable:
            pytest.skip(
                f"{self.family} arrays of {dtype} cannot be made here: {self.unmakeable[dtype]}"
            )
        if dtype not in self.dtypes:
            pytest.skip(
                f"backend {self.name!r} does not serve {dtype} (its record lists "
                f"{', '.join(self.dtypes)})"
            )

    def require_op(self, op: str) -> None:
        """Skip unless the record lists ``op`` (``"layer_norm"``, ``"rms_norm"``)."""
        if op not in self.ops:
            pytest.skip(
                f"backend {self.name!r} does not provide {op} (its record lists ops: "
                f"{', '.join(sorted(self.ops))})"
            )

    def require_fused(self, op: str) -> str:
        """Skip unless the fused ``op`` reaches the backend (its own kernel, or the core's
        composition around its base op); returns :func:`fused_path`'s answer."""
        path = fused_path(self.name, op)
        if path is None:
            pytest.skip(
                f"backend {self.name!r} provides neither {op} nor {OPS[op].base} (its record "
                f"lists ops: {', '.join(sorted(self.ops))})"
            )
        return path

    def require_writable(self) -> None:
        """Skip unless the family's arrays can be given as outputs (``out=``,
        ``residual_out=``): they have addressable memory (JAX's and Dask's do not)."""
        if not self.addressable:
            pytest.skip(
                f"{self.family} arrays have no addressable memory (immutable or lazy): they "
                "cannot be passed as out= or residual_out="
            )

    def require_capability(self, capability: str, consequence: str) -> None:
        """Skip unless the record claims ``capability``; ``consequence`` says what that means."""
        if capability not in self.capabilities:
            claimed = ", ".join(sorted(self.capabilities)) or "none"
            pytest.skip(
                f"backend {self.name!r} does not claim {capability!r} (claims: "
                f"{claimed}); {consequence}"
            )

    def require_graph(self, op: str) -> None:
        """Skip unless torch tensors that require grad keep their graph through this backend's
        ``op``: it records graphs itself, or normlab runs it through its custom ops
        (:func:`normlab.dispatch.keeps_graph`); a default subject: through some candidate."""
        if self.is_default:
            family = default_choice.default_family(self.name)
            if not any(dispatch.keeps_graph(b, op) for b in default_choice.candidates(family)):
                pytest.skip(f"no backend serving {family} arrays keeps the graph of {op}")
            return
        if not dispatch.keeps_graph(registry.get(self.name), op):
            pytest.skip(
                f"backend {self.name!r} neither records autograd graphs nor provides "
                f"{op}_backward; tensors that require grad are not served"
            )

    def require_values(self, values: str) -> None:
        """Skip a case of ``values`` (a :data:`~normlab.testing.cases.VALUES` kind) that the
        contract exempts this backend from: subnormal values where the record declares
        ``flushes_subnormals``."""
        if values == "subnormal" and self.flushes_subnormals:
            pytest.skip(
                f"backend {self.name!r} declares flushes_subnormals=True (its platform flushes "
                "subnormals to zero): subnormal inputs are outside its contract"
            )

    def require_layout(self, layout: str) -> None:
        """Skip unless the family can make ``layout``."""
        problem = self.layouts[layout]
        if problem is not None:
            pytest.skip(f"{self.family} arrays cannot have the {layout!r} layout: {problem}")

    def from_numpy(self, a: np.ndarray) -> Any:
        """``a`` as an array of the family the backend is tested with."""
        return conversion(self.name).from_numpy(a)

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(conversion(self.name).to_numpy(a))


@dataclass(frozen=True)
class _Claims:
    """What a subject's record claims: one backend's, or what every candidate of a default
    subject holds to (dtypes and ops of any, capabilities of all)."""

    unavailable: str | None
    dtypes: frozenset[str]
    ops: frozenset[str]
    capabilities: frozenset[str]
    flushes_subnormals: bool
    batch_invariant: bool

    @classmethod
    def of(cls, backend: Backend) -> _Claims:
        return cls(
            None if backend.available else backend.reason,
            backend.dtypes,
            backend.ops,
            backend.capabilities,
            backend.flushes_subnormals,
            backend.batch_invariant,
        )

    @classmethod
    def common(cls, backends: list[Backend]) -> _Claims:
        """The claims of a default call among ``backends``: ``out=`` and in place always (the
        core writes them through a temporary for a backend that does not), strides where every
        candidate reads them."""
        return cls(
            None,
            frozenset().union(*(b.dtypes for b in backends)),
            frozenset().union(*(b.ops for b in backends)),
            frozenset.intersection(*(b.capabilities for b in backends)) | {"out", "inplace"},
            any(b.flushes_subnormals for b in backends),
            all(b.batch_invariant for b in backends),
        )


def _layout_problem(probe: np.ndarray, layout: str, convert: Conversion) -> str | None:
    try:
        x = arrange(probe, layout, convert)
    except LayoutUnavailable as exc:
        return str(exc)
    if layout != "c" and arrays.info(x).strides is None:
        return "the family has no strided memory (the layout is not observable)"
    return None
