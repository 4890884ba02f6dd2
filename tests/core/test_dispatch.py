"""Choice of backend: ``backend=`` is strict, ``use_backend`` and ``NORMLAB_BACKEND`` are
preferences, then priority; explicit families, autograd, devices; the choice cache.

Most tests rank fake backends of the made-up array library ``fakelib`` (which no built-in
backend serves), so the outcome does not depend on which built-ins are installed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import dispatch, spec
from tests.support.plugins_for_tests import CALLS, FakeArray, record

torch = pytest.importorskip("torch")

Register = Callable[..., ModuleType]
pytestmark = pytest.mark.usefixtures("no_preference")


def _fake(*shape: int, dtype: Any = np.float32) -> FakeArray:
    return FakeArray(np.arange(np.prod(shape), dtype=dtype).reshape(shape))


def _chosen(x: Any, **kwargs: Any) -> str:
    """The backend ``explain`` says the call would use."""
    text = normlab.explain(x, **kwargs)
    match = re.search(r"^  chosen: (\w+) ", text, re.MULTILINE)
    assert match, text
    return match.group(1)


@pytest.fixture
def three(register: Register) -> None:
    """Fake backends ``low`` (5), ``high`` (50) and ``mid`` (30) serving fakelib arrays."""
    register(record("low", priority=5), record("high", priority=50), record("mid", priority=30))


# --------------------------------------------------------------------------------------------
# Priority


@pytest.mark.usefixtures("three")
def test_highest_priority_wins() -> None:
    x = _fake(2, 3)
    assert _chosen(x) == "high"
    text = normlab.explain(x)
    assert "high (priority 50): chosen, highest priority able to serve" in text
    assert "mid (priority 30): able to serve, lower priority" in text
    assert "numpy (priority 10): serves numpy arrays, not fakelib" in text
    y = normlab.layer_norm(x)
    assert isinstance(y, FakeArray) and len(CALLS) == 1


def test_unavailable_backends_are_skipped_with_the_reason(register: Register) -> None:
    register(record("top", priority=90, check=lambda: "no fake device"), record("next"))
    assert _chosen(_fake(2, 3)) == "next"
    assert "top (priority 90): unavailable: no fake device" in normlab.explain(_fake(2, 3))


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("dtypes", frozenset({"float64"}), "serves dtypes float64, not float32"),
        ("devices", frozenset({"cuda"}), "serves devices cuda, not cpu"),
        ("ops", frozenset({"rms_norm"}), "does not provide layer_norm"),
        ("families", frozenset({"jax"}), "serves jax arrays, not fakelib"),
    ],
)
def test_backends_that_cannot_serve_are_passed_over(
    register: Register, field: str, value: frozenset[str], why: str
) -> None:
    register(record("picky", priority=90, **{field: value}), record("plain"))
    assert _chosen(_fake(2, 3)) == "plain"
    assert f"picky (priority 90): {why}" in normlab.explain(_fake(2, 3))


def test_no_backend_for_this_array() -> None:
    with pytest.raises(normlab.BackendError, match="no backend can serve a fakelib array"):
        normlab.layer_norm(_fake(2, 3))
    assert "no choice: no backend can serve" in normlab.explain(_fake(2, 3))


# --------------------------------------------------------------------------------------------
# backend= is strict


@pytest.mark.usefixtures("three")
def test_named_backend_is_used_whatever_its_priority() -> None:
    assert _chosen(_fake(2, 3), backend="low") == "low"
    assert "chosen: low (named with backend=)" in normlab.explain(_fake(2, 3), backend="low")


@pytest.mark.usefixtures("three")
def test_named_backend_that_cannot_serve_is_an_error_not_a_fallback() -> None:
    with pytest.raises(normlab.BackendError, match=r"'numpy' cannot serve.*serves numpy arrays"):
        normlab.layer_norm(_fake(2, 3), backend="numpy")
    assert CALLS == []


def test_named_unavailable_backend_is_an_error(register: Register) -> None:
    register(record("gone", check=lambda: "fakelib driver missing"), record("other"))
    with pytest.raises(normlab.BackendError, match="unavailable: fakelib driver missing"):
        normlab.layer_norm(_fake(2, 3), backend="gone")


@pytest.mark.usefixtures("three")
def test_unknown_backend_lists_the_registered_ones() -> None:
    with pytest.raises(normlab.BackendError) as info:
        normlab.layer_norm(_fake(2, 3), backend="nope")
    for name in ("'nope'", "high", "low", "mid", "numpy", "torch"):
        assert name in str(info.value)


# --------------------------------------------------------------------------------------------
# Preferences: use_backend and NORMLAB_BACKEND


@pytest.mark.usefixtures("three")
def test_use_backend_is_a_preference() -> None:
    x = _fake(2, 3)
    with normlab.use_backend("low"):
        assert dispatch.current_preference() == "low"
        assert _chosen(x) == "low"
        assert "preference: low" in normlab.explain(x)
        assert _chosen(x, backend="mid") == "mid"  # backend= outranks the preference
    assert dispatch.current_preference() is None
    assert _chosen(x) == "high"


@pytest.mark.usefixtures("three")
def test_use_backend_that_cannot_serve_falls_back_to_priority() -> None:
    with normlab.use_backend("numpy"):
        assert _chosen(_fake(2, 3)) == "high"
        text = normlab.explain(_fake(2, 3))
    assert (
        "numpy: preferred but it serves numpy arrays, not fakelib; falling back to priority" in text
    )


def test_use_backend_of_an_unknown_name() -> None:
    with (
        pytest.raises(normlab.BackendError, match="unknown backend 'nope'"),
        normlab.use_backend("nope"),
    ):
        pass  # pragma: no cover


@pytest.mark.usefixtures("three")
def test_use_backend_nests_and_restores() -> None:
    with normlab.use_backend("low"):
        with normlab.use_backend("mid"):
            assert _chosen(_fake(2, 3)) == "mid"
        assert _chosen(_fake(2, 3)) == "low"
        with pytest.raises(RuntimeError), normlab.use_backend("mid"):
            raise RuntimeError
        assert dispatch.current_preference() == "low"


@pytest.mark.usefixtures("three")
def test_environment_preference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NORMLAB_BACKEND", "mid")
    dispatch.clear_caches()
    assert _chosen(_fake(2, 3)) == "mid"
    with normlab.use_backend("low"):
        assert _chosen(_fake(2, 3)) == "low"  # use_backend outranks the environment


@pytest.mark.usefixtures("three")
def test_bad_environment_preference_warns_once_and_is_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NORMLAB_BACKEND", "nope")
    dispatch.clear_caches()
    with pytest.warns(normlab.NormlabWarning, match="NORMLAB_BACKEND='nope'.*high"):
        assert _chosen(_fake(2, 3)) == "high"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normlab.layer_norm(_fake(2, 3))


@pytest.mark.usefixtures("three")
def test_use_backend_is_thread_local() -> None:
    barrier = threading.Barrier(2, timeout=10)
    seen: dict[str, tuple[str | None, str]] = {}

    def work(name: str) -> None:
        with normlab.use_backend(name):
            barrier.wait()  # both threads are inside their own block now
            seen[name] = (dispatch.current_preference(), _chosen(_fake(2, 3)))
            barrier.wait()

    threads = [threading.Thread(target=work, args=(n,)) for n in ("low", "mid")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"low": ("low", "low"), "mid": ("mid", "mid")}
    assert dispatch.current_preference() is None


@pytest.mark.usefixtures("three")
def test_use_backend_is_task_local() -> None:
    async def work(name: str, both_inside: asyncio.Event, count: list[int]) -> tuple[Any, ...]:
        with normlab.use_backend(name):
            count.append(1)
            if len(count) == 2:
                both_inside.set()
            await both_inside.wait()
            return dispatch.current_preference(), _chosen(_fake(2, 3))

    async def main() -> list[tuple[Any, ...]]:
        both_inside, count = asyncio.Event(), []
        with normlab.use_backend("high"):
            results = await asyncio.gather(
                work("low", both_inside, count), work("mid", both_inside, count)
            )
            results.append((dispatch.current_preference(),))
        return results

    assert asyncio.run(main()) == [("low", "low"), ("mid", "mid"), ("high",)]


# --------------------------------------------------------------------------------------------
# Explicit families, autograd, devices


def test_explicit_families_only_when_named(register: Register) -> None:
    register(
        record(
            "zero_copy",
            families=frozenset({"numpy"}),
            priority=100,
            explicit_families=frozenset({"fakelib"}),
        ),
        record("native"),
    )
    x = _fake(2, 3)
    assert _chosen(x) == "native"
    assert "it serves fakelib arrays only when named with backend='zero_copy'" in normlab.explain(x)
    assert _chosen(x, backend="zero_copy") == "zero_copy"
    with normlab.use_backend("zero_copy"):
        assert _chosen(x) == "zero_copy"


def test_tensors_requiring_grad_go_only_to_autograd_backends(register: Register) -> None:
    register(record("fast_torch", families=frozenset({"torch"}), priority=100))
    plain = torch.ones(2, 3)
    grad = torch.ones(2, 3, requires_grad=True)
    assert _chosen(plain) == "fast_torch"
    assert _chosen(grad) == "torch"
    assert "fast_torch (priority 100): does not support autograd" in normlab.explain(grad)
    with pytest.raises(normlab.BackendError, match=r"fast_torch.*autograd"):
        normlab.layer_norm(grad, backend="fast_torch")
    with pytest.raises(normlab.BackendError, match="numpy"):
        normlab.layer_norm(grad, backend="numpy")
    assert normlab.layer_norm(grad).requires_grad


def test_autograd_backend_may_serve_tensors_requiring_grad(register: Register) -> None:
    register(
        record(
            "grad_torch",
            families=frozenset({"torch"}),
            priority=100,
            capabilities=frozenset({"autograd"}),
        )
    )
    assert _chosen(torch.ones(2, 3, requires_grad=True)) == "grad_torch"


def test_a_weight_requiring_grad_needs_an_autograd_backend(register: Register) -> None:
    register(record("fast_torch", families=frozenset({"torch"}), priority=100))
    assert _chosen(torch.ones(2, 3), weight=torch.ones(3, requires_grad=True)) == "torch"


def test_no_implicit_device_moves() -> None:
    x = torch.ones(2, 3, device="meta")
    with pytest.raises(normlab.BackendError, match="serves devices cpu, cuda, not meta"):
        normlab.layer_norm(x, backend="torch")
    with pytest.raises(normlab.BackendError, match=r"no backend can serve.*on meta"):
        normlab.layer_norm(x)


# --------------------------------------------------------------------------------------------
# Choice cache


@pytest.fixture
def decisions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Each call of ``dispatch._decide`` (a choice not found in the cache)."""
    calls: list[tuple[Any, ...]] = []
    decide = dispatch._decide

    def counting(*args: Any) -> Any:
        calls.append(args)
        return decide(*args)

    monkeypatch.setattr(dispatch, "_decide", counting)
    dispatch.clear_caches()
    return calls


@pytest.mark.usefixtures("three")
def test_choices_are_cached_by_metadata(decisions: list[tuple[Any, ...]]) -> None:
    normlab.layer_norm(_fake(2, 3))
    normlab.layer_norm(_fake(2, 3))
    normlab.layer_norm(_fake(500, 3))  # other rows: same family, device, dtype, row length
    assert len(decisions) == 1
    normlab.layer_norm(_fake(2, 7))  # another row length: chosen again
    assert len(decisions) == 2
    normlab.layer_norm(_fake(2, 3, dtype=np.float64))
    normlab.layer_norm(_fake(2, 3), backend="low")
    with normlab.use_backend("mid"):
        normlab.layer_norm(_fake(2, 3))
    assert len(decisions) == 5
    dispatch.clear_caches()
    normlab.layer_norm(_fake(2, 3))
    assert len(decisions) == 6


def test_registering_a_plugin_invalidates_cached_choices(
    register: Register, decisions: list[tuple[Any, ...]]
) -> None:
    register(record("first", priority=1))
    assert _chosen(_fake(2, 3)) == "first"
    second = register(record("second", priority=2))
    assert _chosen(_fake(2, 3)) == "second"
    normlab.unregister_plugin(second)
    assert _chosen(_fake(2, 3)) == "first"
    assert len(decisions) == 3


@pytest.mark.usefixtures("three")
def test_plans_are_cached_by_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    validations: list[int] = []
    validate = spec.validate
    monkeypatch.setattr(spec, "validate", lambda *a: validations.append(1) or validate(*a))
    spec.clear_cache()
    x = _fake(2, 3)
    for _ in range(3):
        normlab.layer_norm(x, eps=0.5)
    normlab.layer_norm(np.zeros((2, 3), np.float32), eps=0.5, backend="numpy")
    normlab.layer_norm(x, eps=0.25)
    assert len(validations) == 3


@pytest.mark.usefixtures("three")
def test_dispatch_logs_its_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="normlab.dispatch"):
        normlab.layer_norm(_fake(2, 3))
    assert "high (priority 50): chosen" in caplog.text


@pytest.mark.usefixtures("three")
def test_explain_states_batch_invariance(register: Register) -> None:
    """explain() says the choice holds for any number of rows and whether the chosen backend
    promises a row the same bits in any batch (its record's batch_invariant)."""
    text = normlab.explain(_fake(2, 3))
    assert "rows: the same choice for any number of rows of this op, dtype and row length" in text
    assert "gives a row the same bits in any batch (batch invariant)" in text
    assert "rows: named, so every batch goes to it" in normlab.explain(_fake(2, 3), backend="low")
    register(record("loose", priority=99, batch_invariant=False))
    assert "loose declares batch_invariant=False" in normlab.explain(_fake(2, 3))
