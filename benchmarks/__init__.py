"""The benchmark matrix, its report and the side benchmarks (not part of the normlab package).

A package, so that its modules import each other by name (``from benchmarks import peers``) and
import-linter checks those imports against the layers of pyproject.toml. The scripts that import
other modules of it put the repository root on the path when run as files
(``python benchmarks/run.py --quick``).
"""
