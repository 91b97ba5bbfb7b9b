"""Running steps: the bucketing and padding contract (``buckets``), the CUDA-graph / compiled step
runner (``graphs``), the paged-cache block manager (``paged_cache``), the block bookkeeping of a
step batch (``scheduler``), greedy generation (``generation``, its token arguments checked in
``prompts``) and ``python -m mla_ops generate`` (``cli``)."""

from .generation import Generator, generate
from .graphs import PrefillGraphs

__all__ = ["Generator", "PrefillGraphs", "generate"]
