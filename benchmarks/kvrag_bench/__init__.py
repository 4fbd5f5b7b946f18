"""Benchmarks: answer-quality and cache-fidelity metrics, runners and plots."""
