"""Shared builders of the tests (not collected: no test_*.py here).

batches         random paged batches, the dense float64 MLA references, model steps
hf_checkpoints  tiny DeepSeek-V2/V3 checkpoints with transformers as the reference
flashmla        a torch stand-in of the flash_mla wheel (dense decoding)
schedules       hypothesis strategies of context/query lengths for the planners
gpu             the GPU tests' skip mark, tolerances and batches at DeepSeek dims
cp_worker       one rank of a context-parallel run (python -m tests.support.cp_worker)
"""

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
