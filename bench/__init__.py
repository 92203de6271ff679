"""The benchmarks (`make bench`); run from the repository root, e.g. `python -m bench.compare`."""
