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
from typing import NamedTuple

import torch

from . import backends
from .device_schedule import plan_context_chunks_device
from .validation import check_k_scale, check_tensor
from .merge import lse_dtype
from .routing import default_absorb_max_query_len, route_context
from .schedule import POLICIES, ContextSchedule, plan_context_chunks

BACKENDS = ("auto", "torch", "triton", "flashmla")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
    check_tensor(q, "q", 3, "[T, N, P+R]", device, "q")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    check_tensor(kv_c, "kv_c", 2, "[T, L]", device, "q")
    check_tensor(k_pe, "k_pe", 2, "[T, R]", device, "q")
    check_tensor(kv_cache, "kv_cache", 3, "[num_blocks, block_size, L+R]", device, "q")
    check_tensor(block_table, "block_table", 2, "[B, max_blocks]", device, "q")
    check_tensor(query_start_loc, "query_start_loc", 1, "[B+1]", device, "q")
    check_tensor(context_lens, "context_lens", 1, "[B]", device, "q")
    check_tensor(kv_b_proj_weight, "kv_b_proj_weight", 2, "[N*(P+V), L]", device, "q")
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

    check_k_scale(k_scale, kv_cache, device)
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
    absorb_max_query_len: int | None = None,
) -> torch.Tensor:
    """Attention of each request's new tokens over its cached context and, causally, itself.

    Request r's queries ``q[query_start_loc[r]:query_start_loc[r+1]]`` see its ``context_lens[r]``
    context keys (latent rows ``kv_cache[block_table[r, p // block_size], p % block_size]``,
    up-projected with ``kv_b_proj_weight``) and, causally, the keys of its own new tokens, which
    need not be in ``kv_cache``. ``k_scale`` dequantizes a float8_e4m3fn cache (ignored for other
    cache dtypes).

    Each request's context takes one of two paths: requests with at most ``absorb_max_query_len``
    new tokens attend over the latent cache directly (absorbed / MQA: no gather, no workspace);
    the others go through chunks of at most ``workspace_size`` gathered, up-projected rows.
    ``0`` disables the absorbed path; the default is ``mla_ops.routing``'s break-even point
    (none when a ``schedule=`` is given: it already says what the chunked path covers; plan it
    over ``route_context(...)[0]`` and pass ``absorb_max_query_len`` to route with one).

    Planning of the chunked path, one of three ways:

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
    rope_dim = k_pe.shape[1]
    if absorb_max_query_len is None:
        absorb_max_query_len = 0 if schedule is not None else default_absorb_max_query_len(
            latent_dim, nope_dim, rope_dim, value_dim
        )
    elif isinstance(absorb_max_query_len, bool) or not isinstance(absorb_max_query_len, int) or absorb_max_query_len < 0:
        raise ValueError(f"absorb_max_query_len must be an int >= 0 (0 disables), got {absorb_max_query_len!r}")
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
    num_tokens = q.shape[0]
    if max_chunks is None and schedule is None:
        qsl_host = query_start_loc.tolist()  # a device sync when the lengths live on a GPU
        ctx_host = context_lens.tolist()
        _validate_lengths(qsl_host, ctx_host, num_tokens, block_table, kv_cache.shape[1])
        query_lens = [b - a for a, b in zip(qsl_host[:-1], qsl_host[1:])]
        mha_lens, absorbed_lens = route_context(ctx_host, query_lens, absorb_max_query_len)
        schedule = plan_context_chunks(mha_lens, query_lens, workspace_size, policy=policy,
                                       split_alignment=split_alignment)
        if not absorbed_lens.any():
            absorb_max_query_len = 0  # nothing to absorb in this batch: skip the op
    elif schedule is not None and schedule.num_chunks and (
        schedule.chunks[-1].request_end > context_lens.shape[0] or schedule.prefill_tokens_with_context > num_tokens
    ):
        raise ValueError(
            f"schedule covers {schedule.chunks[-1].request_end} requests and "
            f"{schedule.prefill_tokens_with_context} tokens, more than this batch's "
            f"{context_lens.shape[0]} requests and {num_tokens} tokens"
        )

    kernels = backends.select(backend, q.device, absorb_max_query_len)
    softmax_scale = float(softmax_scale)  # a compile-time constant: kernels take it as a float
    dims = _Dims(q.shape[1], latent_dim, nope_dim, rope_dim, value_dim)
    if kv_cache.dtype == torch.float8_e4m3fn and not isinstance(k_scale, torch.Tensor):
        k_scale = torch.tensor([float(k_scale)], device=q.device)
    elif kv_cache.dtype != torch.float8_e4m3fn:
        k_scale = None

    # Suffix partial: every token over its own request's new keys, causally.
    k_nope, v = dims.heads(torch.mm(kv_c, kv_b_proj_weight.t()))
    suffix_out = q.new_empty(num_tokens, dims.heads_n, value_dim)
    suffix_lse = q.new_empty(dims.heads_n, num_tokens, dtype=lse_dtype(q.dtype))
    kernels.suffix_attention(q, k_nope, k_pe, v, query_start_loc, softmax_scale, suffix_out, suffix_lse)

    # Context partial: absorbed requests, then the chunked ones; each path writes only its requests.
    mha_context_lens, absorbed_context_lens = context_lens, None
    if absorb_max_query_len:
        mha_context_lens, absorbed_context_lens = route_context(
            context_lens, query_start_loc[1:] - query_start_loc[:-1], absorb_max_query_len
        )
    args = (kernels, dims, q, kv_cache, block_table, query_start_loc, kv_b_proj_weight, softmax_scale, k_scale)
    if max_chunks is not None:
        return _prefill_device_plan(*args, mha_context_lens, absorbed_context_lens, workspace_size, max_chunks,
                                    suffix_out, suffix_lse)
    return _prefill_host_plan(*args, absorbed_context_lens, schedule, suffix_out, suffix_lse)


class _Dims(NamedTuple):
    heads_n: int
    latent: int
    nope: int
    rope: int
    value: int

    def heads(self, kv: torch.Tensor):
        """[S, N*(P+V)] up-projected rows -> k_nope [S, N, P], v [S, N, V] (views)."""
        return kv.view(-1, self.heads_n, self.nope + self.value).split([self.nope, self.value], dim=-1)


def _prefill_device_plan(kernels, dims, q, kv_cache, block_table, query_start_loc, weight, softmax_scale, k_scale,
                         mha_context_lens, absorbed_context_lens, workspace_size, max_chunks, suffix_out, suffix_lse):
    """K static chunk steps over the device plan; no host read of a device value."""
    num_tokens = q.shape[0]
    context_out = torch.zeros_like(suffix_out)
    context_lse = torch.full_like(suffix_lse, float("-inf"))
    if absorbed_context_lens is not None:
        kernels.absorbed_context_attention(q, kv_cache, block_table, query_start_loc, absorbed_context_lens, weight,
                                           softmax_scale, k_scale, context_out, context_lse)
    plan = plan_context_chunks_device(mha_context_lens, workspace_size, max_chunks)
    workspace = q.new_empty(workspace_size, dims.latent + dims.rope)
    kv = q.new_empty(workspace_size, weight.shape[0])
    latent, rope = workspace.split([dims.latent, dims.rope], dim=1)
    chunk_k_nope, chunk_v = dims.heads(kv)
    for k in range(max_chunks):  # chunks past the device count touch nothing
        cu_seq_lens, starts = plan.cu_seq_lens.select(0, k), plan.starts.select(0, k)
        kernels.gather_context(kv_cache, block_table, cu_seq_lens, starts, k_scale, workspace)
        kernels.up_project(latent, weight, cu_seq_lens, kv)
        kernels.context_attention(q, chunk_k_nope, rope, chunk_v, query_start_loc, cu_seq_lens, starts,
                                  softmax_scale, context_out, context_lse)
    out, _ = kernels.merge_attn_states(context_out, context_lse, suffix_out, suffix_lse)
    # Requests whose chunked context runs past chunk K were not fully attended: say so with NaN.
    truncated = (torch.cumsum(mha_context_lens, 0) > max_chunks * workspace_size) & (mha_context_lens > 0)  # [B]
    token = torch.arange(num_tokens, device=q.device, dtype=query_start_loc.dtype)
    request = torch.searchsorted(query_start_loc, token, right=True) - 1  # [T]
    truncated = truncated.index_select(0, request.clamp(0, mha_context_lens.shape[0] - 1))
    return torch.where(truncated.view(-1, 1, 1), torch.full_like(out, float("nan")), out)


def _prefill_host_plan(kernels, dims, q, kv_cache, block_table, query_start_loc, weight, softmax_scale, k_scale,
                       absorbed_context_lens, schedule, suffix_out, suffix_lse):
    """The host schedule's chunks, each over its own requests only."""
    num_tokens = q.shape[0]
    if absorbed_context_lens is not None:  # any token may get an absorbed partial
        covered = num_tokens
        context_out = torch.zeros_like(suffix_out)
        context_lse = torch.full_like(suffix_lse, float("-inf"))
        kernels.absorbed_context_attention(q, kv_cache, block_table, query_start_loc, absorbed_context_lens, weight,
                                           softmax_scale, k_scale, context_out, context_lse)
    elif schedule.num_chunks == 0:
        return suffix_out
    else:  # the context partial of every token up to the last request with context
        covered = schedule.prefill_tokens_with_context
        context_out = suffix_out.new_empty(covered, *suffix_out.shape[1:])
        context_lse = suffix_lse.new_empty(suffix_lse.shape[0], covered)
        for start, end in schedule.empty_token_ranges:
            if start < covered:
                context_out[start:end].zero_()
                context_lse[:, start:end].fill_(float("-inf"))

    if schedule.num_chunks:
        schedule = schedule.to(q.device, non_blocking=True)
        workspace = q.new_empty(max(c.num_context_tokens for c in schedule.chunks), dims.latent + dims.rope)
    for chunk in schedule.chunks:
        rows = workspace.narrow(0, 0, chunk.num_context_tokens)
        kernels.gather_context(kv_cache, block_table.narrow(0, chunk.request_start, chunk.num_requests),
                               chunk.cu_seq_lens, chunk.starts, k_scale, rows)
        latent, rope = rows.split([dims.latent, dims.rope], dim=1)
        chunk_k_nope, chunk_v = dims.heads(torch.mm(latent, weight.t()))  # the host knows the live rows
        tokens = chunk.token_end - chunk.token_start
        kernels.context_attention(
            q.narrow(0, chunk.token_start, tokens), chunk_k_nope, rope, chunk_v, chunk.query_start_loc,
            chunk.cu_seq_lens, chunk.starts, softmax_scale,
            context_out.narrow(0, chunk.token_start, tokens), context_lse.narrow(1, chunk.token_start, tokens),
        )

    merged, _ = kernels.merge_attn_states(
        context_out, context_lse, suffix_out.narrow(0, 0, covered), suffix_lse.narrow(1, 0, covered)
    )
    if covered == num_tokens:
        return merged
    return torch.cat([merged, suffix_out.narrow(0, covered, num_tokens - covered)])
