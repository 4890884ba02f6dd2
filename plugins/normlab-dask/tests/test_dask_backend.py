"""Tests of the dask backend on a real ``dask.distributed`` cluster of two worker processes."""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import normlab
import numpy as np
import pytest
from dask.array.utils import meta_from_array
from distributed import Client, LocalCluster, get_task_stream
from normlab import arrays, reference, testing
from normlab.testing.conversions import numpy_dtype
from normlab.testing.tolerances import assert_close, conditioning

import normlab_dask
from normlab_dask import backend
from normlab_dask.arrays import DaskInspector

#: (shape, chunks, call arguments): split columns, whole rows, Keras-style axes, several
#: normalized axes, and batch axes chunked after the leading one (Dask's reshape rechunks them).
CASES = (
    ((64, 40), (16, 15), {}),
    ((64, 40), (16, 40), {}),
    ((6, 8, 10), (3, 4, 5), {"axis": (0, 2)}),
    ((4, 6, 10), (1, 3, 5), {"normalized_shape": (6, 10)}),
    ((4, 6, 10), (2, 3, 10), {}),
)
DTYPES = ("float16", "bfloat16", "float32", "float64")


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    """Two worker processes with one thread each on 127.0.0.1; the default scheduler while the
    module's tests run, so every ``compute`` goes through it."""
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as c,
    ):
        yield c


def _layer_norm_inputs(
    shape: tuple[int, ...], chunks: tuple[int, ...], dtype: str, call: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, da.Array, da.Array, da.Array]:
    rng = np.random.default_rng(0)
    x = (5.0 + 3.0 * rng.standard_normal(shape)).astype(numpy_dtype(dtype))
    axes = reference.normalized_axes(len(shape), call.get("normalized_shape"), call.get("axis"))
    param_shape = tuple(shape[a] for a in axes)
    param_dtype = np.float32 if dtype in ("float16", "bfloat16") else x.dtype
    w = (1.0 + 0.1 * rng.standard_normal(param_shape)).astype(param_dtype)
    b = (0.1 * rng.standard_normal(param_shape)).astype(param_dtype)
    param_chunks = tuple(chunks[a] for a in axes)
    return (
        x,
        w,
        b,
        da.from_array(x, chunks=chunks),
        da.from_array(w, chunks=param_chunks),
        da.from_array(b, chunks=param_chunks),
    )


def _tasks_per_layer(stream: list[dict[str, Any]]) -> Counter[str]:
    """How many tasks of each layer (key name without its token) ran, from a task stream."""
    names = [
        entry["key"][0] if isinstance(entry["key"], tuple) else entry["key"] for entry in stream
    ]
    return Counter(str(name).rsplit("-", 1)[0] for name in names)


def test_registered_by_its_distribution() -> None:
    (dask_backend,) = [b for b in normlab.list_backends() if b.name == "dask"]
    assert dask_backend.provided_by.startswith("normlab-dask ")
    assert dask_backend.available, dask_backend.reason


def test_normlab_reads_dask_arrays_with_the_plugins_inspector() -> None:
    """The record supplies the inspector (normlab's built-in one is a fallback for older
    versions of this plugin): dtype, shape, the chunks' device, no strides, immutable."""
    x = da.from_array(np.arange(12.0, dtype=np.float32).reshape(3, 4), chunks=(2, 2))
    assert type(arrays.inspector(type(x))) is DaskInspector
    info = arrays.info(x)
    assert (info.family, info.dtype, info.shape, info.device) == ("dask", "float32", (3, 4), "cpu")
    assert info.strides is None and not info.writeable
    np.testing.assert_array_equal(arrays.permute(x, (1, 0)).compute(), x.compute().T)


def test_unavailable_without_dask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record's check says why, without importing Dask (here: as if it were missing)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "dask" else real(name, *a),
    )
    assert normlab_dask.RECORD.check is not None
    assert normlab_dask.RECORD.check() == "dask is not installed"


def test_conformance_suite() -> None:
    """``normlab check dask``, on Dask's threaded scheduler: the suite computes thousands of
    small graphs, each a round trip to a cluster (the tests below run on the cluster)."""
    with dask.config.set(scheduler="threads"):
        assert testing.check("dask") == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "chunks", "call"), CASES, ids=lambda v: str(v))
def test_layer_norm_matches_reference(
    client: Client,
    dtype: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    call: dict[str, Any],
) -> None:
    x, w, b, dx, dw, db = _layer_norm_inputs(shape, chunks, dtype, call)
    y, mean, rstd = dask.compute(
        *normlab.layer_norm(dx, weight=dw, bias=db, return_stats=True, **call)
    )
    want_y, want_mean, want_rstd = reference.layer_norm(x, weight=w, bias=b, **call)
    cond = conditioning(want_mean, want_rstd)
    cols = x.size // want_mean.size
    assert y.dtype == x.dtype and mean.dtype == rstd.dtype == (
        np.float64 if dtype == "float64" else np.float32
    )
    assert_close(y, want_y, dtype, cond, what="y", cols=cols)
    assert_close(mean, want_mean, dtype, cond, what="mean", cols=cols, scale=1 / want_rstd)
    assert_close(rstd, want_rstd, dtype, cond, what="rstd", cols=cols, scale=want_rstd)


@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
@pytest.mark.parametrize(("shape", "chunks", "call"), CASES, ids=lambda v: str(v))
def test_rms_norm_matches_reference(
    client: Client,
    dtype: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    call: dict[str, Any],
) -> None:
    x, w, _, dx, dw, _ = _layer_norm_inputs(shape, chunks, dtype, call)
    y, rstd = dask.compute(*normlab.rms_norm(dx, weight=dw, return_stats=True, **call))
    want_y, want_rstd = reference.rms_norm(x, weight=w, **call)
    ones = np.ones_like(want_rstd)
    cols = x.size // want_rstd.size
    assert_close(y, want_y, dtype, ones, what="y", cols=cols)
    assert_close(rstd, want_rstd, dtype, ones, what="rstd", cols=cols, scale=want_rstd)


def test_each_chunk_is_normalized_once(client: Client) -> None:
    """y, mean and rstd come from one graph: computed together, one normlab task runs per row
    chunk (the parts picked from it are fused into later layers), on both workers, and no task
    runs twice."""
    x = da.random.default_rng(1).standard_normal((4096, 96), chunks=(256, 32))
    y, mean, rstd = normlab.layer_norm(x, return_stats=True)
    with get_task_stream(client) as stream:
        dask.compute(y, mean, rstd)
    assert _tasks_per_layer(stream.data)["normlab-layer_norm"] == x.numblocks[0] == 16
    keys = [str(entry["key"]) for entry in stream.data]
    assert len(keys) == len(set(keys)), "a task ran twice"
    assert len({entry["worker"] for entry in stream.data}) == 2


def test_lazy_result_keeps_batch_chunks() -> None:
    """Nothing is computed; batch chunks are kept; split normalized axes become one chunk."""
    x = da.ones((8, 6, 10), chunks=(2, 6, 5), dtype=np.float32)
    y, mean, rstd = normlab.layer_norm(x, normalized_shape=(10,), return_stats=True)
    assert isinstance(y, da.Array) and isinstance(mean, da.Array) and isinstance(rstd, da.Array)
    assert y.chunks == ((2, 2, 2, 2), (6,), (10,))
    assert mean.chunks == rstd.chunks == ((2, 2, 2, 2), (6,), (1,))
    assert type(meta_from_array(y)) is np.ndarray
    assert y.dtype == np.float32 and mean.dtype == np.float32
    layers = list(y.dask.layers)
    assert sum(name.startswith("rechunk") for name in layers) == 1  # the normalized axis only


def test_whole_rows_are_not_rechunked() -> None:
    x = da.ones((64, 40), chunks=(16, 40))
    y = normlab.layer_norm(x)
    assert y.chunks == x.chunks
    assert not any(name.startswith("rechunk") for name in y.dask.layers)


def test_explain_lines() -> None:
    x = da.ones((8, 6, 10), chunks=(2, 3, 5))
    plan = normlab.spec.plan("layer_norm", x)
    lines = backend.explain(x, plan=plan).splitlines()
    assert "split into 2 chunks; they are rechunked" in lines[0]
    assert "Dask rechunk them" in lines[1]  # batch axes (0, 1) chunked after the leading one
    whole = da.ones((8, 6, 10), chunks=(2, 6, 10))
    lines = backend.explain(whole, plan=plan).splitlines()
    assert "no rechunk" in lines[0] and "4 normlab task(s)" in lines[1]


def test_explain_shows_the_rechunk() -> None:
    x = da.ones((8, 6, 10), chunks=(2, 6, 5))
    assert "rechunked so that each row is whole" in normlab.explain(x)


def test_converters_split_every_axis() -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    d = backend.from_numpy(a)
    assert d.numblocks == (2, 2)
    back = backend.to_numpy(d)
    back[0, 0] = -1  # a copy: neither the Dask array nor the source changes
    assert a[0, 0] == 0 and backend.to_numpy(d)[0, 0] == 0
