"""Every bad input raises the right NormlabError subclass with a message naming the problem,
and leaves the caller's arrays untouched."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import spec
from normlab.registry import Backend
from normlab.testing.bad_inputs import BAD_INPUTS, Inputs, bad_inputs_of
from normlab.testing.cases import OPS
from normlab.testing.subject import Subject

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(1)


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (normlab.ShapeError, ValueError),
        (normlab.ArgumentError, ValueError),
        (normlab.DtypeError, TypeError),
        (normlab.DeviceError, ValueError),
        (normlab.BackendError, LookupError),
        (normlab.ArgumentTypeError, TypeError),
        (normlab.ArgumentTypeError, ValueError),  # an ArgumentError: except clauses still catch
    ],
)
def test_error_classes(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, normlab.NormlabError)
    assert issubclass(error, builtin)
    assert issubclass(normlab.NormlabError, Exception)
    assert issubclass(normlab.NormlabWarning, UserWarning)


def _x(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize(("op", "bad"), [(op, bad.name) for op in OPS for bad in bad_inputs_of(op)])
def test_bad_input(lib: Backend, op: str, bad: str) -> None:
    """The table of bad inputs (normlab.testing.bad_inputs), through automatic dispatch: each
    raises its error with a message matching the table's pattern, and modifies no argument."""
    inputs = Inputs(Subject.of(lib.name))
    entry = BAD_INPUTS[bad]
    arguments = {"x": inputs.array(), **entry.arguments(inputs)}
    arrays = {k: v for k, v in arguments.items() if isinstance(v, (np.ndarray, torch.Tensor))}
    before = {k: lib.to_numpy(v).tobytes() for k, v in arrays.items()}
    with pytest.raises(entry.error, match=entry.pattern(inputs)):
        getattr(normlab, op)(**arguments)
    assert {k: lib.to_numpy(v).tobytes() for k, v in arrays.items()} == before


def test_backend_names_that_are_not_strings() -> None:
    x = np.ones((2, 3), np.float32)
    for name in (["numpy"], {"numpy": 1}, 3):
        with pytest.raises(normlab.BackendError, match="unknown backend"):
            normlab.layer_norm(x, backend=name)
        assert "unknown backend" in normlab.explain(x, backend=name)


@pytest.mark.parametrize(
    "x", [[[1.0, 2.0]], 1.5, None, "x", (1.0, 2.0)], ids=["list", "float", "None", "str", "tuple"]
)
def test_x_not_an_array(x: Any) -> None:
    with pytest.raises(normlab.ArgumentError, match="x must be an array"):
        normlab.layer_norm(x)


@pytest.mark.parametrize(
    "x", [np.float32(1.0), np.array(1.0), torch.tensor(1.0)], ids=["numpy-scalar", "numpy", "torch"]
)
def test_scalar_x(x: Any) -> None:
    with pytest.raises(normlab.ShapeError, match="0-d"):
        normlab.layer_norm(x)


def test_masked_x_and_parameters() -> None:
    x = np.ma.masked_array(_x(2, 3), mask=[[0, 1, 0], [0, 0, 0]])
    with pytest.raises(normlab.DtypeError, match="masked"):
        normlab.layer_norm(x)
    with pytest.raises(normlab.DtypeError, match="masked"):
        normlab.layer_norm(x.data, weight=np.ma.masked_array(_x(3)))


def test_long_double_x() -> None:
    with pytest.raises(normlab.DtypeError, match="floating-point arrays only"):
        normlab.layer_norm(np.ones((2, 3), np.longdouble))


def test_parameter_from_another_library() -> None:
    with pytest.raises(normlab.DeviceError, match=r"weight is a torch\.Tensor but x is a numpy"):
        normlab.layer_norm(_x(2, 4), weight=torch.ones(4))
    with pytest.raises(normlab.DeviceError, match=r"bias is a numpy\.ndarray but x is a torch"):
        normlab.layer_norm(torch.ones(2, 4), bias=np.ones(4, np.float32))


def test_parameter_on_another_device() -> None:
    x = torch.ones(2, 4)
    with pytest.raises(normlab.DeviceError, match="weight is on device meta but x is on cpu"):
        normlab.layer_norm(x, weight=torch.ones(4, device="meta"))


def test_out_from_another_library_or_device() -> None:
    with pytest.raises(normlab.DeviceError, match="torch"):
        normlab.layer_norm(_x(2, 4), out=torch.zeros(2, 4))
    with pytest.raises(normlab.DeviceError, match="meta"):
        normlab.layer_norm(torch.ones(2, 4), out=torch.zeros(2, 4, device="meta"))


def test_out_read_only() -> None:
    out = np.zeros((2, 4), np.float32)
    out.flags.writeable = False
    with pytest.raises(normlab.ArgumentError, match="read-only"):
        normlab.layer_norm(_x(2, 4), out=out)


@pytest.mark.parametrize(
    "out",
    [
        np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), (2, 4), (0, 4), writeable=True),
        torch.zeros(4).expand(2, 4),
    ],
    ids=["numpy", "torch"],
)
def test_out_broadcast(out: Any) -> None:
    x = _x(2, 4) if isinstance(out, np.ndarray) else torch.ones(2, 4)
    with pytest.raises(normlab.ArgumentError, match="zero stride"):
        normlab.layer_norm(x, out=out)


def test_out_with_x_or_out_requiring_grad() -> None:
    with pytest.raises(normlab.ArgumentError, match="requires grad"):
        normlab.layer_norm(torch.ones(2, 4, requires_grad=True), out=torch.zeros(2, 4))
    with pytest.raises(normlab.ArgumentError, match="requires grad"):
        normlab.layer_norm(torch.ones(2, 4), out=torch.zeros(2, 4, requires_grad=True))


def test_explicit_backend_of_another_family_never_converts() -> None:
    with pytest.raises(normlab.BackendError, match="serves numpy arrays, not torch"):
        normlab.layer_norm(torch.ones(2, 4), backend="numpy")
    with pytest.raises(normlab.BackendError, match="serves torch arrays, not numpy"):
        normlab.layer_norm(_x(2, 4), backend="torch")


def test_unknown_op_for_explain() -> None:
    with pytest.raises(normlab.ArgumentError, match="unknown op 'group_norm'"):
        normlab.explain(_x(2, 4), op="group_norm")


def test_partial_overlap_of_out_and_x(lib: Backend) -> None:
    buffer = lib.from_numpy(_x(5, 4))
    before = lib.to_numpy(buffer).tobytes()
    with pytest.raises(normlab.ArgumentError, match=r"out \(y\) shares memory with x"):
        normlab.layer_norm(buffer[:4], out=buffer[1:])
    assert lib.to_numpy(buffer).tobytes() == before


def test_overlap_of_reversed_x_and_out() -> None:
    x = _x(4, 3)
    with pytest.raises(normlab.ArgumentError, match=r"out \(y\) shares memory with x"):
        normlab.layer_norm(x, out=x[::-1])


def test_interleaved_out_and_x_do_not_overlap() -> None:
    buffer = _x(3, 8)
    x, out = buffer[:, ::2], buffer[:, 1::2]
    expected = normlab.layer_norm(x.copy())
    normlab.layer_norm(x, out=out)
    np.testing.assert_array_equal(out, expected)


def test_error_paths_modify_nothing(lib: Backend) -> None:
    buffer, w, b = (lib.from_numpy(a) for a in (_x(5, 4), _x(4), _x(4)))
    x = buffer[:4]
    before = [lib.to_numpy(a).tobytes() for a in (buffer, w, b)]
    bad_calls = [
        lambda: normlab.layer_norm(x, (3,), w, b),
        lambda: normlab.layer_norm(x, weight=w, bias=b, eps=float("nan")),
        lambda: normlab.layer_norm(x, weight=w, bias=b, backend="no_such_backend"),
        lambda: normlab.layer_norm(x, weight=w, bias=b, out=lib.from_numpy(_x(4, 4, dtype=bool))),
        lambda: normlab.layer_norm(x, weight=w, bias=b, out=buffer[1:]),
    ]
    for call in bad_calls:
        with pytest.raises(normlab.NormlabError):
            call()
    assert [lib.to_numpy(a).tobytes() for a in (buffer, w, b)] == before


# The plan cache keys on values that compare equal across types (1 == True, 4 == 4.0): a cached
# valid call must not let an invalid one through.
@pytest.mark.parametrize(
    ("good", "bad", "error"),
    [
        ({"eps": 1}, {"eps": True}, normlab.ArgumentError),
        ({"return_stats": True}, {"return_stats": 1}, normlab.ArgumentError),
        ({"normalized_shape": 1}, {"normalized_shape": True}, normlab.ArgumentError),
        ({"normalized_shape": (4,)}, {"normalized_shape": (4.0,)}, normlab.ArgumentError),
        ({"axis": 1}, {"axis": 1.0}, normlab.ArgumentError),
    ],
)
def test_cached_valid_call_does_not_admit_an_equal_invalid_one(
    good: dict[str, Any], bad: dict[str, Any], error: type[Exception]
) -> None:
    x = _x(3, 4) if "axis" in good or good.get("normalized_shape") != 1 else _x(4, 1)
    spec.clear_cache()
    normlab.layer_norm(x, **good)
    with pytest.raises(error):
        normlab.layer_norm(x, **bad)


def test_messages_are_the_same_on_cached_and_fresh_calls() -> None:
    x = _x(2, 3)
    messages = []
    for _ in range(2):
        with pytest.raises(normlab.ShapeError) as info:
            normlab.layer_norm(x, (4,))
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert re.search(r"\(4,\).*\(2, 3\)", messages[0])


# --------------------------------------------------------------------------------------------
# Messages that say what to do


@pytest.mark.parametrize(
    "eps",
    [
        np.array(1e-3),
        np.array([1e-3]),
        torch.tensor(1e-3, dtype=torch.float64),
        torch.tensor([1e-3]),
    ],
    ids=["numpy-0d", "numpy-1", "torch-0d", "torch-1"],
)
def test_eps_as_a_one_element_host_array_is_a_number(eps: Any) -> None:
    x = _x(3, 8)
    expected = normlab.layer_norm(x, eps=float(eps.item()))
    np.testing.assert_array_equal(normlab.layer_norm(x, eps=eps), expected)
    np.testing.assert_array_equal(normlab.rms_norm(x, eps=eps), normlab.rms_norm(x, eps=1e-3))


def test_eps_array_is_converted_before_the_plan_cache_keys_on_it() -> None:
    x = _x(3, 8)
    spec.clear_cache()
    eps = np.array(1e-3)
    normlab.layer_norm(x, eps=eps)
    eps[...] = 0.5  # the same array object, a new value: a cache keyed on the object would miss it
    np.testing.assert_array_equal(normlab.layer_norm(x, eps=eps), normlab.layer_norm(x, eps=0.5))
    parts = [part for key in spec._cache for entry in key for part in _flat(entry)]
    assert parts and not any(isinstance(part, np.ndarray) for part in parts)


def _flat(entry: Any) -> list[Any]:
    """A cache key's entry with its nested tuples flattened."""
    if isinstance(entry, tuple):
        return [part for item in entry for part in _flat(item)]
    return [entry]


@pytest.mark.parametrize(
    ("eps", "pattern"),
    [
        (torch.tensor(1e-3, requires_grad=True), r"requires grad.*eps\.item\(\)"),
        (np.array([1e-3, 1e-3]), r"shape \(2,\).*one number"),
        (torch.tensor(True), "eps must be a real number"),
        (np.array(-1.0), "eps must be finite and >= 0"),
    ],
    ids=["requires-grad", "two-elements", "bool", "negative"],
)
def test_eps_array_that_is_not_a_number_is_refused(eps: Any, pattern: str) -> None:
    with pytest.raises(normlab.ArgumentError, match=pattern):
        normlab.layer_norm(_x(3, 8), eps=eps)


def test_eps_on_a_device_is_refused_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from normlab import arrays

    eps = torch.tensor(1e-3)
    on_gpu = arrays.ArrayInfo("torch", "torch.Tensor", "float32", (), (), 4, "cuda:0", "cuda")
    monkeypatch.setattr(
        arrays, "info", lambda a: on_gpu if a is eps else arrays.inspector(type(a)).info(a)
    )
    with pytest.raises(normlab.ArgumentError, match=r"eps is an array on cuda:0.*eps\.item\(\)"):
        normlab.layer_norm(_x(3, 8), eps=eps)


class _FakePandas:
    """Stands for a pandas object (checked by module name, so pandas need not be installed)."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data
        self.shape = data.shape

    def to_numpy(self) -> np.ndarray:
        return self._data


class Series(_FakePandas):
    dtype = np.dtype(np.float32)


class DataFrame(_FakePandas):
    dtypes = (np.dtype(np.float32),)  # a DataFrame has no single dtype


Series.__module__ = "pandas.core.series"
DataFrame.__module__ = "pandas.core.frame"


@pytest.mark.parametrize("table", [Series, DataFrame])
@pytest.mark.parametrize("role", ["x", "weight"])
def test_pandas_objects_are_refused_with_to_numpy(table: type[_FakePandas], role: str) -> None:
    x = _x(3, 4)
    data = table(x if role == "x" else x[0])
    args = {"x": x, "weight": None, role: data}
    with pytest.raises(
        normlab.DtypeError,
        match=rf"{role} is a pandas {table.__name__}.*"
        rf"`{role}\.to_numpy\(\)`",
    ):
        normlab.layer_norm(args["x"], weight=args["weight"])


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_np_matrix_is_refused_with_asarray() -> None:
    m = np.matrix(_x(3, 4))
    with pytest.raises(normlab.DtypeError, match=r"np\.matrix.*np\.asarray\(x\)"):
        normlab.layer_norm(m)


def test_memmap_gives_a_plain_ndarray(tmp_path: Any) -> None:
    data = _x(3, 4)
    m = np.memmap(tmp_path / "x.bin", dtype=np.float32, shape=(3, 4), mode="w+")
    m[:] = data
    y = normlab.layer_norm(m)
    assert type(y) is np.ndarray
    np.testing.assert_array_equal(y, normlab.layer_norm(data))


def test_misspelt_backend_suggests_the_closest_name() -> None:
    with pytest.raises(
        normlab.BackendError, match=r"unknown backend 'numab'.*did you mean 'numba'\?"
    ):
        normlab.layer_norm(_x(2, 3), backend="numab")
    with pytest.raises(normlab.BackendError, match="did you mean 'numpy'"):
        normlab.use_backend("nunpy").__enter__()
    with pytest.raises(normlab.BackendError) as info:
        normlab.layer_norm(_x(2, 3), backend="zzzzzz")
    assert "did you mean" not in str(info.value)


def test_named_unavailable_backend_says_why_first(register: Any) -> None:
    from tests.support.plugins_for_tests import FakeArray, record

    register(record("gpuonly", devices=frozenset({"cuda"}), check=lambda: "no GPU driver"))
    with pytest.raises(normlab.BackendError) as info:
        normlab.layer_norm(_x(2, 3), backend="gpuonly")
    message = str(info.value)
    assert re.search(
        r"it is unavailable: no GPU driver; besides, it serves fakelib arrays", message
    )
    register(
        record(
            "zerocopy",
            families=frozenset({"numpy"}),
            explicit_families=frozenset({"fakelib"}),
            check=lambda: "no driver",
        )
    )
    with pytest.raises(normlab.BackendError) as info:
        normlab.layer_norm(FakeArray(_x(2, 3)), backend="zerocopy")
    assert str(info.value).endswith("it is unavailable: no driver")  # named: fakelib is served


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested and CSR tensors are torch betas
def test_nested_and_sparse_tensors_get_a_layout_error() -> None:
    assert issubclass(normlab.LayoutError, normlab.DtypeError)
    nested = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)])
    with pytest.raises(normlab.LayoutError, match=r"nested tensor.*x\.unbind\(\)"):
        normlab.layer_norm(nested)
    with pytest.raises(normlab.LayoutError, match=r"sparse_coo.*x\.to_dense\(\)"):
        normlab.layer_norm(torch.ones(2, 4).to_sparse())
    with pytest.raises(normlab.LayoutError, match=r"sparse_csr.*x\.to_dense\(\)"):
        normlab.layer_norm(torch.ones(2, 4).to_sparse_csr())


@pytest.mark.parametrize(
    ("kwargs", "wrong_type"),
    [
        ({"axis": {"axis": -1}}, True),
        ({"normalized_shape": "a"}, True),
        ({"return_stats": "yes"}, True),
        ({"eps": [1e-5]}, True),
        ({"eps": -1.0}, False),
        ({"axis": 5}, False),
    ],
)
def test_a_wrongly_typed_argument_is_a_type_error(kwargs: dict[str, Any], wrong_type: bool) -> None:
    """As NumPy and Keras: a wrongly typed argument raises a NormlabError that is a TypeError,
    a wrong value of the right type one that is a ValueError only."""
    with pytest.raises(normlab.NormlabError) as raised:
        normlab.layer_norm(_x(2, 4), **kwargs)
    assert isinstance(raised.value, TypeError) is wrong_type
    assert isinstance(raised.value, ValueError)
