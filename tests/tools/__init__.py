"""What a person runs: the CLI, calibrate, the docs' examples, the benchmark report, deployments
(kernel caches as installed), the import layers, and one verdict per commit (hypothesis profile,
fuzz replay)."""
