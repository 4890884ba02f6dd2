"""One commit, one verdict: the tests' hypothesis examples and the gating fuzz run's inputs are
the same on every run (docs/reliability.md, "Same commit, same verdict")."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import pytest
from hypothesis import settings

from tests.support.paths import ROOT

CORPUS = ROOT / "fuzz" / "corpus"


def _replay() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_replay", ROOT / "fuzz" / "replay.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    os.environ.get("NORMLAB_HYPOTHESIS_PROFILE", "ci") != "ci", reason="another profile chosen"
)
def test_hypothesis_draws_the_same_examples_every_run() -> None:
    assert settings.default.derandomize
    assert settings.default.database is None


def test_the_corpus_holds_every_regression_input() -> None:
    names = {p.name for p in CORPUS.iterdir()}
    assert {
        "byte-order-layer-norm-backward-mean",
        "byte-order-rms-norm-backward-rstd",
    } <= names


def test_the_fuzz_search_depends_on_corpus_and_seed_alone() -> None:
    replay = _replay()
    corpus = replay.corpus_inputs([CORPUS])
    runs: list[list[bytes]] = [[], [], []]
    for seen, seed in zip(runs, (7, 7, 8), strict=True):
        count, failing, _ = replay.run(corpus, seed, 500, seen.append)
        assert (count, failing) == (len(corpus) + 500, None)
    assert runs[0] == runs[1]
    assert runs[0][: len(corpus)] == corpus  # the corpus is replayed first, as it is
    assert runs[0] != runs[2]


def test_the_fuzz_search_stops_at_the_first_failing_input() -> None:
    replay = _replay()
    seen: list[bytes] = []

    def one_input(data: bytes) -> None:
        seen.append(data)
        if len(seen) == 3:
            raise ValueError("found")

    count, failing, trace = replay.run([b"a", b"b", b"c", b"d"], 1, 10, one_input)
    assert (count, failing) == (3, b"c")
    assert "ValueError: found" in trace
