"""The benchmark matrix: every usable backend × shape × dtype, beside its reference points.

Run it through ``benchmarks/run.py --quick`` or ``--full`` (pytest-benchmark underneath;
``conftest.py`` holds the budget, the progress line and the saved JSON). Backends come from
:func:`normlab.list_backends` (plugins included); one that is unavailable or fails to load is
skipped with its reason. Each case is timed with ``benchmark.pedantic`` after an untimed warm-up
call, so JIT compilation is excluded; its rounds come from its share of the time budget.

Shapes are ``[rows, hidden]`` with rows 1…65536 and hidden sizes 64…16384 (capped at 2**26
elements) plus a few ``[batch, seq, hidden]`` shapes. The textbook formula runs only where its
temporaries (up to six times the input, in float32 or wider) fit in a quarter of the memory.
Also here: the dispatch overhead on a tiny array, and peak memory per backend on a large input.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import memory
import numpy as np
import pytest
from workloads import (
    REFERENCES,
    backend_call,
    completing,
    make_input,
    make_params,
    numpy_dtype,
    reference_call,
)

import normlab
from normlab import registry, spec
from normlab.errors import NormlabError
from normlab.registry import Backend

if TYPE_CHECKING:
    from conftest import MatrixState

CAP_ELEMENTS: Final = 2**26
HIDDEN: Final = (64, 768, 1000, 1024, 4096, 16384)
ROWS: Final = (1, 64, 1024, 16384, 65536)
RANK3: Final = ((32, 128, 768), (8, 512, 1024), (4, 2048, 4096))
QUICK_SHAPES: Final = ((1, 1000), (1024, 768), (1024, 4096), (8, 512, 768))
DTYPES: Final = {
    "quick": ("float32", "float16"),
    "full": ("float32", "float16", "bfloat16", "float64"),
}
TEXTBOOK_TEMPORARIES: Final = 6
#: A round lasts at least this long (tiny calls are repeated within a round).
MIN_ROUND_S: Final = 1e-4
#: A call this slow (the textbook formula on big half-precision inputs) gets one warm-up call
#: and at least this many rounds, instead of two warm-up calls and the matrix's least rounds.
SLOW_CALL_S: Final = 1.0
SLOW_CALL_ROUNDS: Final = 3
DISPATCH_SHAPE: Final = (8, 64)
#: Seconds of timed rounds per dispatch case, and the least length of one of its rounds.
DISPATCH_SECONDS: Final = {"quick": 0.5, "full": 1.5}
DISPATCH_ROUND_S: Final = 1e-3
MEMORY_SHAPE: Final = {"quick": (2048, 4096), "full": (8192, 4096)}
MEMORY_DTYPES: Final = {"quick": ("float32",), "full": ("float32", "float16")}


@dataclass(frozen=True, slots=True)
class Case:
    """One timed call: a backend (``kind`` "layer_norm") or a reference point, on one input."""

    kind: str
    subject: str
    mode: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def id(self) -> str:
        what = f"ref-{self.subject}" if self.kind == "reference" else f"{self.subject}-{self.mode}"
        return f"{self.dtype}-{'x'.join(map(str, self.shape))}-{what}"

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def weight(self) -> float:
        """Relative cost, for sharing the time budget: the input size plus a floor per call."""
        return float(self.elements * 4 + 2**20)


# --------------------------------------------------------------------------------------------
# Which backends, shapes and dtypes; skipped ones carry their reason.


def refusal(backend: Backend) -> str | None:
    """Why ``backend`` is left out of the matrix here, or ``None`` when it is measured."""
    if not backend.available:
        return f"is unavailable: {backend.reason}"
    if "layer_norm" not in backend.ops:
        return "does not provide layer_norm"
    try:
        backend.function("layer_norm")
        probe = backend.from_numpy(np.zeros((1, 8), np.float32))
    except Exception as exc:  # a broken backend is reported and skipped, not fatal
        return f"is broken: {type(exc).__name__}: {exc}"
    device = spec.plan("layer_norm", probe, None, None, None, 1e-5, None, False, None).device_kind
    if device != "cpu":
        return f"keeps its arrays on {device}; this matrix measures CPU backends"
    return None


def usable_backends() -> tuple[list[Backend], list[Any]]:
    """The backends to measure, and one skipped parameter per backend left out."""
    usable, skipped = [], []
    for backend in normlab.list_backends():
        why = refusal(backend)
        if why is None:
            usable.append(backend)
        else:
            reason = f"backend {backend.name!r} ({backend.provided_by}) {why}"
            skipped.append(_skip(reason, backend.name))
    return usable, skipped


def shapes(matrix: str) -> list[tuple[int, ...]]:
    """The shapes of ``matrix``, small to large."""
    if matrix == "quick":
        return list(QUICK_SHAPES)
    grid = [(r, h) for r in ROWS for h in HIDDEN if r * h <= CAP_ELEMENTS]
    return sorted(grid + list(RANK3), key=lambda s: (math.prod(s), s))


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def missing_library(dtype: str) -> str | None:
    """Why ``dtype`` cannot be measured here, or ``None``."""
    if dtype == "bfloat16" and not _installed("ml_dtypes"):
        return "bfloat16 needs ml_dtypes"
    return None


def _skip(reason: str, id: str) -> Any:
    return pytest.param(None, id=id, marks=pytest.mark.skip(reason=reason))


def _textbook_fits(case: Case) -> bool:
    memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    itemsize = max(4, numpy_dtype(case.dtype).itemsize)
    return TEXTBOOK_TEMPORARIES * case.elements * itemsize <= memory_bytes // 4


def matrix_params(matrix: str) -> list[Any]:
    """Every case of ``matrix`` (grouped by input, references first) and every skip."""
    backends, params = usable_backends()
    if not _installed("torch"):
        params.append(_skip("the torch reference needs torch", "torch-reference"))
    for backend in backends:
        if "out" not in backend.capabilities:
            reason = f"backend {backend.name!r} does not claim out= (it would write a temporary)"
            params.append(_skip(reason, f"{backend.name}-out"))
    for dtype in DTYPES[matrix]:
        missing = missing_library(dtype)
        if missing:
            params.append(_skip(missing, dtype))
            continue
        serving = []
        for backend in backends:
            why = dtype_refusal(backend, dtype)
            if why is None:
                serving.append(backend)
            else:
                params.append(_skip(f"backend {backend.name!r} {why}", f"{backend.name}-{dtype}"))
        for shape in shapes(matrix):
            params.extend(_cases(dtype, shape, serving))
    return params


def dtype_refusal(backend: Backend, dtype: str) -> str | None:
    """Why ``backend`` cannot take ``dtype`` inputs here, or ``None``.

    Either its record does not claim the dtype, or converting an input refuses it with a
    normlab error (JAX without x64 mode has no float64 arrays). A failure of the call itself
    is not a refusal: the matrix reports it as an error.
    """
    if dtype not in backend.dtypes:
        return f"does not serve {dtype}"
    try:
        backend.from_numpy(np.zeros((1, 8), numpy_dtype(dtype)))
    except NormlabError as exc:
        return f"cannot hold {dtype} arrays here: {exc}"
    return None


def _cases(dtype: str, shape: tuple[int, ...], backends: list[Backend]) -> list[Any]:
    """The cases of one input: the references, then each backend (given: it serves dtype)."""
    refs = [r for r in REFERENCES if r != "torch" or _installed("torch")]
    cases = [Case("reference", r, "out" if r == "copyto" else "alloc", shape, dtype) for r in refs]
    for backend in backends:
        modes = ("alloc", "out") if "out" in backend.capabilities else ("alloc",)
        cases.extend(Case("layer_norm", backend.name, m, shape, dtype) for m in modes)
    params = []
    for case in cases:
        if case.subject == "textbook" and not _textbook_fits(case):
            reason = "the textbook formula's temporaries would not fit in a quarter of memory"
            params.append(pytest.param(case, id=case.id, marks=pytest.mark.skip(reason=reason)))
        else:
            params.append(pytest.param(case, id=case.id))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    matrix = metafunc.config.getoption("--normlab-matrix")
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", matrix_params(matrix))
    elif "dispatch_case" in metafunc.fixturenames:
        backends, skipped = usable_backends()
        paths = [
            pytest.param((b.name, p), id=f"{b.name}-{p}")
            for b in backends
            for p in ("normlab", "direct")
        ]
        metafunc.parametrize("dispatch_case", skipped + paths)
    elif "memory_case" in metafunc.fixturenames:
        backends, skipped = usable_backends()
        refs = [r for r in ("torch", "textbook", "copy") if r != "torch" or _installed("torch")]
        cases = []
        for dtype in MEMORY_DTYPES[matrix]:
            if missing_library(dtype):
                continue
            subjects = [("backend", b.name) for b in backends if not dtype_refusal(b, dtype)]
            subjects += [("reference", r) for r in refs]
            cases += [
                pytest.param((kind, name, dtype), id=f"{name}-{kind}-{dtype}")
                for kind, name in subjects
            ]
        metafunc.parametrize("memory_case", skipped + cases)


# --------------------------------------------------------------------------------------------
# Inputs, made once per (shape, dtype) and shared by that group's cases.


class Inputs:
    """The NumPy inputs of the current (shape, dtype); a new pair frees the previous one."""

    def __init__(self) -> None:
        self.key: tuple[tuple[int, ...], str] | None = None
        self.arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def get(self, shape: tuple[int, ...], dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.key != (shape, dtype) or self.arrays is None:
            self.arrays = None
            x = make_input(shape, dtype)
            self.arrays = (x, *make_params(shape[-1], dtype))
            self.key = (shape, dtype)
        return self.arrays


@pytest.fixture(scope="session")
def inputs() -> Inputs:
    return Inputs()


def _call_for(case: Case, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> Callable[[], Any]:
    if case.kind == "reference":
        return reference_call(case.subject, x, weight, bias)
    return backend_call(registry.get(case.subject), x, weight, bias, out=case.mode == "out")


def _probe(call: Callable[[], Any]) -> float:
    """Seconds of one warm call: an untimed warm-up call (imports, JIT, caches), then one more.

    A warm-up call of :data:`SLOW_CALL_S` or more stands for the call's time: such a call is
    big (and its rounds are few anyway) or compiled on the way (an overestimate, so fewer rounds).
    """
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    if first >= SLOW_CALL_S:
        return first
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _pace(once: float, seconds: float, round_s: float, matrix: MatrixState) -> tuple[int, int]:
    """Rounds and iterations per round for a call of ``once`` seconds, given ``seconds``."""
    iterations = max(1, math.ceil(round_s / max(once, 1e-9)))
    rounds = int(seconds / (once * iterations))
    least = SLOW_CALL_ROUNDS if once >= SLOW_CALL_S else matrix.min_rounds
    return min(max(rounds, least), matrix.max_rounds), iterations


# --------------------------------------------------------------------------------------------
# The benchmarks. Peak memory and dispatch come first: their cost is fixed, and the matrix
# then shares whatever budget is left.


def test_peak_memory(
    memory_case: tuple[str, str, str], matrix: MatrixState, request: pytest.FixtureRequest
) -> None:
    kind, subject, dtype = memory_case
    record = memory.measure(subject, kind, dtype, MEMORY_SHAPE[matrix.matrix])
    matrix.memory.append(record)
    extra = record["rss_extra_bytes"] / record["input_bytes"]
    request.node.user_properties.append(("normlab", f"peak +{extra:.2f}× the input"))


def test_dispatch_overhead(
    benchmark: Any,
    dispatch_case: tuple[str, str],
    matrix: MatrixState,
    request: pytest.FixtureRequest,
) -> None:
    name, path = dispatch_case
    backend = registry.get(name)
    x_np = make_input(DISPATCH_SHAPE, "float32")
    w_np, b_np = make_params(DISPATCH_SHAPE[-1], "float32")
    x, w, b = (backend.from_numpy(a) for a in (x_np, w_np, b_np))
    plan = spec.plan("layer_norm", x, None, w, b, 1e-5, None, False, None)
    function = backend.function("layer_norm")

    def through_normlab() -> Any:
        return normlab.layer_norm(x, weight=w, bias=b, backend=name)

    def direct() -> Any:
        return function(x, w, b, plan=plan, out=None)

    call = completing(through_normlab if path == "normlab" else direct, x)
    rounds, iterations = _pace(
        _probe(call), DISPATCH_SECONDS[matrix.matrix], DISPATCH_ROUND_S, matrix
    )
    benchmark.extra_info.update(
        kind="dispatch", subject=name, mode=path, shape=list(DISPATCH_SHAPE), dtype="float32"
    )
    benchmark.pedantic(call, rounds=rounds, iterations=iterations)
    best = benchmark.stats.stats.min
    request.node.user_properties.append(("normlab", f"{best * 1e6:7.2f} µs per call"))


def test_matrix(
    benchmark: Any, case: Case, inputs: Inputs, matrix: MatrixState, request: pytest.FixtureRequest
) -> None:
    share = matrix.share(case.weight)
    x, weight, bias = inputs.get(case.shape, case.dtype)
    call = _call_for(case, x, weight, bias)
    rounds, iterations = _pace(_probe(call), share, MIN_ROUND_S, matrix)
    nbytes = 2 * x.nbytes
    benchmark.extra_info.update(
        kind=case.kind,
        subject=case.subject,
        mode=case.mode,
        shape=list(case.shape),
        dtype=case.dtype,
        bytes=nbytes,
    )
    benchmark.pedantic(call, rounds=rounds, iterations=iterations)
    best = benchmark.stats.stats.min
    request.node.user_properties.append(
        ("normlab", f"{nbytes / best / 1e9:8.2f} GB/s  {rounds:>4} rounds × {iterations}")
    )
