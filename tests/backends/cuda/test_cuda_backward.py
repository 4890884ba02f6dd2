"""The CUDA backward kernels without a GPU: the launch planner (kernel choice, 16-byte accesses,
chunk counts and grids that depend on the shape alone), the kernel source against the planner,
and the launches from Python against a fake CuPy whose kernels read and write host memory through
the pointers they are given, by the parameter names of ``kernels/backward.cu``: argument order,
element strides, workspaces, which kernels run for which gradients, the same launches on every
device. Compilation of every backward kernel (no spills, no stack) is in test_cuda_kernels.py,
with the forward's; the kernels' results on a GPU are checked by benchmarks/gpu_check.py."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from normlab import constants, reference, spec
from normlab.backends import cuda_compile, cuda_launch
from normlab.backends.cuda_launch import (
    BACKWARD_OPS,
    MAX_GRID,
    BackwardLaunch,
    Specialisation,
    plan_backward,
    vector_width,
)
from normlab.constants import (
    CUDA_PARTIAL_THREADS,
    CUDA_SUM_COLUMNS,
    CUDA_SUM_LANES,
    FLOAT_DTYPES,
)
from normlab.errors import BackendError
from normlab.ops import FORWARD_OPS, OPS
from normlab.testing.conversions import numpy_dtype
from tests.support import fake_cupy as fake_cupy_module
from tests.support.cuda_source import parameter_names
from tests.support.host_memory import HostArray, host_view

ALIGNED = [0x7F0000000000, 0x7F0000100000, 0x7F0000200000, None]  # dy, x, dx, weight
SOURCE = (cuda_compile.KERNEL_DIR / "backward.cu").read_text()
FORWARD_OP = {f"{op}_backward": op for op in FORWARD_OPS}


KERNELS = {
    ("rows", False): "backward_rows",
    ("rows", True): "backward_loop",
    ("partials", False): "weight_partials",
    ("sum", False): "sum_chunks",
}


# --------------------------------------------------------------------------------------------
# The planner


@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cols", [1, 3, 17, 127, 1000, 4096, 4097, 8192, 8200, 65536])
def test_the_smallest_rung_that_holds_the_row_computes_dx(op: str, dtype: str, cols: int) -> None:
    launch = plan_backward(op, cols, dtype, None, ALIGNED, [cols, cols, cols])
    chosen = launch.rows.specialisation
    rungs = [
        s
        for s in cuda_launch.program_of(chosen)
        if s.stage == "rows" and (s.param_dtype, s.vector) == (dtype, chosen.vector)
    ]
    held = [s for s in rungs if s.capacity is not None and s.capacity >= cols]
    if held:
        assert chosen == min(held, key=lambda s: s.capacity or 0)
    else:
        assert chosen.loop
    assert launch.partials.stage == "partials" and launch.sum.stage == "sum"
    assert {launch.partials, launch.sum} <= set(cuda_launch.program_of(chosen))
    assert launch.partials.vector == chosen.vector


def test_backward_threads_hold_half_the_forward_s_chunks() -> None:
    """d and g are both held: each rung has half the chunks, so rows up to 8192 elements (4096
    float64) stay in registers."""
    for dtype in FLOAT_DTYPES:
        limit = 4096 if dtype == "float64" else 8192
        for op in BACKWARD_OPS:
            assert not plan_backward(
                op, limit, dtype, None, ALIGNED, [limit] * 3
            ).rows.specialisation.loop
            beyond = plan_backward(op, limit + 8, dtype, None, ALIGNED, [limit + 8] * 3)
            assert beyond.rows.specialisation.loop
        forward = max(
            s.items
            for s in cuda_launch.all_specialisations()
            if s.dtype == dtype and s.op in cuda_launch.FORWARD_OPS
        )
        backward = max(
            s.items
            for s in cuda_launch.all_specialisations()
            if s.dtype == dtype and s.op in BACKWARD_OPS
        )
        assert backward * 2 == forward


def test_16_byte_accesses_need_alignment_of_dy_x_dx_and_weight() -> None:
    def vector(cols: int, addresses: list[int | None], strides: list[int]) -> bool:
        launch = plan_backward(
            "layer_norm_backward", cols, "bfloat16", "float32", addresses, strides
        )
        assert launch.partials.vector == launch.rows.specialisation.vector
        return launch.rows.specialisation.vector

    base = 0x7F0000000000
    assert vector(1024, [base, base + 4096, base + 8192, base], [1024, 1024, 1024])
    assert not vector(1020, [base, base, base, None], [1020, 1020, 1020])
    assert not vector(1024, [base + 2, base, base, None], [1024, 1024, 1024])  # dy
    assert not vector(1024, [base, base, base + 2, None], [1024, 1024, 1024])  # dx
    assert not vector(1024, [base, base, base, base + 4], [1024, 1024, 1024])  # weight
    assert not vector(1024, [base, base, base, None], [1024, 1028, 1024])  # x's row stride
    assert vector(1024, [base, base, base, None], [0, -1024, 1024])  # broadcast dy, reversed x


@pytest.mark.parametrize("rows", [1, 31, 32, 33, 64, 65, 1000, 2**40])
def test_chunks_and_grids_depend_on_the_shape_alone(rows: int) -> None:
    assert "device" not in inspect.signature(plan_backward).parameters
    assert "rows" not in inspect.signature(plan_backward).parameters
    assert constants.ROW_CHUNK == 32
    chunks = BackwardLaunch.chunks(rows)
    assert chunks == -(-rows // 32) and (chunks - 1) * 32 < rows <= chunks * 32
    for dtype in FLOAT_DTYPES:
        cols = 1000
        launch = plan_backward("rms_norm_backward", cols, dtype, None, ALIGNED, [cols] * 3)
        tiles = -(-cols // (CUDA_PARTIAL_THREADS * vector_width(dtype)))
        assert launch.partials_grid(rows) == min(chunks * tiles, MAX_GRID)
        assert launch.sum_grid(1) == (-(-cols // CUDA_SUM_COLUMNS), 1)
        assert launch.sum_grid(2) == (-(-cols // CUDA_SUM_COLUMNS), 2)


def test_bad_plans_are_refused() -> None:
    launch = plan_backward("layer_norm_backward", 8, "float32", None, ALIGNED, [8] * 3)
    with pytest.raises(ValueError, match="no launch for empty input"):
        launch.chunks(0)
    with pytest.raises(ValueError, match="1 or 2 gradients"):
        launch.sum_grid(3)
    with pytest.raises(ValueError, match=r"not layer_norm$"):
        plan_backward("layer_norm", 8, "float32", None, ALIGNED, [8] * 3)
    with pytest.raises(ValueError, match="not rms_norm_backward"):
        cuda_launch.plan_launch("rms_norm_backward", 8, "float32", None, ALIGNED, [8])
    with pytest.raises(ValueError, match="do not go with"):
        plan_backward("layer_norm_backward", 8, "float64", "float32", ALIGNED, [8] * 3)
    with pytest.raises(ValueError, match="no launch for empty input"):
        plan_backward("layer_norm_backward", 0, "float32", None, ALIGNED, [0] * 3)


def test_both_backward_ops_share_the_kernel_templates() -> None:
    specs = cuda_launch.all_specialisations()
    layer_norm = [s for s in specs if s.op == "layer_norm_backward"]
    rms_norm = [s for s in specs if s.op == "rms_norm_backward"]
    assert [dataclasses.replace(s, op="rms_norm_backward") for s in layer_norm] == rms_norm
    for ln, rms in zip(layer_norm, rms_norm, strict=True):
        assert ln.expression.replace(", true", ", false", 1) == rms.expression
        assert rms.name == f"rms_{ln.name}" and ln.source == rms.source == "backward.cu"
    assert SOURCE.count("__global__") == 4
    assert {s.stage for s in layer_norm} == set(cuda_launch.STAGES)


def test_the_backward_source_and_the_planner_agree() -> None:
    # The template parameters, in the order the name expressions give them.
    for parameters, kernel in (
        ("typename T, typename P, bool CENTRE, int THREADS, int ITEMS, bool VECTOR", "rows"),
        ("typename T, typename P, bool CENTRE, bool VECTOR", "loop"),
        ("typename T, bool CENTRE, bool VECTOR", "partials"),
        ("typename A", "sum"),
    ):
        assert f"template <{parameters}>\n__global__ void" in SOURCE, kernel
    ln, rms = BACKWARD_OPS
    sample = {
        "rows": Specialisation(ln, "float16", "float32", 64, 2, True),
        "loop": Specialisation(ln, "float16", "float32", 512, 0, True),
        "partials": Specialisation(rms, "float64", "float64", 128, 0, False, "partials"),
        "sum": Specialisation(rms, "bfloat16", "bfloat16", 32, 0, False, "sum"),
    }
    assert sample["rows"].expression == (
        "normlab::backward_rows<normlab::half, float, true, 64, 2, true>"
    )
    assert sample["loop"].expression == "normlab::backward_loop<normlab::half, float, true, true>"
    assert sample["partials"].expression == "normlab::weight_partials<double, false, false>"
    assert sample["sum"].expression == "normlab::sum_chunks<float>"
    assert (
        sample["sum"].block == CUDA_SUM_COLUMNS * CUDA_SUM_LANES and sample["partials"].block == 128
    )


def test_the_kernels_parameters_are_pointers_then_sizes() -> None:
    """Pointers are capitalised, sizes are not (the launch passes uint64 then int64)."""
    for kernel in KERNELS.values():
        names = parameter_names("backward.cu", kernel)
        pointers = [n for n in names if n[0].isupper()]
        assert names[: len(pointers)] == tuple(pointers), kernel
        assert all(n[0].islower() for n in names[len(pointers) :]), kernel


# --------------------------------------------------------------------------------------------
# The launch from Python, against fake kernels that run the backward on host memory in NumPy,
# in the accumulation type and in the kernels' order of the dweight/dbias sums.


@dataclasses.dataclass(frozen=True)
class _Launch:
    kernel: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    sizes: tuple[int, ...]


class _FakeBackwardKernel:
    def __init__(self, spec: Specialisation, launches: list[_Launch]) -> None:
        self.spec = spec
        self.launches = launches

    def __call__(
        self, grid: tuple[int, ...], block: tuple[int], args: tuple[Any, ...], stream: Any = None
    ) -> None:
        names = parameter_names("backward.cu", KERNELS[self.spec.stage, self.spec.loop])
        assert len(args) == len(names)
        for name, value in zip(names, args, strict=True):
            if name == "offset":  # the weight offset, in the accumulation type
                assert isinstance(value, self.acc.type), name
            else:
                assert isinstance(value, np.uint64 if name[0].isupper() else np.int64), name
        self.offset = float(args[names.index("offset")]) if "offset" in names else 0.0
        a = {name: int(value) for name, value in zip(names, args, strict=True) if name != "offset"}
        sizes = tuple(a[n] for n in names if n[0].islower() and n != "offset")
        self.launches.append(_Launch(self.spec.name, tuple(grid), tuple(block), sizes))
        assert block == (self.spec.block,)
        getattr(self, f"_{self.spec.stage}")(a, grid)

    @property
    def acc(self) -> np.dtype[Any]:
        return np.dtype(np.float64 if self.spec.dtype == "float64" else np.float32)

    @property
    def centre(self) -> bool:
        return self.spec.op == "layer_norm_backward"

    def _vector(self, at: int, n: int) -> np.ndarray:
        return host_view(at, 1, n, 0, self.acc)[0]

    def _inputs(self, a: dict[str, int]) -> tuple[np.ndarray, ...]:
        rows, cols, dtype = a["rows"], a["cols"], numpy_dtype(self.spec.dtype)
        dy = host_view(a["DY"], rows, cols, a["dy_row_stride"], dtype).astype(self.acc)
        x = np.zeros_like(dy)
        if a["X"]:
            x = host_view(a["X"], rows, cols, a["x_row_stride"], dtype).astype(self.acc)
        mean = self._vector(a["Mean"], rows) if self.centre else np.zeros(rows, self.acc)
        return dy, x, mean

    def _rows(self, a: dict[str, int], grid: tuple[int, ...]) -> None:
        rows, cols = a["rows"], a["cols"]
        assert grid == (min(-(-rows // self.spec.rows_per_block), MAX_GRID),)
        dy, x, mean = self._inputs(a)
        rstd = self._vector(a["Rstd"], rows)[:, None]
        w = np.ones(cols, self.acc)
        if a["W"]:
            w = host_view(a["W"], 1, cols, 0, numpy_dtype(self.spec.param_dtype))[0]
            if self.offset:  # load_grad_chunks: offset + W in the accumulation type
                w = w.astype(self.acc) + self.acc.type(self.offset)
        d, g, n = x - mean[:, None], dy * w.astype(self.acc), self.acc.type(cols)
        if self.centre:
            res = (d.sum(axis=1, dtype=self.acc) / n)[:, None]
            mean_g = (g.sum(axis=1, dtype=self.acc) / n)[:, None]
            sum_gd = (g * d).sum(axis=1, dtype=self.acc)[:, None]
            mean_gx = rstd * ((sum_gd - res * g.sum(axis=1, dtype=self.acc)[:, None]) / n)
        else:
            assert a["Mean"] == 0 and a["Res"] == 0, "rms_norm has neither mean nor res"
            res = mean_g = np.zeros((rows, 1), self.acc)
            mean_gx = rstd * ((g * d).sum(axis=1, dtype=self.acc)[:, None] / n)
        if a["Res"]:
            self._vector(a["Res"], rows)[...] = res[:, 0]
        if a["DX"]:
            dx = rstd * (g - mean_g - (d - res) * rstd * mean_gx)
            dtype = numpy_dtype(self.spec.dtype)
            host_view(a["DX"], rows, cols, a["dx_row_stride"], dtype)[...] = dx.astype(dtype)

    def _partials(self, a: dict[str, int], grid: tuple[int, ...]) -> None:
        rows, cols = a["rows"], a["cols"]
        chunks = -(-rows // 32)
        tiles = -(-cols // (CUDA_PARTIAL_THREADS * vector_width(self.spec.dtype)))
        assert grid == (min(chunks * tiles, MAX_GRID),)
        dy, x, mean = self._inputs(a)
        if a["WParts"]:
            rstd = self._vector(a["Rstd"], rows)
            res = self._vector(a["Res"], rows) if self.centre else np.zeros(rows, self.acc)
            xhat = ((x - mean[:, None]) - res[:, None]) * rstd[:, None]
        for c in range(chunks):
            sw = np.zeros(cols, self.acc)
            sb = np.zeros(cols, self.acc)
            for r in range(32 * c, min(rows, 32 * c + 32)):  # row order
                if a["WParts"]:
                    sw = (sw + dy[r].astype(np.float64) * xhat[r]).astype(self.acc)  # as fma
                sb += dy[r]
            for at, part in ((a["WParts"], sw), (a["BParts"], sb)):
                if at:
                    host_view(at, chunks, cols, cols, self.acc)[c] = part
        assert self.centre or a["BParts"] == 0, "rms_norm has no dbias"

    def _sum(self, a: dict[str, int], grid: tuple[int, ...]) -> None:
        chunks, cols = a["chunks"], a["cols"]
        assert grid[0] == -(-cols // CUDA_SUM_COLUMNS) and grid[1] in (1, 2)
        for parts_at, out_at in ((a["WParts"], a["DW"]), (a["BParts"], a["DB"]))[: grid[1]]:
            if not parts_at:
                continue
            parts = host_view(parts_at, chunks, cols, cols, self.acc).astype(np.float64)
            lanes = [np.zeros(cols) for _ in range(CUDA_SUM_LANES)]
            for k in range(chunks):
                lanes[k % CUDA_SUM_LANES] += parts[k]
            total = np.zeros(cols)
            for lane in lanes:
                total += lane
            self._vector(out_at, cols)[...] = total.astype(self.acc)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fake ``cupy`` on a device of ``fake_cupy.capability``; every kernel launch is recorded in
    ``fake_cupy.launches``."""
    launches: list[_Launch] = []
    fake = fake_cupy_module.install(monkeypatch, lambda s: _FakeBackwardKernel(s, launches))
    fake.launches = launches
    return fake


def _oracle(
    op: str, dy: np.ndarray, x: np.ndarray, w: np.ndarray | None
) -> tuple[dict[str, np.ndarray], np.ndarray | None, np.ndarray]:
    """Exact gradients in float64 from the forward's statistics as it returns them (rounded to
    the stats dtype), and those statistics as 1-D arrays (mean None for RMSNorm)."""
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    stats = np.float64 if x.dtype == np.float64 else np.float32
    centre = op == "layer_norm_backward"
    if centre:
        _, mean64, rstd64 = reference.layer_norm(x64, eps=1e-5)
    else:
        _, rstd64 = reference.rms_norm(x64, eps=1e-5)
        mean64 = np.zeros_like(rstd64)
    mean, rstd = mean64.astype(stats), rstd64.astype(stats)
    xhat = (x64 - mean) * rstd
    g = dy64 * (1.0 if w is None else w.astype(np.float64))
    mean_g = g.mean(axis=1, keepdims=True) if centre else 0.0
    dx = rstd * (g - mean_g - xhat * (g * xhat).mean(axis=1, keepdims=True))
    grads = {"x": dx, "weight": (dy64 * xhat).sum(axis=0), "bias": dy64.sum(axis=0)}
    return grads, mean[:, 0] if centre else None, rstd[:, 0]


TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5, "float64": 1e-12}


def _check(got: Any, want: np.ndarray, dtype: str, what: str) -> None:
    got = np.asarray(got.a if isinstance(got, HostArray) else got).astype(np.float64)
    scale = np.abs(want).max() + 1e-30
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * scale, err_msg=what)


def _layout(a: np.ndarray, layout: str) -> np.ndarray:
    rows, cols = a.shape
    if layout == "padded":
        wide = np.zeros((rows, cols + 5), a.dtype)
        wide[:, :cols] = a
        return wide[:, :cols]
    if layout == "reversed":
        return np.ascontiguousarray(a[::-1])[::-1]
    return a


def _run(
    cupy_backend: Any,
    op: str,
    dy: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray | None,
    rstd: np.ndarray,
    w: np.ndarray | None,
    needs: frozenset[str],
) -> tuple[Any, ...]:
    name = FORWARD_OP[op]
    base = spec.plan(name, x, weight=w, eps=1e-5)
    plan = dataclasses.replace(
        base, op=op, family="cupy", weight_dtype=None if w is None else w.dtype.name
    )
    fake = [None if a is None else HostArray(a) for a in (dy, x, mean, rstd, w)]
    if op == "rms_norm_backward":
        return tuple(
            cupy_backend.rms_norm_backward(
                fake[0], fake[1], fake[3], fake[4], plan=plan, needs=needs
            )
        )
    return tuple(cupy_backend.layer_norm_backward(*fake, plan=plan, needs=needs))


CASES = [
    (op, dtype, weight)
    for op in BACKWARD_OPS
    for dtype in FLOAT_DTYPES
    for weight in (None, dtype, "float32")
    if weight != "float32" or dtype in ("float16", "bfloat16")
]


@pytest.mark.parametrize("layout", ["c", "padded", "reversed", "broadcast dy"])
@pytest.mark.parametrize(("op", "dtype", "weight"), CASES)
def test_the_backward_launches_give_the_gradients(
    fake_cupy: Any, op: str, dtype: str, weight: str | None, layout: str
) -> None:
    from normlab.backends import cupy_backend

    rows, cols = 70, 24  # three chunks, the last one short
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((rows, cols)) * 2 + 3).astype(numpy_dtype(dtype))
    dy = rng.standard_normal((rows, cols)).astype(numpy_dtype(dtype))
    if layout == "broadcast dy":
        dy = np.broadcast_to(dy[0], (rows, cols))
    w = None if weight is None else (1 + rng.standard_normal(cols)).astype(numpy_dtype(weight))
    want, mean, rstd = _oracle(op, dy, x, w)
    x_in, dy_in = _layout(x, layout), dy if layout == "broadcast dy" else _layout(dy, layout)
    before = (x_in.copy(), dy_in.copy())
    needs = frozenset(OPS[op].gradients)
    got = _run(cupy_backend, op, dy_in, x_in, mean, rstd, w, needs)
    assert got[0].a.dtype == x.dtype and got[0].a.shape == (rows, cols)
    compute = "float64" if dtype == "float64" else "float32"
    assert all(g.a.dtype == compute and g.a.shape == (cols,) for g in got[1:])
    _check(got[0], want["x"], dtype, "dx")
    _check(got[1], want["weight"], compute, "dweight")
    if op == "layer_norm_backward":
        _check(got[2], want["bias"], compute, "dbias")
    assert np.array_equal(x_in, before[0]) and np.array_equal(dy_in, before[1])  # untouched
    prefix = "bwd_" if op == "layer_norm_backward" else "rms_bwd_"
    ran = [launch.kernel.removeprefix(prefix).split("_")[0] for launch in fake_cupy.launches]
    assert ran == ["rows", "partials", "sum"]


NEEDS = [
    ("layer_norm_backward", ("x",), ["rows"]),
    ("layer_norm_backward", ("weight",), ["rows", "partials", "sum"]),  # rows: for res
    ("layer_norm_backward", ("bias",), ["partials", "sum"]),
    ("layer_norm_backward", ("x", "bias"), ["rows", "partials", "sum"]),
    ("rms_norm_backward", ("x",), ["rows"]),
    ("rms_norm_backward", ("weight",), ["partials", "sum"]),
    ("rms_norm_backward", ("x", "weight", "bias"), ["rows", "partials", "sum"]),
]


@pytest.mark.parametrize(("op", "needs", "kernels"), NEEDS)
def test_only_the_kernels_the_gradients_need_run(
    fake_cupy: Any, op: str, needs: tuple[str, ...], kernels: list[str]
) -> None:
    from normlab.backends import cupy_backend

    rows, cols = 33, 10
    rng = np.random.default_rng(9)
    x = rng.standard_normal((rows, cols)).astype(np.float32) + 50  # a large offset
    dy = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    want, mean, rstd = _oracle(op, dy, x, w)
    got = _run(cupy_backend, op, dy, x, mean, rstd, w, frozenset(needs))
    names = OPS[op].gradients
    for name, g in zip(names, got, strict=True):
        if name in needs:
            _check(g, want[name], "float32", name)
        else:
            assert g is None, name
    prefix = "bwd_" if op == "layer_norm_backward" else "rms_bwd_"
    ran = [launch.kernel.removeprefix(prefix).split("_")[0] for launch in fake_cupy.launches]
    assert ran == kernels
    sums = [launch for launch in fake_cupy.launches if "_sum_" in launch.kernel]
    for launch in sums:  # (chunks, cols) of the workspace; dbias is the grid's second row
        assert launch.sizes == (2, cols)
        assert launch.grid[1] == (2 if "bias" in needs and op == "layer_norm_backward" else 1)


@pytest.mark.parametrize("op", BACKWARD_OPS)
def test_long_rows_go_to_the_loop_kernel(fake_cupy: Any, op: str) -> None:
    from normlab.backends import cupy_backend

    rows, cols = 33, 8200  # beyond the largest rung of float32 (8192)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    dy = rng.standard_normal((rows, cols)).astype(np.float32)
    want, mean, rstd = _oracle(op, dy, x, None)
    got = _run(cupy_backend, op, dy, x, mean, rstd, None, frozenset(OPS[op].gradients))
    for name, g in zip(OPS[op].gradients, got, strict=True):
        _check(g, want[name], "float32", name)
    first = fake_cupy.launches[0]
    assert "_loop_f32_" in first.kernel and first.block == (512,) and first.grid == (rows,)


def test_the_launches_do_not_depend_on_the_device(fake_cupy: Any) -> None:
    """The same kernels, grids, blocks and sizes on an sm_80 and an sm_90 device, and the same
    bits of every gradient."""
    from normlab.backends import cupy_backend

    rows, cols = 100, 40
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, cols)).astype(np.float16)
    dy = rng.standard_normal((rows, cols)).astype(np.float16)
    w = rng.standard_normal(cols).astype(np.float32)
    _, mean, rstd = _oracle("layer_norm_backward", dy, x, w)
    results, launches = [], []
    for capability in ("80", "90"):
        fake_cupy.capability = capability
        fake_cupy.launches.clear()
        needs = frozenset(OPS["layer_norm_backward"].gradients)
        got = _run(cupy_backend, "layer_norm_backward", dy, x, mean, rstd, w, needs)
        results.append([g.a.tobytes() for g in got])
        launches.append(list(fake_cupy.launches))
    assert results[0] == results[1]
    assert launches[0] == launches[1]
    chunks = -(-rows // 32)
    assert launches[0][-1].sizes == (chunks, cols)


def test_torch_tensors_are_read_through_their_pointers(
    torch_module: Any, fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU tensors stand in for CUDA tensors: torch allocates dx and the workspaces; pointers and
    row strides come from the tensors (x is a padded view, with its own row stride)."""
    torch = torch_module
    from normlab.backends import cupy_backend

    monkeypatch.setattr(cupy_backend._Torch, "stream", staticmethod(lambda a: None))
    monkeypatch.setattr(cupy_backend._Torch, "device", staticmethod(lambda a: 0))
    rows, cols = 40, 16
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    dy = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    want, mean, rstd = _oracle("layer_norm_backward", dy, x, w)
    plan = dataclasses.replace(
        spec.plan("layer_norm", x, weight=w),
        op="layer_norm_backward",
        family="torch",
    )
    padded = torch.zeros((rows, cols + 3))
    padded[:, :cols] = torch.from_numpy(x)
    dx, dweight, dbias = cupy_backend.layer_norm_backward(
        torch.from_numpy(dy), padded[:, :cols], torch.from_numpy(mean),
        torch.from_numpy(rstd), torch.from_numpy(w),
        plan=plan, needs=frozenset({"x", "weight", "bias"}),
    )  # fmt: skip
    assert all(isinstance(g, torch.Tensor) for g in (dx, dweight, dbias))
    for name, g in zip(("x", "weight", "bias"), (dx, dweight, dbias), strict=True):
        _check(g.numpy(), want[name], "float32", name)


# --------------------------------------------------------------------------------------------
# Autograd: tensors that require grad go through normlab's custom ops, with backend="cupy".


@pytest.fixture
def torch_plan() -> Any:
    torch = pytest.importorskip("torch")
    x = np.zeros((2, 4), np.float32)
    plan = spec.plan("layer_norm", x)
    return torch, dataclasses.replace(plan, family="torch", requires_grad=True)


def test_a_plan_that_requires_grad_never_reaches_the_kernels(
    torch_plan: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend does arithmetic only: tensors that require grad are the core's to route
    (through the custom ops); handed one, it refuses rather than detach, and never calls up."""
    _, plan = torch_plan
    from normlab.backends import cupy_backend

    monkeypatch.setattr(cupy_backend, "_launch", lambda *a: pytest.fail("launched"))
    monkeypatch.setattr(cupy_backend, "_backward", lambda *a: pytest.fail("launched"))
    rms = dataclasses.replace(plan, op="rms_norm")
    needs = frozenset({"x"})
    calls = [
        lambda: cupy_backend.layer_norm("x", "w", "b", plan=plan, out=None),
        lambda: cupy_backend.rms_norm("x", "w", plan=rms, out="y"),
        lambda: cupy_backend.layer_norm_backward("dy", "x", "m", "r", "w", plan=plan, needs=needs),
        lambda: cupy_backend.rms_norm_backward("dy", "x", "r", "w", plan=rms, needs=needs),
    ]
    for call in calls:
        with pytest.raises(BackendError, match="records no autograd graph"):
            call()
    assert "normlab.torch" not in inspect.getsource(cupy_backend)


def test_the_core_runs_cupy_through_the_custom_ops(torch_plan: Any) -> None:
    """For CUDA tensors that require grad the core hands layout the cupy backend wrapped in the
    custom ops (no CUDA device needed to see the routing): no ``out``/``inplace`` (the core
    copies into out, recorded), each op a custom op naming backend "cupy"."""
    _, plan = torch_plan
    from normlab import autograd, dispatch, registry, torch_ops

    cupy = registry.get("cupy")
    choice = dispatch.Choice(cupy, "named with backend=", (), records_no_graph=True)
    wrapped = autograd.through_graph(plan, choice, (), ())
    assert isinstance(wrapped.backend, torch_ops.InGraph) and wrapped.backend.served is cupy
    assert wrapped.backend.name == "cupy" and "row_strided" in wrapped.backend.capabilities
    assert not {"out", "inplace", "autograd"} & wrapped.backend.capabilities
    if cupy.available:
        function = wrapped.backend.function("layer_norm_backward")
        assert function.keywords == {"backend": "cupy"}
    untouched = dataclasses.replace(plan, requires_grad=False)
    assert autograd.through_graph(untouched, choice, (), ()) is choice  # no grad, no trace: direct


# --------------------------------------------------------------------------------------------
# The CLI lists the backward kernels


def test_normlab_kernels_lists_the_backward_kernels(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cuda_cache_root: Path,
    cubins: Callable[[str], list[Any]],
) -> None:
    if cuda_compile.nvrtc_problem() is not None:
        pytest.skip(f"NVRTC is unavailable: {cuda_compile.nvrtc_problem()}")
    from normlab import cli

    cubins("sm_90")  # compiled once for every test that needs them (tests/conftest.py)
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(cuda_cache_root))  # the NVRTC tests' cubins
    monkeypatch.setenv("COLUMNS", "200")  # names unshortened, whatever width the runner set
    assert cli.main(["kernels", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    names = [s.name for s in cuda_launch.all_specialisations() if s.op in BACKWARD_OPS]
    missing = [n for n in names if f" {n} " not in out]
    assert not missing, missing
