"""What the tests share that is not a fixture (those are in ``tests/conftest.py``): fake and
faulty plugins, the suite's mutants, the fuzzers' model and strategies, helpers of the numba
tests, the transformer models, and data files (``data/``)."""
