"""Fused test cases: a :class:`FusedCase` describes an ``add_layer_norm``/``add_rms_norm`` call
completely.

It wraps the base op's :class:`~normlab.testing.cases.Case` (x's shape, dtype, values, seed,
axes, weight, bias, eps, layout, return_stats; its op is ``layer_norm`` or ``rms_norm``) and adds
the residual (a values kind of :data:`~normlab.testing.cases.VALUES` from its own seed, in its
own layout), ``return_residual``, and the kind of (x, residual) pair (:data:`PAIRS`). The
expected ``h`` is NumPy's ``x + residual`` in x's dtype, compared bitwise; the expected ``y``
and statistics are the float64 reference of the base op applied to that rounded ``h``, within
the base op's tolerances (:meth:`Case.compare <normlab.testing.cases.Case.compare>`). Failures
print a runnable snippet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

import normlab
from normlab import reference
from normlab.ops import FUSED_OPS as TABLE_FUSED_OPS
from normlab.ops import OPS
from normlab.ops import OPS as TABLE
from normlab.testing.cases import Case, _values, same_kind
from normlab.testing.conversions import arrange, conversion, driven_family, finfo
from normlab.testing.default_choice import call_backend

__all__ = ["FUSED_OPS", "PAIRS", "FusedCase", "absorbing_offset", "assert_same_bits"]

#: base op -> its fused op.
FUSED_OPS: Final = {base: fused for fused in TABLE_FUSED_OPS if (base := TABLE[fused].base)}

#: Kinds of (x, residual) pairs, with C = :func:`absorbing_offset` (the dtype's spacing at C
#: is 2):
#:
#: - ``"independent"``: x of the base case's values, residual of the case's ``residual`` values.
#: - ``"absorbed"``: x = C + 2k (k integers in [-8, 8], exact), residual = b with |b| < 2 (fine
#:   values): h = x + b rounds to C's grid, so y of the rounded h differs from y of the exact
#:   sum by up to 1/std(h) ≈ 0.1 — far beyond the half types' tolerance (float32 and float64:
#:   within it, the add's rounding being smaller than their compute allowance at this
#:   conditioning).
#: - ``"cancelling"``: x = C + a, residual = -C + b (a, b standard normal, rounded to the
#:   dtype): most digits cancel; the sum of such neighbours is exact in floating point
#:   (Sterbenz), so this pair tests the add, not its rounding.
PAIRS: Final = ("independent", "absorbed", "cancelling")


def absorbing_offset(dtype: str) -> float:
    """C = 2^p for a dtype of p significant bits (float16 2048, bfloat16 256, float32 2^24,
    float64 2^53): the dtype's spacing is 1 below C and 2 above it."""
    return float(2.0 ** (finfo(dtype).nmant + 1))


@dataclass(frozen=True)
class FusedCase:
    """The fused op of ``base.op`` on x (``base``'s) and a residual. Plain values: its repr is
    code."""

    base: Case
    residual: str = "normal"
    residual_layout: str = "c"
    return_residual: bool = True
    pair: str = "independent"

    def __post_init__(self) -> None:
        if self.pair not in PAIRS:
            raise ValueError(f"unknown pair {self.pair!r}; known: {', '.join(PAIRS)}")

    @property
    def op(self) -> str:
        """``"add_layer_norm"`` or ``"add_rms_norm"``."""
        return FUSED_OPS[self.base.op]

    def replace(self, **changes: Any) -> FusedCase:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------
    # Inputs and the expected h

    def numpy_inputs(
        self,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """``(x, residual, weight, bias)`` as C-ordered NumPy arrays of the case's dtypes (a
        ``"broadcast"`` layout repeats row 0 along axis 0, as the array passed does)."""
        base = self.base
        x, weight, bias = base.numpy_inputs()
        rng = np.random.default_rng((base.seed, 2))
        shape = (base.rows, base.cols)
        if self.pair == "independent":
            r64 = _values(self.residual, *shape, rng, base.dtype)
        else:
            offset = absorbing_offset(base.dtype)
            if self.pair == "absorbed":
                x64 = offset + 2.0 * rng.integers(-8, 9, shape)
                r64 = rng.uniform(-2.0, 2.0, shape)
            else:
                x64 = offset + rng.standard_normal(shape)
                r64 = -offset + rng.standard_normal(shape)
            x = self._arranged(x64, base.layout, x.dtype)
        return x, self._arranged(r64, self.residual_layout, x.dtype), weight, bias

    def _arranged(self, rows: np.ndarray, layout: str, dtype: np.dtype[Any]) -> np.ndarray:
        """``(rows, cols)`` float64 values placed as the base case places x's, in ``dtype``
        (broadcast from row 0 along axis 0 for the ``"broadcast"`` layout)."""
        base = self.base
        order = base.batch_axes + base.axes
        permuted = rows.reshape(tuple(base.shape[a] for a in order))
        values = permuted.transpose(np.argsort(order))
        if layout == "broadcast" and base.shape[0] > 0:
            values = np.broadcast_to(values[:1], base.shape)
        return np.ascontiguousarray(values).astype(dtype)

    def has_degenerate_row(self) -> bool:
        """Whether eps = 0 would divide 0 by 0 in some row of h (see
        :meth:`Case.has_degenerate_row <normlab.testing.cases.Case.has_degenerate_row>`)."""
        base = self.base
        h = reference.to_float64(self.h())
        rows = h.transpose(base.batch_axes + base.axes).reshape(base.rows, base.cols)
        if not base.rows:
            return False
        if base.op == "rms_norm":
            return bool((rows == 0).all(axis=1).any())
        return bool((rows.min(axis=1) == rows.max(axis=1)).any())

    def h(self) -> np.ndarray:
        """NumPy's ``x + residual`` in x's dtype: the h every backend must give, bit for bit."""
        x, residual, _, _ = self.numpy_inputs()
        with np.errstate(invalid="ignore", over="ignore"):
            h: np.ndarray = np.add(x, residual)
        return h

    def inputs(self, backend: str) -> tuple[Any, Any, dict[str, Any]]:
        """``x`` and ``residual`` in the backend's family and their layouts, and the keyword
        arguments of the call (the base case's, and return_stats and return_residual)."""
        b = conversion(backend)
        x, residual, _, _ = self.numpy_inputs()
        _, kwargs = self.base.inputs(backend)
        kwargs["return_stats"] = self.base.return_stats
        kwargs["return_residual"] = self.return_residual
        return (
            arrange(x, self.base.layout, b),
            arrange(residual, self.residual_layout, b),
            kwargs,
        )

    # ----------------------------------------------------------------------------------------
    # Running and checking

    def call(self, x: Any, residual: Any, **kwargs: Any) -> Any:
        """``normlab.add_layer_norm`` or ``normlab.add_rms_norm`` (the case's op)."""
        return getattr(normlab, self.op)(x, residual, **kwargs)

    def unpack(self, result: Any, repro: str = "") -> tuple[Any, Any, Any, Any]:
        """The fused op's result as ``(y, h, mean, rstd)``, None where the form has no such
        thing; asserts the form: ``y``, ``(y, h)``, ``(y, h, *stats)`` or ``(y, *stats)``
        (the base op's form when ``return_residual`` is False)."""
        names = ["y", *(["h"] if self.return_residual else [])]
        if self.base.return_stats:
            names += OPS[self.base.op].stats_outputs
        if names == ["y"]:
            assert not isinstance(result, (tuple, list)), (
                f"{self.op}(..., return_residual=False) must return y alone, as "
                f"{self.base.op} does, not a {type(result).__name__}\n{repro}"
            )
            return result, None, None, None
        assert isinstance(result, tuple) and len(result) == len(names), (
            f"{self.op} must return a tuple ({', '.join(names)}); got "
            f"{type(result).__name__} of {len(result) if isinstance(result, tuple) else 1}\n{repro}"
        )
        got = dict(zip(names, result, strict=True))
        return got["y"], got.get("h"), got.get("mean"), got.get("rstd")

    def run(self, backend: str) -> tuple[np.ndarray, np.ndarray | None, Any, Any]:
        """Call the op on ``backend``; results as NumPy ``(y, h, mean, rstd)`` (None where the
        form returns no such thing). Asserts y and h are of x's kind."""
        b = conversion(backend)
        x, residual, kwargs = self.inputs(backend)
        repro = self.snippet(backend)
        y, h, mean, rstd = self.unpack(
            self.call(x, residual, **kwargs, backend=call_backend(backend)), repro
        )
        same_kind(y, x, repro)
        if h is not None:
            same_kind(h, x, repro)

        def host(a: Any) -> np.ndarray | None:
            return None if a is None else np.asarray(b.to_numpy(a))

        y_host = host(y)
        assert y_host is not None
        return y_host, host(h), host(mean), host(rstd)

    def check(self, backend: str, *, rows: np.ndarray | None = None) -> None:
        """Run on ``backend``; assert h is bitwise NumPy's sum and y (and the statistics) match
        the reference of the base op on that h (``rows``: as for ``Case.check``)."""
        self.compare(*self.run(backend), backend=backend, rows=rows)

    def compare(
        self,
        y: np.ndarray,
        h: np.ndarray | None,
        mean: np.ndarray | None,
        rstd: np.ndarray | None,
        *,
        backend: str,
        rows: np.ndarray | None = None,
    ) -> None:
        """Assert NumPy results of this case: ``h`` (when given) bitwise the expected sum, ``y``
        and the statistics (when ``rstd`` is given) within the base op's tolerances of the
        reference on the rounded h."""
        repro = self.snippet(backend)
        want_h = self.h()
        if h is not None:
            assert_same_bits(h, want_h, "h", repro)
        _, _, weight, bias = self.numpy_inputs()
        self.base.compare(
            y, mean, rstd, backend=backend, rows=rows, inputs=(want_h, weight, bias), repro=repro
        )

    def snippet(self, backend: str) -> str:
        """Code that reproduces this case on ``backend`` (shown when a check fails)."""
        family = driven_family(backend)
        driven = (
            ""
            if family is None
            else "    from normlab.testing.conversions import drive\n"
            f"    drive({backend!r}, {family!r})  # {family} arrays, as tested\n"
        )
        return (
            "Reproduce with:\n"
            "    import normlab\n"
            "    from normlab.testing.cases import Case\n"
            "    from normlab.testing.fused_cases import FusedCase\n"
            f"{driven}"
            f"    case = {self!r}\n"
            f"    x, residual, kwargs = case.inputs({backend!r})  # as tested\n"
            f"    result = normlab.{self.op}(x, residual, **kwargs, "
            f"backend={call_backend(backend)!r})\n"
            "    h = case.h()  # NumPy's x + residual in x's dtype: h must equal it bitwise\n"
            f"    case.check({backend!r})  # the comparison\n"
        )


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str, repro: str = "") -> None:
    """Assert ``got`` holds exactly ``want``'s values in ``want``'s dtype: the same bits, any
    NaN matching any NaN (libraries differ in NaN payloads)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(
            f"{what} has dtype {got.dtype} and shape {got.shape}; expected {want.dtype} "
            f"{want.shape}\n{repro}"
        )
    unsigned = np.dtype(f"u{want.itemsize}")
    same = got.view(unsigned) == want.view(unsigned)
    with np.errstate(invalid="ignore"):
        wide_got, wide_want = got.astype(np.float64), want.astype(np.float64)
        same |= np.isnan(wide_got) & np.isnan(wide_want)
    if same.all():
        return
    bad = np.argwhere(~same)
    first = tuple(int(i) for i in bad[0])
    raise AssertionError(
        f"{what} ({want.dtype}): {len(bad)} of {same.size} elements differ from NumPy's x + "
        f"residual in x's dtype; first at index {first}: got {wide_got[first]!r}, expected "
        f"{wide_want[first]!r}\n{repro}"
    )
