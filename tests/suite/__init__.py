"""The conformance suite itself (normlab.testing): it passes on every built-in backend, it has
teeth (every mutant fails it), and its conversions between array families."""
