"""This folder is its own pytest run: Triton's interpreter must be switched on before any kernel
is defined, so ``TRITON_INTERPRET=1`` is set here, before the test modules import mla_ops.triton.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ helpers
