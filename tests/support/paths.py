"""Where the tests find the repository: its root, the tests folder and the tests' data files,
whatever folder a test module sits in."""

from __future__ import annotations

from pathlib import Path
from typing import Final

#: The repository: the folder holding pyproject.toml, normlab/, benchmarks/ and tests/.
ROOT: Final = Path(__file__).resolve().parents[2]
#: The tests folder (the package ``tests``).
TESTS: Final = ROOT / "tests"
#: The files the tests compare against (a saved benchmark page).
DATA: Final = TESTS / "support" / "data"
