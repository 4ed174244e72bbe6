"""Benchmarks: ``python -m bench.throughput`` for offline throughput against transformers."""
