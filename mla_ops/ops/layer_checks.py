"""One layer's attention tensors checked against each other: shapes, dtypes, devices and the dims they imply.

q [T, N, P+R]   kv_c [T, L]   k_pe [T, R]   kv_cache [num_blocks, block_size, L+R]   kv_b_proj_weight [N*(P+V), L]

A step's layer call (``PrefillStep.attend``) and the public sparse op (``sparse_attention``) take the same
tensors, so one function checks them: a bad layer is refused in the same words wherever it enters.
"""

from __future__ import annotations

import torch

from .. import _checks as checks
from .._mla import DS_MLA_LATENT, DS_MLA_ROPE, MLADims
from .cache_formats import latent_width


def check_layer(q, kv_c, k_pe, kv_cache, kv_b_proj_weight, softmax_scale, *, device: torch.device | None = None,
                device_of: str = "", packed: bool = False, v_head_dim=None, out=None) -> MLADims:
    """The dims ``(N, L, P, R, V)`` of one layer's tensors, after checking them (raises naming the argument).

    ``device``: where q must be (named ``device_of`` in messages; None: anywhere), and every other tensor
    with it. ``packed``: ``kv_cache`` is vLLM's ``fp8_ds_mla`` (uint8 rows; L = 512, R = 64).
    N, L and R are read from q, kv_c and k_pe; P and V are not: kv_b_proj_weight's N*(P+V) rows and q's
    P+R fit any split, so a q of the wrong width would be read as another P/V split. ``v_head_dim`` fixes V
    and P+R is then checked against q (``out`` [T, N, V], checked against the V read, catches it too)."""
    checks.check_tensor(q, "q", 3, "[T, N, P+R]", device, device_of)
    if q.dtype not in checks.FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    device = q.device
    checks.check_tensor(kv_c, "kv_c", 2, "[T, L]", device, "q", dtype=q.dtype)
    checks.check_tensor(k_pe, "k_pe", 2, "[T, R]", device, "q", dtype=q.dtype)
    checks.check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]", device, "q")
    checks.check_tensor(kv_b_proj_weight, "kv_b_proj_weight", 2, "[N*(P+V), L]", device, "q", dtype=q.dtype)
    if not packed and kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise TypeError(f"kv_cache must have the dtype of q ({q.dtype}) or float8_e4m3fn, got {kv_cache.dtype}")
    num_tokens, num_heads, qk_dim = q.shape
    latent, rope = kv_c.shape[1], k_pe.shape[1]
    nope = qk_dim - rope
    if nope < 0:
        raise ValueError(f"k_pe width R={rope} exceeds the q head dim P+R={qk_dim}")
    if kv_c.shape[0] != num_tokens or k_pe.shape[0] != num_tokens:
        raise ValueError(f"q, kv_c and k_pe must have one row per new token: q has {num_tokens}, kv_c "
                         f"{kv_c.shape[0]}, k_pe {k_pe.shape[0]}")
    if packed and (latent, rope) != (DS_MLA_LATENT, DS_MLA_ROPE):
        raise ValueError(f"kv_cache_format='fp8_ds_mla' holds L = {DS_MLA_LATENT} and R = {DS_MLA_ROPE}: kv_c must "
                         f"be [T, {DS_MLA_LATENT}] and k_pe [T, {DS_MLA_ROPE}], got widths {latent} and {rope}")
    if latent_width(kv_cache) != latent + rope:
        raise ValueError(f"kv_cache rows must be L+R = {latent}+{rope} = {latent + rope} wide (kv_c and k_pe "
                         f"widths), got {kv_cache.shape[2]}")
    rows, cols = kv_b_proj_weight.shape
    v_head_dim = checks.check_int(v_head_dim, "v_head_dim", 1, optional=True)
    heads = max(num_heads, 1)
    if v_head_dim is not None and cols == latent and rows % heads == 0 and rows // heads - v_head_dim != nope:
        want = rows // heads - v_head_dim
        raise ValueError(f"q must be [T, N, P+R] with P+R = {want}+{rope} = {want + rope} (kv_b_proj_weight "
                         f"[N*(P+V), L] = {list(kv_b_proj_weight.shape)} with N={num_heads}, V={v_head_dim}, and "
                         f"k_pe's R={rope}), got {list(q.shape)}")
    if cols != latent or num_heads == 0 or rows % num_heads or rows // num_heads <= nope:
        raise ValueError(f"kv_b_proj_weight must be [N*(P+V), L] with N={num_heads}, P={nope}, L={latent}, V >= 1, "
                         f"got {list(kv_b_proj_weight.shape)}")
    dims = MLADims(num_heads, latent, nope, rope, rows // num_heads - nope)
    checks.check_softmax_scale(softmax_scale)
    if out is not None:
        checks.check_tensor(out, "out", 3, "[T, N, V]", device, "q", dtype=q.dtype)
        if tuple(out.shape) != (num_tokens, num_heads, dims.value):
            raise ValueError(f"out must be [T, N, V] = {[num_tokens, num_heads, dims.value]} (V = {dims.value}: "
                             f"kv_b_proj_weight's rows / N - P, P = q's last dim - R = {nope}), got {list(out.shape)}")
    return dims
