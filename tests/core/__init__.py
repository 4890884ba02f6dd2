"""The core, whatever the backend: the public API and the op table; validation (shapes, axes,
dtypes, errors, aliasing, odd arrays, the range of values, the API fuzzer); the backward ops through
the core; array families; the registry and faulty plugins; dispatch and costs; layouts and routes;
threads, forks, leaks and long rows."""
