"""``mla_prefill``: MLA prefill attention with a chunked, paged latent context.

q                 [T, N, P+R]   rotated queries of the new tokens
kv_c              [T, L]        latent rows of the new tokens      k_pe [T, R] (rotated)
kv_cache          [num_blocks, block_size, L+R]   every request's context rows
block_table       [B, max_blocks] int32
query_start_loc   [B+1] int32   context_lens [B] int32
kv_b_proj_weight  [N*(P+V), L]
-> out            [T, N, V]

plan -> per chunk: gather, up-project, attend, fold into the context partial -> causal suffix
attention over the new tokens -> one merge of the two partials.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import backends
from .device_schedule import plan_context_chunks_device
from .merge import lse_dtype
from .schedule import POLICIES, ContextSchedule, plan_context_chunks

BACKENDS = ("auto", "torch", "triton", "flashmla")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)



def _check_tensor(x, name: str, ndim: int, shape_doc: str, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {shape_doc}, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} (the device of q), got {x.device}")


def _check_int32(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")


def _validate(
    q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight,
    softmax_scale, workspace_size, policy, k_scale, backend, split_alignment,
) -> tuple[int, int, int]:
    """Check everything from shapes and arguments; returns ``(P, V, L)``."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor [T, N, P+R], got {type(q).__name__}")
    device = q.device
    _check_tensor(q, "q", 3, "[T, N, P+R]", device)
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    _check_tensor(kv_c, "kv_c", 2, "[T, L]", device)
    _check_tensor(k_pe, "k_pe", 2, "[T, R]", device)
    _check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]", device)
    _check_tensor(block_table, "block_table", 2, "[B, max_blocks]", device)
    _check_tensor(query_start_loc, "query_start_loc", 1, "[B+1]", device)
    _check_tensor(context_lens, "context_lens", 1, "[B]", device)
    _check_tensor(kv_b_proj_weight, "kv_b_proj_weight", 2, "[N*(P+V), L]", device)
    for name, x in (("kv_c", kv_c), ("k_pe", k_pe), ("kv_b_proj_weight", kv_b_proj_weight)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    if kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise TypeError(f"kv_cache must have the dtype of q ({q.dtype}) or float8_e4m3fn, got {kv_cache.dtype}")
    for name, x in (("block_table", block_table), ("query_start_loc", query_start_loc), ("context_lens", context_lens)):
        _check_int32(x, name)

    num_tokens, num_heads, qk_dim = q.shape
    rope_dim = k_pe.shape[1]
    latent_dim = kv_c.shape[1]
    nope_dim = qk_dim - rope_dim
    if nope_dim < 0:
        raise ValueError(f"k_pe width R={rope_dim} exceeds the q head dim P+R={qk_dim}")
    if kv_c.shape[0] != num_tokens or k_pe.shape[0] != num_tokens:
        raise ValueError(
            f"q, kv_c and k_pe must have one row per new token: q has {num_tokens}, kv_c "
            f"{kv_c.shape[0]}, k_pe {k_pe.shape[0]}"
        )
    if kv_cache.shape[2] != latent_dim + rope_dim:
        raise ValueError(
            f"kv_cache rows must be L+R = {latent_dim}+{rope_dim} = {latent_dim + rope_dim} wide "
            f"(kv_c and k_pe widths), got {kv_cache.shape[2]}"
        )
    rows, cols = kv_b_proj_weight.shape
    if cols != latent_dim or rows % num_heads or rows // num_heads <= nope_dim:
        raise ValueError(
            f"kv_b_proj_weight must be [N*(P+V), L] with N={num_heads}, P={nope_dim}, L={latent_dim}, "
            f"V >= 1, got {list(kv_b_proj_weight.shape)}"
        )
    value_dim = rows // num_heads - nope_dim

    batch = context_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc must be [B+1] = [{batch + 1}] for B={batch} context_lens, "
            f"got {list(query_start_loc.shape)}"
        )
    if block_table.shape[0] < batch:
        raise ValueError(f"block_table must have a row per request (B={batch}), got {block_table.shape[0]} rows")

    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not torch.compiler.is_compiling() and not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if isinstance(workspace_size, bool) or not isinstance(workspace_size, int):
        raise TypeError(f"workspace_size must be an int, got {type(workspace_size).__name__}")
    if isinstance(split_alignment, bool) or not isinstance(split_alignment, int) or split_alignment < 1:
        raise ValueError(f"split_alignment must be a positive int, got {split_alignment!r}")
    if workspace_size < split_alignment:
        raise ValueError(
            f"workspace_size must hold at least one split_alignment step ({split_alignment} rows), "
            f"got {workspace_size}"
        )
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    if kv_cache.dtype == torch.float8_e4m3fn and k_scale is None:
        raise ValueError("k_scale is required for a float8_e4m3fn kv_cache (dequantized = stored * k_scale)")
    if isinstance(k_scale, torch.Tensor):
        if k_scale.numel() != 1 or k_scale.dtype != torch.float32:
            raise ValueError(
                f"k_scale must be a float or a one-element float32 tensor, got {k_scale.numel()} "
                f"elements of {k_scale.dtype}"
            )
        if k_scale.device != device:
            raise ValueError(f"k_scale must be on {device} (the device of q), got {k_scale.device}")
    elif k_scale is not None and (isinstance(k_scale, bool) or not isinstance(k_scale, numbers.Real)):
        raise TypeError(f"k_scale must be a float or a one-element float32 tensor, got {type(k_scale).__name__}")
    return nope_dim, value_dim, latent_dim


def _validate_lengths(
    query_start_loc_host: list[int], context_lens_host: list[int], num_tokens: int,
    block_table: torch.Tensor, block_size: int,
) -> None:
    """Checks that need the lengths' values (host copies)."""
    if query_start_loc_host[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {query_start_loc_host[0]}")
    if query_start_loc_host[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc must end at the number of tokens T={num_tokens}, got {query_start_loc_host[-1]}"
        )
    for i, (a, b) in enumerate(zip(query_start_loc_host[:-1], query_start_loc_host[1:])):
        if b < a:
            raise ValueError(f"query_start_loc must be non-decreasing, got {a} then {b} at index {i + 1}")
    for r, c in enumerate(context_lens_host):
        if c < 0:
            raise ValueError(f"context_lens must be non-negative, got {c} for request {r}")
        if -(-c // block_size) > block_table.shape[1]:
            raise ValueError(
                f"block_table row {r} has {block_table.shape[1]} blocks, too short for context "
                f"{c} at block_size {block_size} (needs {-(-c // block_size)})"
            )


def mla_prefill(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    softmax_scale: float,
    workspace_size: int = 65536,
    policy: str = "packed",
    k_scale: float | torch.Tensor | None = None,
    backend: str = "auto",
    *,
    split_alignment: int = 1,
    schedule: ContextSchedule | None = None,
    max_chunks: int | None = None,
) -> torch.Tensor:
    """Attention of each request's new tokens over its cached context and, causally, itself.

    Request r's queries ``q[query_start_loc[r]:query_start_loc[r+1]]`` see its ``context_lens[r]``
    context keys (latent rows ``kv_cache[block_table[r, p // block_size], p % block_size]``,
    up-projected with ``kv_b_proj_weight``) and, causally, the keys of its own new tokens, which
    need not be in ``kv_cache``. Context is processed in chunks of at most ``workspace_size`` rows.
    ``k_scale`` dequantizes a float8_e4m3fn cache (ignored for other cache dtypes).

    Planning, one of three ways:

    * default: ``plan_context_chunks(..., policy=policy, split_alignment=split_alignment)`` on the
      host, which reads ``query_start_loc`` and ``context_lens`` (a sync if they live on a GPU);
    * ``schedule=``: a host plan made once per step and reused in every layer; nothing is read;
    * ``max_chunks=K``: the packed schedule is planned on the device in K fixed slots and the call
      reads no device value on the host: the form for ``torch.compile`` and CUDA graphs (required
      under ``torch.compile``). Tokens of requests whose context does not fit in K chunks come out
      as NaN, never silently wrong; ``plan_context_chunks_device(...).overflow`` tells in advance.
      Only shapes are validated on this path.

    Returns ``[T, N, V]`` in the dtype of q.
    """
    nope_dim, value_dim, latent_dim = _validate(
        q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens, kv_b_proj_weight,
        softmax_scale, workspace_size, policy, k_scale, backend, split_alignment,
    )
    kernels = backends.select(backend, q.device)
    softmax_scale = float(softmax_scale)  # a compile-time constant: kernels take it as a float
    if max_chunks is not None:
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
            raise ValueError(f"max_chunks must be a positive int, got {max_chunks!r}")
        if schedule is not None or policy != "packed" or split_alignment != 1:
            raise ValueError(
                "max_chunks plans the packed schedule (split_alignment=1) on the device: it cannot be "
                "combined with schedule=, another policy or split_alignment"
            )
    elif torch.compiler.is_compiling():
        raise ValueError(
            "mla_prefill under torch.compile needs max_chunks=K (a static capacity): the host planner "
            "would read device values. Pick K per batch bucket, e.g. ceil(max total context / workspace_size)."
        )
    num_tokens, num_heads, _ = q.shape
    rope_dim = k_pe.shape[1]
    if max_chunks is None:
        if schedule is None:
            qsl_host = query_start_loc.tolist()  # a device sync when the lengths live on a GPU
            ctx_host = context_lens.tolist()
            _validate_lengths(qsl_host, ctx_host, num_tokens, block_table, kv_cache.shape[1])
            query_lens = [b - a for a, b in zip(qsl_host[:-1], qsl_host[1:])]
            schedule = plan_context_chunks(
                ctx_host, query_lens, workspace_size, policy=policy, split_alignment=split_alignment
            )
        elif schedule.num_chunks and (
            schedule.chunks[-1].request_end > context_lens.shape[0]
            or schedule.prefill_tokens_with_context > num_tokens
        ):
            raise ValueError(
                f"schedule covers {schedule.chunks[-1].request_end} requests and "
                f"{schedule.prefill_tokens_with_context} tokens, more than this batch's "
                f"{context_lens.shape[0]} requests and {num_tokens} tokens"
            )
    acc = lse_dtype(q.dtype)
    scale = None
    if kv_cache.dtype == torch.float8_e4m3fn:
        scale = k_scale if isinstance(k_scale, torch.Tensor) else torch.tensor([float(k_scale)], device=q.device)

    def heads(kv: torch.Tensor):
        kv = kv.view(-1, num_heads, nope_dim + value_dim)
        return kv.split([nope_dim, value_dim], dim=-1)  # k_nope [S, N, P], v [S, N, V]

    k_nope, v = heads(torch.mm(kv_c, kv_b_proj_weight.t()))
    suffix_out = q.new_empty(num_tokens, num_heads, value_dim)
    suffix_lse = q.new_empty(num_heads, num_tokens, dtype=acc)
    kernels.suffix_attention(q, k_nope, k_pe, v, query_start_loc, softmax_scale, suffix_out, suffix_lse)

    if max_chunks is not None:
        # Every token gets a context partial; chunks past the device count touch nothing.
        plan = plan_context_chunks_device(context_lens, workspace_size, max_chunks)
        context_out = q.new_zeros(num_tokens, num_heads, value_dim)
        context_lse = q.new_full((num_heads, num_tokens), float("-inf"), dtype=acc)
        workspace = q.new_empty(workspace_size, latent_dim + rope_dim)
        kv = q.new_empty(workspace_size, kv_b_proj_weight.shape[0])
        latent, rope = workspace.split([latent_dim, rope_dim], dim=1)
        chunk_k_nope, chunk_v = heads(kv)
        for k in range(max_chunks):
            cu_seq_lens, starts = plan.cu_seq_lens.select(0, k), plan.starts.select(0, k)
            kernels.gather_context(kv_cache, block_table, cu_seq_lens, starts, scale, workspace)
            kernels.up_project(latent, kv_b_proj_weight, cu_seq_lens, kv)
            kernels.context_attention(
                q, chunk_k_nope, rope, chunk_v, query_start_loc, cu_seq_lens, starts, softmax_scale,
                context_out, context_lse,
            )
        out, _ = kernels.merge_attn_states(context_out, context_lse, suffix_out, suffix_lse)
        # Requests whose context runs past chunk K were not fully attended: say so with NaN.
        truncated = (torch.cumsum(context_lens, 0) > max_chunks * workspace_size) & (context_lens > 0)  # [B]
        token = torch.arange(num_tokens, device=q.device, dtype=query_start_loc.dtype)
        request = torch.searchsorted(query_start_loc, token, right=True) - 1  # [T]
        truncated = truncated.index_select(0, request.clamp(0, context_lens.shape[0] - 1))
        return torch.where(truncated.view(-1, 1, 1), torch.full_like(out, float("nan")), out)

    if schedule.num_chunks == 0:
        return suffix_out
    schedule = schedule.to(q.device, non_blocking=True)

    # The context partial of every token up to the last request with context.
    covered = schedule.prefill_tokens_with_context
    context_out = q.new_empty(covered, num_heads, value_dim)
    context_lse = q.new_empty(num_heads, covered, dtype=acc)
    for start, end in schedule.empty_token_ranges:
        if start < covered:
            context_out[start:end].zero_()
            context_lse[:, start:end].fill_(float("-inf"))

    workspace = q.new_empty(max(c.num_context_tokens for c in schedule.chunks), latent_dim + rope_dim)
    for chunk in schedule.chunks:
        rows = workspace.narrow(0, 0, chunk.num_context_tokens)
        kernels.gather_context(
            kv_cache, block_table.narrow(0, chunk.request_start, chunk.num_requests),
            chunk.cu_seq_lens, chunk.starts, scale, rows,
        )
        latent, rope = rows.split([latent_dim, rope_dim], dim=1)
        chunk_k_nope, chunk_v = heads(torch.mm(latent, kv_b_proj_weight.t()))
        tokens = chunk.token_end - chunk.token_start
        kernels.context_attention(
            q.narrow(0, chunk.token_start, tokens), chunk_k_nope, rope, chunk_v,
            chunk.query_start_loc, chunk.cu_seq_lens, chunk.starts, softmax_scale,
            context_out.narrow(0, chunk.token_start, tokens), context_lse.narrow(1, chunk.token_start, tokens),
        )

    merged, _ = kernels.merge_attn_states(
        context_out, context_lse, suffix_out.narrow(0, 0, covered), suffix_lse.narrow(1, 0, covered)
    )
    if covered == num_tokens:
        return merged
    return torch.cat([merged, suffix_out.narrow(0, covered, num_tokens - covered)])
