"""Triton kernels under TRITON_INTERPRET=1 on CPU: a pytest run of its own (make test)."""
