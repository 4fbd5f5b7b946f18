"""kvrag-bench: the benchmarks of kvrag (answer quality, cache fidelity, TTFT, sweeps, stores, ingest, load).

A separate distribution from the library (``pip install -e benchmarks``); it mounts ``kvrag bench ...`` into the
``kvrag`` console script through the ``kvrag.cli_plugins`` entry point (:func:`kvrag_bench.cli.add_bench_arguments`).
"""
