"""Profiling and A/B scripts, each run as a file (``python benchmarks/kvrag_bench/prof/NAME.py ...``; see its
docstring). They drive the benchmark runner on dev data outside the repository."""
