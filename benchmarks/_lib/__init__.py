"""The benchmarks' shared library (one module per concern; scripts import what they use).

cli      common argparse flags (--json --plot --device --reps --smoke --long --dry-run) and their parsing
timing   every timer: CUDA events, wall time, CUDA-graph replay, back-to-back steps, interleaved samples
report   kill-safe JSON: ``Report`` (rewritten after every row) and ``write_json_atomic``
plot     matplotlib on the Agg backend and a save helper
batches  DeepSeek dims from ``mla_ops.MLAConfig`` presets, paged batches and model-step inputs
pipeline the chunked context pipeline (gather, up-project, attend) that the GPU benchmarks time
costs    modeled FLOPs and bytes (DESIGN §1 cost model)
trace    the Mooncake trace and the prefix-caching, chunked-prefill scheduler model that replays it
"""
