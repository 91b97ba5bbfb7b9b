"""Triton kernels of the mla_ops operators; each module mirrors the torch reference of the same name.

Imported on first use (``mla_ops.ops.backends``), never by ``import mla_ops``: on CPU they run only
under ``TRITON_INTERPRET=1``, which must be set before this package is imported.
"""
