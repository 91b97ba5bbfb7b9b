"""This folder is its own pytest run: Triton's interpreter must be switched on before any kernel
is defined, so ``TRITON_INTERPRET=1`` is set here, before the test modules import mla_ops.triton.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
