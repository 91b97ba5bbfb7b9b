"""Tests of benchmarks/: its shared library, the scripts at small sizes, the GPU check's dry run (marker ``bench``)."""
