"""Benchmark scripts, run as ``python -m benchmarks.<name>`` (README.md lists them), and their shared library ``_lib``."""
