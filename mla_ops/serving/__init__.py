"""Running steps: the bucketing and padding contract (``buckets``), the CUDA-graph / compiled step
runner (``graphs``), the paged-cache block manager and greedy generation."""

from .generation import Generator, generate
from .graphs import PrefillGraphs

__all__ = ["Generator", "PrefillGraphs", "generate"]
