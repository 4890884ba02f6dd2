"""Backward test cases: a :class:`BackwardCase` describes a backward call completely.

It wraps the forward :class:`~normlab.testing.cases.Case` (x's shape, dtype, values, seed,
axes, weight, eps, layout; its op is ``layer_norm`` or ``rms_norm``) and adds the upstream
``dy`` (standard normal from the seed, in x's layout) and ``needs``. The statistics handed to
the backward are the float64 reference's, rounded to the statistics dtype (float32, float64
for float64 x) as a forward returns them, so the backward area does not depend on the
backend's forward. :meth:`BackwardCase.run` checks what a call returns (kinds, dtypes, None
where not needed, inputs untouched); :meth:`BackwardCase.check` compares with the float64
oracles of :mod:`.backward_reference`; failures print a runnable snippet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

import normlab
import normlab.testing.backward_reference as backward_reference
from normlab.constants import stats_dtype_for
from normlab.ops import FORWARD_OPS, OPS
from normlab.testing.cases import Case, same_kind
from normlab.testing.conversions import arrange, conversion, numpy_dtype
from normlab.testing.default_choice import call_backend, flushes_subnormals
from normlab.testing.tolerances import assert_close

__all__ = ["BACKWARD_OPS", "BackwardCase"]

#: forward op -> its backward op.
BACKWARD_OPS: Final = {op: f"{op}_backward" for op in FORWARD_OPS}


@dataclass(frozen=True)
class BackwardCase:
    """The backward of ``forward`` for a random ``dy``, asking for ``needs`` (None: the
    default, every gradient). Plain values: its repr is code."""

    forward: Case
    needs: tuple[str, ...] | None = None

    @property
    def op(self) -> str:
        """The backward op: ``"layer_norm_backward"`` or ``"rms_norm_backward"``."""
        return BACKWARD_OPS[self.forward.op]

    @property
    def names(self) -> tuple[str, ...]:
        """The gradients the op returns, in order (``"x"``, ``"weight"``[, ``"bias"``])."""
        result: tuple[str, ...] = OPS[self.op].gradients
        return result

    @property
    def wanted(self) -> frozenset[str]:
        return frozenset(self.names if self.needs is None else self.needs)

    # ----------------------------------------------------------------------------------------
    # Inputs

    def numpy_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(x, dy, weight)`` as C-ordered NumPy arrays (dy in x's dtype)."""
        x, weight, _ = self.forward.numpy_inputs()
        rng = np.random.default_rng((self.forward.seed, 1))
        dy64 = rng.standard_normal(x.shape)
        if self.forward.layout == "broadcast" and x.shape[0] > 0:
            dy64 = np.broadcast_to(dy64[:1], x.shape)
        return x, np.ascontiguousarray(dy64).astype(x.dtype), weight

    def statistics(self) -> tuple[np.ndarray | None, np.ndarray]:
        """``(mean, rstd)`` as the forward returns them: the reference's, keepdims-shaped, in
        the statistics dtype; mean is None for rms_norm."""
        _, mean, rstd = self.forward.expected()
        dtype = numpy_dtype(stats_dtype_for(self.forward.dtype))
        return (None if mean is None else mean.astype(dtype)), rstd.astype(dtype)

    def inputs(self, backend: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional arguments (``dy, x, mean, rstd`` — no mean for rms_norm — and
        weight) in the backend's family, x and dy in the case's layout, and the keywords.

        Raises :class:`~normlab.testing.cases.LayoutUnavailable` when the family cannot make
        the layout.
        """
        b = conversion(backend)
        x, dy, weight = self.numpy_inputs()
        mean, rstd = self.statistics()
        stats = (b.from_numpy(rstd),) if mean is None else (b.from_numpy(mean), b.from_numpy(rstd))
        args = (
            arrange(dy, self.forward.layout, b),
            arrange(x, self.forward.layout, b),
            *stats,
            None if weight is None else b.from_numpy(weight),
        )
        kwargs: dict[str, Any] = {}
        if self.forward.normalized_shape is not None:
            kwargs["normalized_shape"] = self.forward.normalized_shape
        if self.forward.axis is not None:
            kwargs["axis"] = self.forward.axis
        if self.needs is not None:
            kwargs["needs"] = self.needs
        return args, kwargs

    # ----------------------------------------------------------------------------------------
    # Running and checking

    def call(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """``normlab.layer_norm_backward`` or ``normlab.rms_norm_backward`` (the case's op)."""
        result: tuple[Any, ...] = getattr(normlab, self.op)(*args, **kwargs)
        return result

    def run(self, backend: str) -> dict[str, np.ndarray | None]:
        """Call the op on ``backend``; its gradients by name, as NumPy (None where not needed).

        Asserts what any call must do: dx has x's type, shape, dtype and device; dweight and
        dbias have the normalized shape and weight's dtype (x's without weight); a gradient
        is None exactly when it is not needed; no input is modified.
        """
        b = conversion(backend)
        repro = self.snippet(backend)
        args, kwargs = self.inputs(backend)
        before = [None if a is None else b.to_numpy(a).tobytes() for a in args]
        result = self.call(*args, **kwargs, backend=call_backend(backend))
        after = [None if a is None else b.to_numpy(a).tobytes() for a in args]
        labels = ("dy", "x", *(("mean",) if len(args) == 5 else ()), "rstd", "weight")
        changed = [n for n, old, new in zip(labels, before, after, strict=True) if old != new]
        assert not changed, f"the backward modified its inputs {changed}\n{repro}"
        if not isinstance(result, tuple) or len(result) != len(self.names):
            raise AssertionError(
                f"{self.op} returned {type(result).__name__} of "
                f"{len(result) if isinstance(result, tuple) else '?'} items; expected a tuple "
                f"of {len(self.names)}\n{repro}"
            )
        x, weight = args[1], args[-1]
        grad_dtype = (weight if weight is not None else x).dtype
        norm_shape = tuple(self.forward.shape[a] for a in self.forward.axes)
        grads: dict[str, np.ndarray | None] = {}
        for name, got in zip(self.names, result, strict=True):
            if (got is None) != (name not in self.wanted):
                raise AssertionError(
                    f"d{name} is {'None' if got is None else 'an array'} with needs="
                    f"{self.needs}: a gradient is None exactly when it is not needed\n{repro}"
                )
            if got is None:
                grads[name] = None
                continue
            if name == "x":
                same_kind(got, x, repro)
            elif tuple(got.shape) != norm_shape or got.dtype != grad_dtype:
                raise AssertionError(
                    f"d{name} has shape {tuple(got.shape)} and dtype {got.dtype}; expected "
                    f"{norm_shape} and {grad_dtype}\n{repro}"
                )
            grads[name] = np.asarray(b.to_numpy(got))
        return grads

    def expected(self, x: np.ndarray | None = None) -> backward_reference.Expected:
        """The float64 oracle's gradients (every one, needed or not) and their scales;
        ``x``: the forward's input instead of the case's own (a fused case's rounded ``h``)."""
        own_x, dy, weight = self.numpy_inputs()
        x = own_x if x is None else x
        f = self.forward
        return backward_reference.gradients(f.op, x, dy, weight, f.eps, f.axes)

    def check(self, backend: str, *, against_autograd: bool = False) -> None:
        """Run on ``backend`` and assert each needed gradient matches the float64 oracle (and
        torch.autograd's float64 gradients too, with ``against_autograd`` where torch is
        installed), within the tolerances."""
        self.compare(self.run(backend), backend=backend, against_autograd=against_autograd)

    def compare(
        self,
        grads: dict[str, np.ndarray | None],
        *,
        backend: str,
        against_autograd: bool = False,
        x: np.ndarray | None = None,
        repro: str | None = None,
    ) -> None:
        """Assert gradients (NumPy, from :meth:`run`) match the oracles (see :meth:`check`);
        ``x`` as for :meth:`expected`, ``repro`` the snippet shown on failure (default
        :meth:`snippet`)."""
        want = self.expected(x)
        references = {"the float64 reference": want.gradients}
        if against_autograd:
            own_x, dy, weight = self.numpy_inputs()
            f = self.forward
            traced = backward_reference.autograd(
                f.op, own_x if x is None else x, dy, weight, f.eps, f.axes
            )
            if traced is not None:
                references["torch.autograd (float64)"] = traced
        repro = self.snippet(backend) if repro is None else repro
        flushed = flushes_subnormals(backend)
        f = self.forward
        cond = want.conditioning
        worst = float(cond.max(initial=1.0))
        for name, got in grads.items():
            if got is None:
                continue
            dtype = f.dtype if name == "x" else got.dtype.name
            for label, exact in references.items():
                assert_close(
                    got,
                    exact[name],
                    dtype,
                    cond if name == "x" else worst,
                    what=f"d{name}",
                    cols=f.cols,
                    rows=0 if name == "x" else f.rows,
                    scale=want.scales[name],
                    flushed=flushed,
                    repro=f"(against {label})\n{repro}",
                )

    def snippet(self, backend: str) -> str:
        """Code that reproduces this case on ``backend`` (shown when a check fails)."""
        return (
            "Reproduce with:\n"
            "    import normlab\n"
            "    from normlab.testing.backward_cases import BackwardCase\n"
            "    from normlab.testing.cases import Case\n"
            f"    case = {self!r}\n"
            f"    args, kwargs = case.inputs({backend!r})  # dy, x, stats, weight as tested\n"
            f"    grads = normlab.{self.op}(*args, **kwargs, backend={call_backend(backend)!r})\n"
            "    expected = case.expected()  # float64 oracle: .gradients, .scales\n"
            f"    case.check({backend!r})  # the comparison\n"
        )
