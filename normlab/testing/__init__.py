"""The conformance suite: every backend, third-party ones included, is held to one contract.

``check(name)`` (the CLI's ``normlab check NAME``) runs the suite against one backend in this
process; within pytest, ``--normlab-backend NAME`` does the same (:mod:`.pytest_plugin`). The
suite drives a backend only through ``normlab.layer_norm(x, ..., backend=NAME)`` — and
``normlab.rms_norm`` when the record lists ``"rms_norm"`` among its ops; those tests are skipped,
with the reason, otherwise — and its record's ``from_numpy``/``to_numpy``, and compares with the
float64 reference (:mod:`normlab.reference`) within the tolerances of :mod:`.tolerances`.

Test modules, one per area: ``test_numerics`` (random calls and the named numerical cases),
``test_rows`` (NaN/Inf confinement, batch independence), ``test_layouts`` (strides, ``out=``,
in place, x untouched, empty inputs), ``test_results`` (result kinds, statistics, repeated
calls), ``test_errors`` (every bad input raises its NormlabError subclass), ``test_fused``
(``normlab.add_layer_norm`` / ``add_rms_norm`` through the backend's own fused function where
the record lists it, else the core's composition around its base op — the report says which:
``h`` bitwise NumPy's ``x + residual``, ``y`` and the statistics of the base op's reference on
that rounded ``h``, return forms, outputs, in-place forms, aliasing refusals), ``test_backward``
(``normlab.layer_norm_backward`` / ``rms_norm_backward`` where the record lists
``"layer_norm_backward"`` / ``"rms_norm_backward"``, skipped with the reason otherwise: finite
differences, the float64 oracle and torch.autograd, large offsets, bitwise repeatability
across runs and thread counts, ``needs``, bad inputs), ``test_parameters`` (offset weights,
parameters of any float dtype, casting orders), ``test_quantize`` (quantized outputs: the
float32 y quantized, bitwise; ties rounded half to even; saturation; ``out=``). Cases live
in :mod:`.cases` (backward ones in :mod:`.backward_cases`, fused ones in
:mod:`.fused_cases`), dtypes, layouts and
conversions of arrays in :mod:`.conversions`, bad inputs and their messages in
:mod:`.bad_inputs`, hypothesis strategies and profiles in :mod:`.strategies`,
tolerances in :mod:`.tolerances`, the backward's float64 oracles in
:mod:`.backward_reference`, and what a backend claims in :mod:`.subject`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

__all__ = ["SUITE", "check"]

#: The folder holding the suite's test modules.
SUITE: Final = Path(__file__).parent


def check(
    backend_name: str,
    *,
    profile: str = "ci",
    allow_unavailable: bool = False,
    arrays: str | None = None,
    json_path: str | Path | None = None,
    extra_pytest_args: Sequence[str] = (),
    plugins: Sequence[object] = (),
) -> int:
    """Run the conformance suite against ``backend_name`` and return pytest's exit code.

    ``profile``: ``"ci"`` (fast, the same cases every run) or ``"full"`` (many more).
    ``allow_unavailable``: a backend unavailable here has its tests skipped with the reason
    (exit 0) instead of stopping the run; a backend that cannot load stops it either way
    (:func:`normlab.testing.preflight.obstacle`, exit 4). ``arrays``: drive the backend with
    arrays of this family, one its record serves beside its own (``check("cupy", arrays="torch")``:
    CUDA torch tensors), instead of its own. ``json_path``: write every test's
    result there as JSON (:mod:`normlab.testing.report`).
    ``extra_pytest_args`` go to pytest as they are (``-k``, ``-x``, ``--normlab-xfail ID``…);
    ``plugins`` are extra pytest plugin objects (say, one that records reports). 0 means every
    test passed or was skipped with its reason.
    """
    import pytest

    import normlab.testing.pytest_plugin as pytest_plugin

    args = [
        str(SUITE),
        f"--normlab-backend={backend_name}",
        f"--normlab-profile={profile}",
        # The plugin object is passed below; its entry point (named "normlab") must not load it
        # a second time under another name.
        "-p",
        "no:normlab",
        # normlab, imported already, is a pytest11 distribution: pytest would like to rewrite it.
        "-W",
        "ignore:Module already imported so cannot be rewritten; normlab:"
        "pytest.PytestAssertRewriteWarning",
        "-p",
        "no:cacheprovider",
        *(["--normlab-allow-unavailable"] if allow_unavailable else []),
        *([f"--normlab-arrays={arrays}"] if arrays is not None else []),
        *([f"--normlab-json={json_path}"] if json_path is not None else []),
        *extra_pytest_args,
    ]
    return int(pytest.main(args, plugins=[pytest_plugin, *plugins]))
