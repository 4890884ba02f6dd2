"""The benchmark matrix: every usable backend × op × shape × dtype, beside its reference points.

Run it through ``benchmarks/run.py --quick`` or ``--full`` (pytest-benchmark underneath;
``conftest.py`` holds the budget, the progress line and the saved JSON). Backends come from
:func:`normlab.list_backends` (plugins included) and are measured on each op their record lists
(:data:`workloads.OPS`: ``layer_norm``, ``rms_norm`` and their backwards), decided at run time;
one that is unavailable, lacks the op or fails to load is skipped with its reason. Each case is
timed with ``benchmark.pedantic`` after an untimed warm-up call, so JIT compilation is
excluded; its rounds come from its share of the time budget.

Shapes are ``[rows, hidden]`` with rows 1…65536 and hidden sizes 64…16384 (capped at 2**26
elements) plus a few ``[batch, seq, hidden]`` shapes, the same for every op in the full matrix,
whose forwards also sweep the small sizes (rows 1, 2, 4 … 1024 at hidden 768 and 1024, float32
and float16: time per call against rows); the quick one takes four shapes for LayerNorm and two
(one latency-bound, one bandwidth-bound) for the other ops.

The full matrix also times the forwards' peers (``peers.py``: ONNX Runtime allocating and through
an io_binding, on every shape; ``torch.compile`` on :data:`COMPILE_SHAPES`), each skipped with
its reason where it cannot run here. The quick matrix (CI) has none. Each backend call records
whether normlab's default choice for that NumPy input is this backend (``default``), and the
"auto" rows time that default itself: ``normlab.<op>`` with no backend named, on NumPy arrays
(``auto``) and on CPU torch tensors (``auto-torch``), dispatch included. The ``numba-torch`` rows
time numba named on those CPU tensors (which it serves zero-copy): with the torch backend's own
rows, the choices ``auto-torch`` has.

The fused ops (``add_layer_norm``, ``add_rms_norm``: residual add + norm) have rows of their own
on CPU torch tensors (``workloads.fused_call``): normlab's fused call with numba named (``(y, h)``,
and the post-norm ``y`` alone) and with no backend named (``auto-torch``), against the unfused
pairs on the same tensors: torch eager's add then ``normlab.layer_norm``/``rms_norm`` on numba,
torch eager's add then ``F.layer_norm``/``F.rms_norm``, and in the full matrix ``torch.compile``
of that pair. Their shapes (:data:`FUSED_SHAPES`) are a few small (x ≤ 1 MiB) and large
(x ≥ 8 MiB) inputs, float32 and the half types.

The options of real models' norms (``benchmarks/options.py``: ``weight_offset``, a bfloat16 weight
beside float32 x, ``casting="llama"``, a float32 residual stream) have rows of their own
(:func:`test_option`, kind ``"option"``): each option's call beside normlab's plain call of the
same shape and dtypes and torch eager's composition of the same formula, on CPU tensors, one
token and a prefill (1x4096, 1024x4096).

The quantized outputs (``benchmarks/quantized.py``: ``rms_norm`` and ``add_rms_norm`` with
``quantize="int8"``, ``rms_norm`` with ``"fp8_e4m3"``, dynamic scale) have rows of their own
(:func:`test_quantized`, kind ``"quantized"``): normlab's fused call beside the unfused pair
(normlab's plain call, then numba's quantizer over that y) and torch eager's composition, on CPU
tensors, float32 and bfloat16, 1x4096, 32x4096 and (full matrix) 8192x4096.

The textbook formula runs only where its temporaries (up to six times the input, in float32 or
wider) fit in a quarter of the memory. Also here: the dispatch overhead on a tiny array, and
peak memory per backend on a large input (both LayerNorm forward).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pytest

import normlab
from benchmarks import memory, options, peers, quantized
from benchmarks.workloads import (
    AUTO,
    EPS,
    FUSED,
    FUSED_MODES,
    FUSED_REFERENCES,
    LIMITS,
    ON_TORCH,
    OPS,
    REFERENCES,
    Workload,
    auto_call,
    backend_call,
    completing,
    fused_call,
    make_input,
    make_params,
    moved_bytes,
    reference_call,
)
from normlab import dispatch, registry, spec
from normlab.errors import NormlabError
from normlab.ops import FORWARD_OPS
from normlab.registry import Backend
from normlab.testing.conversions import numpy_dtype

if TYPE_CHECKING:
    from benchmarks.conftest import MatrixState

CAP_ELEMENTS: Final = 2**26
HIDDEN: Final = (64, 768, 1000, 1024, 4096, 16384)
ROWS: Final = (1, 64, 1024, 16384, 65536)
RANK3: Final = ((32, 128, 768), (8, 512, 1024), (4, 2048, 4096))
#: The quick matrix's shapes per op (the full matrix measures every op on every shape).
QUICK_SHAPES: Final = {
    "layer_norm": ((1, 1000), (1024, 768), (1024, 4096), (8, 512, 768)),
    "rms_norm": ((1, 1000), (1024, 4096)),
    "layer_norm_backward": ((1, 1000), (1024, 4096)),
    "rms_norm_backward": ((1, 1000), (1024, 4096)),
}
#: The fused ops' shapes: small (x ≤ 1 MiB, where the unfused pair's second call's fixed cost
#: tells) and large (x ≥ 8 MiB in every dtype measured: memory-bound). The quick matrix shares
#: its two inputs with the other ops (and their copy limits).
FUSED_SHAPES: Final = {
    "quick": ((1, 1000), (1024, 4096)),
    "full": ((1, 768), (32, 768), (128, 768), (8192, 1024), (16384, 768)),
}
#: The dtypes the fused ops are measured on (of the matrix's own): float64 is left out.
FUSED_DTYPES: Final = ("float32", "float16", "bfloat16")
#: Relative cost of a fused call to a forward on the same input (four arrays, not two).
FUSED_COST: Final = 2.0
DTYPES: Final = {
    "quick": ("float32", "float16"),
    "full": ("float32", "float16", "bfloat16", "float64"),
}
FORWARDS: Final = FORWARD_OPS
#: The small-size sweep of the full matrix's forwards: rows against time per call.
SWEEP_ROWS: Final = tuple(2**k for k in range(11))
SWEEP_HIDDEN: Final = (768, 1024)
SWEEP_DTYPES: Final = ("float32", "float16")
#: The shapes torch.compile is timed on (each a compile of its own, a second or more): the
#: sweep's rows 1, 8, 64, 256, 1024 and two large row counts, at hidden 768 and 1024.
COMPILE_SHAPES: Final = frozenset(
    (rows, hidden) for rows in (1, 8, 64, 256, 1024, 16384, 65536) for hidden in SWEEP_HIDDEN
)
#: Relative cost of a backward call to a forward one on the same input (three arrays, not two).
BACKWARD_COST: Final = 1.5
TEXTBOOK_TEMPORARIES: Final = 6
#: A round lasts at least this long (tiny calls are repeated within a round).
MIN_ROUND_S: Final = 1e-4
#: A call this slow once warm (the textbook formula on big half-precision inputs) gets at least
#: this many rounds, instead of the matrix's least rounds.
SLOW_CALL_S: Final = 1.0
SLOW_CALL_ROUNDS: Final = 3
DISPATCH_SHAPE: Final = (8, 64)
#: Seconds of timed rounds per dispatch case, and the least length of one of its rounds.
DISPATCH_SECONDS: Final = {"quick": 0.5, "full": 1.5}
#: Seconds of timed rounds per contender of an option (benchmarks/options.py).
OPTION_SECONDS: Final = {"quick": 0.3, "full": 1.0}
#: Seconds of timed rounds per contender of a quantized case (benchmarks/quantized.py).
QUANTIZED_SECONDS: Final = {"quick": 0.3, "full": 1.0}
#: The largest quantized case of the quick matrix (elements of x).
QUICK_QUANTIZED_ELEMENTS: Final = 32 * 4096
DISPATCH_ROUND_S: Final = 1e-3
MEMORY_SHAPE: Final = {"quick": (2048, 4096), "full": (8192, 4096)}
MEMORY_DTYPES: Final = {"quick": ("float32",), "full": ("float32", "float16")}


@dataclass(frozen=True, slots=True)
class Case:
    """One timed call: ``op`` through backend ``subject``, or a reference point of ``op``.

    A copy limit (:data:`workloads.LIMITS`) serves every op of its input: its ``op`` is None.
    """

    op: str | None
    subject: str
    mode: str
    shape: tuple[int, ...]
    dtype: str
    reference: bool = False

    @property
    def kind(self) -> str:
        """What the saved JSON calls it: ``"reference"``, or the op of a backend call."""
        return "reference" if self.reference or self.op is None else self.op

    @property
    def id(self) -> str:
        what = f"ref-{self.subject}" if self.reference else f"{self.subject}-{self.mode}"
        op = "" if self.op is None else f"{self.op}-"
        return f"{self.dtype}-{'x'.join(map(str, self.shape))}-{op}{what}"

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def weight(self) -> float:
        """Relative cost, for sharing the time budget: the input size plus a floor per call."""
        if self.op in FUSED:
            cost = FUSED_COST
        else:
            cost = 1.0 if self.op in (None, *FORWARDS) else BACKWARD_COST
        return float(self.elements * 4 * cost + 2**20)


# --------------------------------------------------------------------------------------------
# Which backends, ops, shapes and dtypes; skipped ones carry their reason.


def refusal(backend: Backend) -> str | None:
    """Why ``backend`` is left out of the matrix here, or ``None`` when it is measured."""
    if not backend.available:
        return f"is unavailable: {backend.reason}"
    try:
        probe = backend.from_numpy(np.zeros((1, 8), np.float32))
    except Exception as exc:  # a broken backend is reported and skipped, not fatal
        return f"is broken: {type(exc).__name__}: {exc}"
    device = spec.plan("layer_norm", probe).device_kind
    if device != "cpu":
        return f"keeps its arrays on {device}; this matrix measures CPU backends"
    return None


def op_refusal(backend: Backend, op: str) -> str | None:
    """Why ``backend`` (usable here) is not measured on ``op``, or ``None``: its record's ops."""
    if op not in backend.ops:
        return f"does not provide {op}"
    try:
        backend.function(op)
    except Exception as exc:  # a broken backend is reported and skipped, not fatal
        return f"is broken: {type(exc).__name__}: {exc}"
    return None


def usable_backends() -> tuple[list[Backend], list[Any]]:
    """The backends to measure, and one skipped parameter per backend left out."""
    usable, skipped = [], []
    for backend in normlab.list_backends():
        why = refusal(backend)
        if why is None:
            usable.append(backend)
        else:
            skipped.append(_skip(_about(backend, why), backend.name))
    return usable, skipped


def serving(backends: list[Backend], op: str) -> tuple[list[Backend], list[Any]]:
    """Of ``backends`` (usable here), those measured on ``op``, and a skip per one left out."""
    chosen, skipped = [], []
    for backend in backends:
        why = op_refusal(backend, op)
        if why is None:
            chosen.append(backend)
        else:
            skipped.append(_skip(_about(backend, why), f"{backend.name}-{op}"))
    return chosen, skipped


def _about(backend: Backend, why: str) -> str:
    return f"backend {backend.name!r} ({backend.provided_by}) {why}"


def shapes(matrix: str, op: str, dtype: str | None = None) -> list[tuple[int, ...]]:
    """The shapes of ``op`` in ``matrix`` (on ``dtype``: the sweep's too), small to large."""
    if op in FUSED:
        return list(FUSED_SHAPES[matrix]) if dtype is None or dtype in FUSED_DTYPES else []
    if matrix == "quick":
        return sorted(QUICK_SHAPES[op], key=lambda s: (math.prod(s), s))
    grid = {(r, h) for r in ROWS for h in HIDDEN if r * h <= CAP_ELEMENTS} | set(RANK3)
    if op in FORWARDS and dtype in SWEEP_DTYPES:
        grid |= {(r, h) for r in SWEEP_ROWS for h in SWEEP_HIDDEN}
    return sorted(grid, key=lambda s: (math.prod(s), s))


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
        params.append(_skip("the torch references need torch", "torch-reference"))
    by_op: dict[str, list[Backend]] = {}
    for op in OPS:
        by_op[op], skipped = serving(backends, op)
        params.extend(skipped)
    numba = next((b for b in backends if b.name == "numba"), None)
    fused_refusal = _fused_refusal(numba)
    if fused_refusal is not None:
        params.append(_skip(f"the fused ops' rows {fused_refusal}", "fused"))
    for backend in backends:
        if "out" not in backend.capabilities and any(backend in by_op[op] for op in FORWARDS):
            reason = f"backend {backend.name!r} does not claim out= (it would write a temporary)"
            params.append(_skip(reason, f"{backend.name}-out"))
    for dtype in DTYPES[matrix]:
        missing = missing_library(dtype)
        if missing:
            params.append(_skip(missing, dtype))
            continue
        refused = set()
        for backend in backends:
            why = dtype_refusal(backend, dtype)
            if why is not None:
                refused.add(backend.name)
                params.append(_skip(f"backend {backend.name!r} {why}", f"{backend.name}-{dtype}"))
        measured = OPS if fused_refusal is not None or "numba" in refused else (*OPS, *FUSED)
        of_op = {op: shapes(matrix, op, dtype) for op in measured}
        every = sorted({s for op in measured for s in of_op[op]}, key=lambda s: (math.prod(s), s))
        for shape in every:
            params.extend(_limit_cases(dtype, shape))
            for op in measured:
                if shape in of_op[op]:
                    if op in FUSED:
                        params.extend(_fused_cases(op, dtype, shape))
                    else:
                        serving_op = [b for b in by_op[op] if b.name not in refused]
                        params.extend(_cases(op, dtype, shape, serving_op))
                    if matrix == "full":
                        params.extend(_peer_cases(op, dtype, shape))
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


def _limit_cases(dtype: str, shape: tuple[int, ...]) -> list[Any]:
    """The copy limits of one input, shared by all its ops."""
    cases = [
        Case(None, name, "out" if name == "copyto" else "alloc", shape, dtype, reference=True)
        for name in LIMITS
    ]
    return [pytest.param(case, id=case.id) for case in cases]


def _cases(op: str, dtype: str, shape: tuple[int, ...], backends: list[Backend]) -> list[Any]:
    """The cases of ``op`` on one input: its references, then each backend (serving op, dtype)."""
    refs = [r for r in REFERENCES[op] if r != "torch" or _installed("torch")]
    cases = [Case(op, r, "alloc", shape, dtype, reference=True) for r in refs]
    for backend in backends:
        out = op in FORWARDS and "out" in backend.capabilities
        modes = ("alloc", "out") if out else ("alloc",)
        cases.extend(Case(op, backend.name, m, shape, dtype) for m in modes)
    cases.extend(
        Case(op, auto, "alloc", shape, dtype)
        for auto, family in AUTO.items()
        if family == "numpy" or _installed(family)
    )
    if _installed("torch"):  # a backend on CPU tensors, beside the torch backend's rows
        cases.extend(
            Case(op, row, "alloc", shape, dtype)
            for row, name in ON_TORCH.items()
            if any(b.name == name and "torch" in b.zero_copy_families for b in backends)
        )
    params = []
    for case in cases:
        if case.subject == "textbook" and case.reference and not _textbook_fits(case):
            reason = "the textbook formula's temporaries would not fit in a quarter of memory"
            params.append(pytest.param(case, id=case.id, marks=pytest.mark.skip(reason=reason)))
        else:
            params.append(pytest.param(case, id=case.id))
    return params


def _fused_refusal(numba: Backend | None) -> str | None:
    """Why the fused ops are not measured here (they need torch, and numba for the unfused pair
    they are judged against), or ``None``."""
    if not _installed("torch"):
        return "need torch (they run on CPU torch tensors)"
    if numba is None:
        return "need the numba backend (usable here) for the unfused pair they are judged against"
    for op in FORWARDS:
        why = op_refusal(numba, op)
        if why is not None:
            return f"need numba's {op}: backend 'numba' {why}"
    return None


def _fused_cases(op: str, dtype: str, shape: tuple[int, ...]) -> list[Any]:
    """The cases of fused ``op`` on one input: the unfused pairs, then normlab's fused call
    with numba named (both modes) and with no backend named."""
    cases = [Case(op, name, "alloc", shape, dtype, reference=True) for name in FUSED_REFERENCES]
    cases += [Case(op, "numba", mode, shape, dtype) for mode in FUSED_MODES]
    cases.append(Case(op, "auto-torch", "alloc", shape, dtype))
    return [pytest.param(case, id=case.id) for case in cases]


def _peer_cases(op: str, dtype: str, shape: tuple[int, ...]) -> list[Any]:
    """The peers of ``op`` on one input (torch.compile on :data:`COMPILE_SHAPES` only, and on
    every shape of the fused ops)."""
    params = []
    for name in peers.PEERS.get(op, ()):
        if name == "torch_compile" and shape not in COMPILE_SHAPES and op not in FUSED:
            continue
        mode = "out" if name == "ort_iobinding" else "alloc"
        case = Case(op, name, mode, shape, dtype, reference=True)
        why = peers.unavailable(op, name, dtype)
        marks = [] if why is None else [pytest.mark.skip(reason=f"peer {name}: {why}")]
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    matrix = metafunc.config.getoption("--normlab-matrix")
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", matrix_params(matrix))
    elif "dispatch_case" in metafunc.fixturenames:
        usable, skipped = usable_backends()
        backends, more = serving(usable, "layer_norm")
        skipped += more
        paths = [
            pytest.param((b.name, p), id=f"{b.name}-{p}")
            for b in backends
            for p in ("normlab", "direct")
        ]
        metafunc.parametrize("dispatch_case", skipped + paths)
    elif "option_case" in metafunc.fixturenames:
        metafunc.parametrize("option_case", _option_params())
    elif "quantized_case" in metafunc.fixturenames:
        metafunc.parametrize("quantized_case", _quantized_params(matrix))
    elif "memory_case" in metafunc.fixturenames:
        usable, skipped = usable_backends()
        backends, more = serving(usable, "layer_norm")
        skipped += more
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


def _option_params() -> list[Any]:
    """The option rows: (option, contender, rows, cols), skipped without torch."""
    marks = [] if _installed("torch") else [pytest.mark.skip(reason="torch is not installed")]
    return [
        pytest.param(
            (option, contender, rows, cols),
            id=f"{option}-{contender}-{rows}x{cols}",
            marks=marks,
        )
        for rows, cols in options.SHAPES
        for option in options.OPTIONS
        for contender in options.CONTENDERS
    ]


def _quantized_params(matrix: str) -> list[Any]:
    """The quantized rows: (case, contender, rows, cols, dtype), skipped without torch or
    numba (the fused call and the unfused pair's quantizer are numba's); the quick matrix
    without the prefill (its torch eager call takes half a second)."""
    why = None
    if not _installed("torch"):
        why = "torch is not installed"
    elif (numba := refusal(registry.get("numba"))) is not None:
        why = f"need the numba backend: backend 'numba' {numba}"
    marks = [] if why is None else [pytest.mark.skip(reason=why)]
    return [
        pytest.param(
            (case, contender, rows, cols, dtype),
            id=f"{case}-{contender}-{rows}x{cols}-{dtype}",
            marks=marks,
        )
        for rows, cols in quantized.SHAPES
        if matrix == "full" or rows * cols <= QUICK_QUANTIZED_ELEMENTS
        for dtype in quantized.DTYPES
        for case in quantized.CASES
        for contender in quantized.CONTENDERS
    ]


# --------------------------------------------------------------------------------------------
# Inputs, made once per (shape, dtype) and shared by that group's cases.


class Inputs:
    """The :class:`Workload` of the current (shape, dtype); a new one frees the previous one."""

    def __init__(self) -> None:
        self.workload: Workload | None = None

    def get(self, shape: tuple[int, ...], dtype: str) -> Workload:
        held = self.workload
        if held is not None and (held.shape, held.dtype) == (shape, dtype):
            return held
        del held
        self.workload = None  # the previous input is freed before the next one is made
        workload = Workload(shape, dtype)
        self.workload = workload
        return workload


@pytest.fixture(scope="session")
def inputs() -> Inputs:
    return Inputs()


def _call_for(case: Case, data: Workload) -> Callable[[], Any]:
    if case.op is not None and case.subject in peers.PEERS.get(case.op, ()):
        try:
            return peers.call(case.op, case.subject, data)
        except peers.PeerUnavailable as exc:  # a peer that fails to build on this input
            pytest.skip(f"peer {case.subject}: {exc}")
    if case.op in FUSED:
        return fused_call(case.op, case.subject, case.mode, data)
    if case.reference or case.op is None:
        return reference_call(case.op or "layer_norm", case.subject, data)
    if case.subject in AUTO or case.subject in ON_TORCH:
        return auto_call(case.op, case.subject, data)
    return backend_call(case.op, registry.get(case.subject), data, out=case.mode == "out")


def default_backend(op: str, data: Workload) -> str | None:
    """The backend normlab chooses for ``op`` on the NumPy inputs of ``data`` (a forward)."""
    if op not in FORWARDS:
        return None
    bias = data.bias if op == "layer_norm" else None
    plan = spec.plan(op, data.x, weight=data.weight, bias=bias, eps=EPS)
    return dispatch.choose(plan).backend.name


def _probe(call: Callable[[], Any]) -> float:
    """Seconds of one warm call: an untimed warm-up call (imports, JIT, caches), then one more.

    The second call stands even when the warm-up takes :data:`SLOW_CALL_S` or more: that may be
    a compile or a kernel loaded on the way (numba's kernel for a new dtype or layout, first met
    by the fused ops' unfused pair), and taking it for the call's time left such a call three
    rounds. A call that is slow every time costs one more call here.
    """
    _timed(call)
    return _timed(call)


def _timed(call: Callable[[], Any]) -> float:
    """Seconds of one call of ``call``."""
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
    plan = spec.plan("layer_norm", x, weight=w, bias=b)
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


def test_option(
    benchmark: Any,
    option_case: tuple[str, str, int, int],
    matrix: MatrixState,
    request: pytest.FixtureRequest,
) -> None:
    """One contender of an option of real models' norms (``benchmarks/options.py``)."""
    option, contender, rows, cols = option_case
    call = options.cases(rows, cols)[option][contender]
    rounds, iterations = _pace(
        _probe(call), OPTION_SECONDS[matrix.matrix], DISPATCH_ROUND_S, matrix
    )
    benchmark.extra_info.update(
        kind="option", subject=contender, mode=option, shape=[rows, cols], dtype="bfloat16"
    )
    benchmark.pedantic(call, rounds=rounds, iterations=iterations)
    best = benchmark.stats.stats.min
    request.node.user_properties.append(("normlab", f"{best * 1e6:7.2f} µs per call"))


def test_quantized(
    benchmark: Any,
    quantized_case: tuple[str, str, int, int, str],
    matrix: MatrixState,
    request: pytest.FixtureRequest,
) -> None:
    """One contender of a quantized case (``benchmarks/quantized.py``)."""
    case, contender, rows, cols, dtype = quantized_case
    call = quantized.cases(rows, cols, dtype)[case][contender]
    rounds, iterations = _pace(
        _probe(call), QUANTIZED_SECONDS[matrix.matrix], DISPATCH_ROUND_S, matrix
    )
    benchmark.extra_info.update(
        kind="quantized", subject=contender, mode=case, shape=[rows, cols], dtype=dtype
    )
    benchmark.pedantic(call, rounds=rounds, iterations=iterations)
    best = benchmark.stats.stats.min
    request.node.user_properties.append(("normlab", f"{best * 1e6:7.2f} µs per call"))


def test_matrix(
    benchmark: Any, case: Case, inputs: Inputs, matrix: MatrixState, request: pytest.FixtureRequest
) -> None:
    share = matrix.share(case.weight)
    data = inputs.get(case.shape, case.dtype)
    call = _call_for(case, data)
    rounds, iterations = _pace(_probe(call), share, MIN_ROUND_S, matrix)
    nbytes = 2 * data.x.nbytes if case.op is None else moved_bytes(case.op, data, case.mode)
    if case.kind in FORWARDS:
        benchmark.extra_info["default"] = default_backend(case.kind, data) == case.subject
    if case.reference and case.op is not None and case.subject.startswith("ort"):
        benchmark.extra_info["onnx_op"] = peers.onnx_op(case.op, case.dtype)
    benchmark.extra_info.update(
        kind=case.kind,
        op=case.op,
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
