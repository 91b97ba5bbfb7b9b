"""The FlashMLA adapter: absorbed context attention on FlashMLA's SM90 dense MLA decoding kernel.

q                [T, N, P+R]   rotated queries            kv_cache [num_blocks, 64, 576] bf16/fp16
kv_b_proj_weight [N*(P+V), 512]  block_table [B, max_blocks] int32
query_start_loc  [B+1] int32     context_lens [B] int32
-> out           [T, N, V]     lse [N, T] float32, natural log; rows of requests without context
                               are left untouched (out=): the contract of
                               ``torch.ops.mla_ops.absorbed_context_attention`` (``mla_ops/ops/absorbed.py``)

FlashMLA is the ``sgl-flash-mla`` wheel (import name ``flash_mla``; DESIGN §7). Its 1.0.0 Python
surface (``flash_mla/flash_mla_interface.py``, read from the wheel) reaches SM90 dense decoding
only through ``use_legacy=True``, which routes to the frozen kernel
``torch.ops.flash_mla_legacy.dense_decode_fwd``::

    flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None,
                           indices=None, ..., use_legacy=False, kv_format=None, descale_q=None, descale_k=None)

with q ``[b, s_q, h_q, 576]`` and k_cache ``[num_blocks, 64, 1, 576]`` in one dtype (bfloat16 or
float16), int32 ``block_table [b, max_blocks]`` (stride 1 along blocks) and ``cache_seqlens [b]``,
``head_dim_v = 512``, ``num_splits`` None, ``indices`` None (``is_fp8_kvcache`` then defaults to
False). It returns out ``[b, s_q, h_q, 512]`` and lse ``[b, h_q, s_q]`` float32 (natural log,
``+inf`` for a row with no keys). This module is the only one that imports it (lazily), and it
does all layout and LSE translation:

* fold: ``q_lat = q_nope @ W_UK`` (batched matmul), ``[q_lat | q_pe]`` in the cache dtype;
* pack: FlashMLA takes one query length per call, so every request is padded to a common
  ``s_q = max_query_len``: slot ``(r, j)`` of the ``[B, s_q]`` grid holds token
  ``query_start_loc[r] + j`` when ``j < q_r``, a zero row otherwise (a gather; padding rows are
  computed and dropped). ``b = B`` and ``s_q`` come from shapes and the static argument, never
  from device values, so the shapes are static and the call can be captured in a CUDA graph.
  A caller who knows the query lengths on the host makes one call per group of equal length
  (its own ``max_query_len`` and metadata; ``benchmarks/absorbed_bench.py``), so nothing is padded;
* ``cache_seqlens = context_lens`` (0 for requests without queries or with ``q_r > s_q``);
* unpack: out and LSE of token t from slot ``(r, j)``; ``_lse_to_tokens_first`` turns
  ``[b, N, s_q]`` (``+inf`` empty) into ``[N, T]`` (``-inf`` empty), the one LSE conversion;
* unfold: ``out = o_lat @ W_UV^T``; written, with the LSE, only for tokens of requests with
  context (a device-side ``torch.where``). Those rows saw a key, so a non-finite LSE there (a NaN or inf
  score) makes the row NaN, out and lse.

``max_query_len`` must bound the query length of every request with context; the caller's
routing threshold does (``mla_ops.routing.route_context`` zeroes the context of longer
requests). Its default, T, is always a bound but makes the packed q ``B x T`` rows: pass the
threshold. A request with context and more than ``max_query_len`` queries gets
``cache_seqlens = 0`` and is left untouched (the contract is not checked on device values).

Scheduling metadata: ``get_mla_metadata(*args, **kwargs)`` returns ``(FlashMLASchedMeta(), None)``,
an empty object; the first dense call stores the split scheduler's tensors on it
(``tile_scheduler_metadata`` [num_sm_parts, 8] and ``num_splits`` [b+1], int32) and later calls
pass them back to the kernel unchecked, so one object is valid only for the same b, s_q, h_q and
``cache_seqlens`` values. ``absorbed_context_attention`` creates one per call unless the caller
passes ``metadata`` (made with ``new_metadata()`` where its step schedule is made, and shared by
the layers of that step). No state is kept here.

fp8 caches are refused: FlashMLA's dense fp8 kernel wants ``descale_q`` / ``descale_k`` tensors
and its scheduler filled beforehand by ``get_mla_decoding_metadata(seqlens_k,
num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False, topk=None, use_legacy=False)`` with
``is_fp8_kvcache=True, use_legacy=True``, which this adapter does not drive yet.

The 1.0.0 wheel (``cp310-abi3``, built on torch's stable C ABI) declares ``torch>=2.14.1``; both
of its extensions load under torch 2.11.0+cu130 and register their ops (checked on a CPU machine
with a stub ``libcuda.so.1``; no FlashMLA kernel has run yet). Install it with ``--no-deps``.
"""

from __future__ import annotations

import functools

import torch

from .._mla import MLADims, fold_queries, split_kv_b_proj, token_requests, unfold_outputs

PAGE_SIZE = 64  # FlashMLA's paged cache block size
HEAD_DIM = 576  # L + R of the latent rows (512 + 64)
HEAD_DIM_V = 512  # L
CACHE_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _import_flash_mla():
    """``(module, "")`` or ``(None, reason)``; cached for the process (the installed package)."""
    try:
        import flash_mla
    except Exception as exc:  # ImportError, or OSError from loading its CUDA extension
        return None, f"flash_mla is not importable ({type(exc).__name__}: {exc}); install sgl-flash-mla"
    if not flash_mla.has_legacy():  # the SM90 dense kernel lives in the optional legacy extension
        why = getattr(getattr(flash_mla, "_loader", None), "_LEGACY_UNAVAILABLE", None) or "unknown reason"
        return None, f"flash_mla has no legacy (SM90 dense decoding) kernels: {why}"
    return flash_mla, ""


def _unsupported(q: torch.Tensor | None, kv_cache: torch.Tensor | None) -> tuple[type[Exception], str] | None:
    """Why FlashMLA cannot take these tensors (shapes and dtypes only): ``(error type, reason)``, or None."""
    if kv_cache is not None:
        if kv_cache.dtype == torch.float8_e4m3fn:
            return TypeError, "fp8 kv_cache: the FlashMLA adapter takes bfloat16/float16 caches only"
        if kv_cache.dtype not in CACHE_DTYPES:
            return TypeError, f"kv_cache dtype {kv_cache.dtype}: FlashMLA takes bfloat16 or float16"
        if kv_cache.dim() != 3 or kv_cache.shape[1] != PAGE_SIZE or kv_cache.shape[2] != HEAD_DIM:
            return ValueError, (
                f"kv_cache {tuple(kv_cache.shape)}: FlashMLA needs [num_blocks, {PAGE_SIZE}, {HEAD_DIM}] "
                f"(page size {PAGE_SIZE}, L+R = {HEAD_DIM})"
            )
        if kv_cache.stride(-1) != 1:
            return ValueError, "kv_cache rows must be contiguous (stride 1 along L+R) for FlashMLA"
    if q is not None and kv_cache is not None and q.dtype != kv_cache.dtype:
        return TypeError, f"q ({q.dtype}) and kv_cache ({kv_cache.dtype}) dtypes differ: FlashMLA takes one"
    if q is not None and q.dtype not in CACHE_DTYPES:
        return TypeError, f"q dtype {q.dtype}: FlashMLA takes bfloat16 or float16"
    return None


def available(q: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None) -> tuple[bool, str]:
    """``(True, "")`` when FlashMLA can run here (and on these tensors), else ``(False, reason)``."""
    module, reason = _import_flash_mla()
    if module is None:
        return False, reason
    if not torch.cuda.is_available():
        return False, "FlashMLA needs a CUDA device"
    device = next((t.device for t in (kv_cache, q) if t is not None), torch.device("cuda"))
    if device.type != "cuda":
        return False, f"tensors on {device}: FlashMLA needs CUDA tensors"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return False, f"FlashMLA's dense MLA kernel needs SM90 (H100/H200/H20), this device is SM{major}{minor}"
    problem = _unsupported(q, kv_cache)
    return (True, "") if problem is None else (False, problem[1])


def new_metadata():
    """An empty ``FlashMLASchedMeta``, for the caller to share across one step's layers.

    It is filled by the first call and must only be reused with the same ``B``, ``max_query_len``,
    N and ``context_lens`` values (FlashMLA's dense path does not check them).
    """
    module, reason = _import_flash_mla()
    if module is None:
        raise RuntimeError(reason)
    return module.get_mla_metadata()[0]


def _lse_to_tokens_first(lse: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """FlashMLA's LSE ``[b, N, s_q]`` -> ours ``[N, T]``: token t reads slot ``token_slots[t]``
    (``= r * s_q + j``); FlashMLA's ``+inf`` for a row without keys becomes ``-inf`` (empty)."""
    b, num_heads, s_q = lse.shape
    flat = lse.transpose(0, 1).reshape(num_heads, b * s_q)  # [N, b*s_q], slot = r * s_q + j
    tokens = flat.index_select(1, token_slots)
    return torch.where(tokens == float("inf"), float("-inf"), tokens)


def absorbed_context_attention(
    q, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight, softmax_scale, k_scale, out, lse,
    absorbed_rows=-1, absorbed_token_loc=None, *, max_query_len: int | None = None, metadata=None,
) -> None:
    """The absorbed context partial on FlashMLA (module docstring); ``k_scale`` is unused (no fp8),
    and so are ``absorbed_rows`` and ``absorbed_token_loc`` (FlashMLA's buffers are padded per
    request, see below).

    ``max_query_len``: static bound of the query length of requests with context (default T).
    ``metadata``: from ``new_metadata()``, shared by calls with identical schedules; default: a
    fresh one for this call.
    """
    module, reason = _import_flash_mla()
    if module is None:
        raise RuntimeError(reason)
    problem = _unsupported(q, kv_cache)
    if problem is not None:
        raise problem[0](problem[1])
    num_tokens, num_requests = q.shape[0], context_lens.shape[0]
    num_heads, latent, nope, rope, _ = MLADims.from_shapes(q, kv_cache, kv_b_proj_weight)
    if latent != HEAD_DIM_V:
        raise ValueError(f"kv_b_proj_weight has L = {latent}: FlashMLA needs L = {HEAD_DIM_V}")
    s_q = num_tokens if max_query_len is None else int(max_query_len)
    if s_q < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if num_tokens == 0 or num_heads == 0 or num_requests == 0:
        return

    # Fold, then pack tokens into [B, s_q] slots; slot (r, j) <- token qsl[r] + j, or the zero row T.
    w_uk, w_uv = split_kv_b_proj(kv_b_proj_weight, num_heads, nope)
    q_fold = q.new_zeros(num_tokens + 1, num_heads, latent + rope, dtype=kv_cache.dtype)  # row T: padding
    q_fold[:num_tokens, :, :latent] = fold_queries(q, w_uk, kv_cache.dtype).transpose(0, 1)
    q_fold[:num_tokens, :, latent:] = q[..., nope:]
    starts = query_start_loc[:-1].long()
    query_lens = query_start_loc[1:].long() - starts  # [B]
    j = torch.arange(s_q, device=q.device)
    source = torch.where(j[None, :] < query_lens[:, None], starts[:, None] + j[None, :], num_tokens)  # [B, s_q]
    q_packed = q_fold.index_select(0, source.reshape(-1)).view(num_requests, s_q, num_heads, latent + rope)
    served = (query_lens > 0) & (query_lens <= s_q)  # others: no work for FlashMLA, rows untouched
    cache_seqlens = torch.where(served, context_lens, torch.zeros_like(context_lens)).to(torch.int32)
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()

    if metadata is None:
        metadata = module.get_mla_metadata()[0]
    out_packed, lse_packed = module.flash_mla_with_kvcache(
        q_packed, kv_cache.unsqueeze(2), table, cache_seqlens, HEAD_DIM_V,
        tile_scheduler_metadata=metadata, num_splits=None, softmax_scale=softmax_scale, causal=False,
        is_fp8_kvcache=False, use_legacy=True,
    )  # [B, s_q, N, L], [B, N, s_q]

    # Unpack: token t <- slot request * s_q + position; write tokens of requests with context.
    request, position, valid = token_requests(query_start_loc, num_tokens)
    write = valid & (position < s_q) & (cache_seqlens.long()[request] > 0)  # [T]
    slots = torch.where(write, request * s_q + position, 0)
    o_lat = out_packed.reshape(num_requests * s_q, num_heads, latent).index_select(0, slots)  # [T, N, L]
    new_out = unfold_outputs(o_lat.transpose(0, 1), w_uv).transpose(0, 1)  # [T, N, V]
    new_lse = _lse_to_tokens_first(lse_packed, slots)  # [N, T]
    # A written row saw a key (FlashMLA's +inf means none only where cache_seqlens is 0): a non-finite LSE
    # there is a non-finite score, NaN out and lse, never the empty partial.
    bad = ~torch.isfinite(new_lse)
    new_lse = new_lse.masked_fill(bad, float("nan"))
    new_out = new_out.masked_fill(bad.t().unsqueeze(-1), float("nan"))
    out.copy_(torch.where(write[:, None, None], new_out.to(out.dtype), out))
    lse.copy_(torch.where(write[None, :], new_lse.to(lse.dtype), lse))
