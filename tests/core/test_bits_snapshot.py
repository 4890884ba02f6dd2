"""No result changes: every call of the bits grid (tests/support/bits_grid.py: each op, dtype,
option, layout and size on the numpy, numba and torch backends and the default choice on
tensors) gives the bits the committed snapshot holds, where the machine class and the
libraries' versions are those it was made with."""

from __future__ import annotations

import pytest

from tests.support import bits_grid


@pytest.mark.parametrize("subject", bits_grid.SUBJECTS)
def test_every_result_is_the_snapshots(subject: str) -> None:
    why = bits_grid.available(subject)
    if why is not None:
        pytest.skip(why)
    snapshot = bits_grid.load()
    here = bits_grid.machine()
    if snapshot["machine"] != here:
        other = {k: (v, here.get(k)) for k, v in snapshot["machine"].items() if here.get(k) != v}
        pytest.skip(f"the snapshot was made elsewhere (made with, here): {other}")
    want = {k: v for k, v in snapshot["hashes"].items() if k.startswith(f"{subject}-")}
    found = {
        e.id: bits_grid.digest(bits_grid.run(e)) for e in bits_grid.grid() if e.subject == subject
    }
    assert found.keys() == want.keys(), "the grid changed: write the snapshot anew"
    differ = sorted(k for k in found if found[k] != want[k])
    assert not differ, f"{len(differ)} of {len(found)} calls give other bits: {differ[:20]}"
