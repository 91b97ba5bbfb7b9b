"""Tests of mla_ops.serving: PrefillGraphs and CUDA graphs, the paged block cache, generation."""
