"""torch.compile of chunked-context prefill: one graph per capacity bucket, fused merge and planner.

Every test session runs with a fresh Inductor cache directory (tests/conftest.py).
"""

import dataclasses
import logging
from collections import Counter
import math
import os
import re
import subprocess
import sys
import textwrap
import unittest

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch._inductor.utils import get_first_incompatible_cudagraph_node, run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import mla_ops
from mla_ops.models.regions import NESTED_REGIONS, WRITES_IN_REGIONS
from tests.support import REPO_ROOT
from tests.support.batches import BUCKET_4, cache_list, clone_caches, make_batch, model_step, normal_caches

try:
    import expecttest
except ImportError:  # not on the GPU machine: only the pinned-graph tests need it
    expecttest = None

mla_ops.enable()

# Small DeepSeek-like dims for the function-level tests; the model tests use the "tiny" preset.
HEADS, LATENT, NOPE, ROPE, VALUE = 2, 12, 6, 4, 5
WORKSPACE = 16


def prefill_inputs(context_lens, query_lens, seed=0, block_size=4):
    b = make_batch(context_lens, query_lens, seed=seed, block_size=block_size, N=HEADS, L=LATENT, P=NOPE, R=ROPE,
                   V=VALUE, dtype=torch.float32, garbage_blocks=40 - sum(-(-c // block_size) for c in context_lens),
                   pad_cols=20 - max(-(-c // block_size) for c in context_lens))
    args = (b.q, b.kv_c, b.k_pe, b.kv_cache, b.block_table, b.query_start_loc, b.context_lens)
    # What a runner keeps fixed: model widths and the cache/block-table buffers. Only tokens (T)
    # and requests (B) vary, so they are the only dynamic dims.
    for t, dims in zip(args, [(1, 2), (1,), (1,), (0, 1, 2), (1,), (), ()]):
        for d in dims:
            torch._dynamo.mark_static(t, d)
    return args


WEIGHT = torch.randn(HEADS * (NOPE + VALUE), LATENT, generator=torch.Generator().manual_seed(7)) / 3
torch._dynamo.mark_static(WEIGHT)  # a parameter in a real model


def make_prefill_step(max_chunks, absorb_max_query_len=3):
    """One prefill; requests with at most 3 new tokens take the absorbed path, the rest chunks."""
    def prefill_step(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens):
        return mla_ops.mla_prefill(q, kv_c, k_pe, kv_cache, block_table, query_start_loc, context_lens,
                                   WEIGHT, 0.25, workspace_size=WORKSPACE, max_chunks=max_chunks,
                                   absorb_max_query_len=absorb_max_query_len)
    return prefill_step


def cache_entries(fn):
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


def test_one_graph_per_bucket_and_no_recompiles_within_it():
    torch._dynamo.reset()
    step = make_prefill_step(max_chunks=4)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for i, (context_lens, query_lens) in enumerate(BUCKET_4):
        args = prefill_inputs(context_lens, query_lens, seed=i)
        stance = "fail_on_recompile" if i else "default"
        with torch.compiler.set_stance(stance):
            out = compiled(*args)
        torch.testing.assert_close(out, step(*args), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, mla_ops.mla_prefill(*args[:7], WEIGHT, 0.25, workspace_size=WORKSPACE),
                                   rtol=1e-5, atol=1e-5)
    assert cache_entries(step) == 1
    # A second bucket is a second graph; going back to the first reuses it.
    compiled_2 = torch.compile(make_prefill_step(max_chunks=2), fullgraph=True, dynamic=True)
    args = prefill_inputs([10, 0, 12], [2, 3, 2])
    torch.testing.assert_close(compiled_2(*args), step(*args), rtol=1e-5, atol=1e-5)
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled(*prefill_inputs(*BUCKET_4[3]))


def test_compile_without_max_chunks_says_what_to_do():
    """Our message, as a ValueError's first line, not Dynamo's "Observed exception" (``fullgraph=True``)."""
    def step(*args):
        return mla_ops.mla_prefill(*args, WEIGHT, 0.25, workspace_size=WORKSPACE)

    torch._dynamo.reset()
    with pytest.raises(ValueError) as error:
        torch.compile(step, fullgraph=True, backend="eager")(*prefill_inputs([3, 4], [2, 2]))
    assert str(error.value).startswith("plan_prefill under torch.compile needs max_chunks=K"), str(error.value)


@pytest.mark.parametrize("scale", [math.nan, math.inf])
def test_a_softmax_scale_that_is_not_finite_is_refused_in_compiled_code_too(scale):
    """The scale is a host float: checking it costs nothing while tracing, as in eager."""
    def step(*args):
        return mla_ops.mla_prefill(*args, WEIGHT, scale, workspace_size=WORKSPACE, max_chunks=4)

    with pytest.raises(Exception, match="softmax_scale must be finite"):
        torch.compile(step, fullgraph=True)(*prefill_inputs([3, 4], [2, 2]))


def test_generated_code_fuses_merge_and_planner_and_reuses_buffers():
    torch._dynamo.reset()
    compiled = torch.compile(make_prefill_step(max_chunks=3), fullgraph=True, dynamic=True)
    out, codes = run_and_get_code(compiled, *prefill_inputs([5, 0, 13, 9], [3, 2, 4, 2]))
    code = "\n".join(codes)
    opaque = re.findall(r"torch\.ops\.mla_ops\.(\w+)\.default\(", code)
    # The merge and the device planner are traced into Inductor kernels, not called.
    assert sorted(set(opaque)) == [
        "absorbed_context_attention", "context_attention", "gather_context", "suffix_attention", "up_project"
    ]
    assert opaque.count("gather_context") == opaque.count("context_attention") == 3
    kernels = re.findall(r"^(cpp_fused_\w+) = async_compile", code, flags=re.M)
    assert any("merge_attn_states" in k for k in kernels), kernels
    assert any("plan_context_chunks_device" in k for k in kernels), kernels
    assert len(kernels) <= 8, kernels
    # Out= ops are re-inplaced: every chunk writes the same workspace and partial buffers, no copies.
    assert "copy_" not in code and "clone" not in code
    workspace_args = set(re.findall(r"mla_ops\.gather_context\.default\(.*, (buf\d+)\)$", code, flags=re.M))
    assert len(workspace_args) == 1, workspace_args


def graph_text(gm: torch.fx.GraphModule) -> str:
    """The readable graph without source comments (their paths differ between checkouts)."""
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    lines = [line.rstrip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return textwrap.dedent("\n".join(lines[1:]))  # drop the class line


@pytest.mark.skipif(expecttest is None, reason="expecttest is not installed (assertExpectedInline)")
class PinnedGraphs(expecttest.TestCase if expecttest else unittest.TestCase):
    maxDiff = None

    def test_aot_graph_of_a_prefill_step(self):
        torch._dynamo.reset()
        backend = AotEagerAndRecordGraphs()
        torch.compile(make_prefill_step(max_chunks=1), backend=backend, fullgraph=True, dynamic=True)(
            *prefill_inputs([3, 0, 5], [2, 3, 2])
        )
        (gm,) = backend.fw_graphs
        assert get_first_incompatible_cudagraph_node(gm) is None  # capture-safe, checked without a GPU
        self.assertExpectedInline(graph_text(gm), """\
def forward(self, arg0_1: "Sym(s85)", arg1_1: "f32[s85, 2, 10]", arg2_1: "Sym(s37)", arg3_1: "i32[s37, 20]", arg4_1: "i32[s37 + 1]", arg5_1: "i32[s37]", arg6_1: "f32[40, 4, 16]", arg7_1: "f32[s85, 12]", arg8_1: "f32[s85, 4]", arg9_1: "f32[22, 12]"):
    slice_1: "i32[s37]" = torch.ops.aten.slice.Tensor(arg4_1, 0, 1, 9223372036854775807)
    slice_2: "i32[s37]" = torch.ops.aten.slice.Tensor(arg4_1, 0, 0, -1)
    sub_2: "i32[s37]" = torch.ops.aten.sub.Tensor(slice_1, slice_2);  slice_1 = slice_2 = None
    le: "b8[s37]" = torch.ops.aten.le.Scalar(sub_2, 3)
    gt: "b8[s37]" = torch.ops.aten.gt.Scalar(arg5_1, 0)
    bitwise_and: "b8[s37]" = torch.ops.aten.bitwise_and.Tensor(le, gt);  le = gt = None
    scalar_tensor: "i32[]" = torch.ops.aten.scalar_tensor.default(0, dtype = torch.int32, layout = torch.strided, device = device(type='cpu'))
    where: "i32[s37]" = torch.ops.aten.where.self(bitwise_and, sub_2, scalar_tensor);  sub_2 = scalar_tensor = None
    cumsum: "i64[s37]" = torch.ops.aten.cumsum.default(where, 0);  where = None
    le_1: "b8[s37]" = torch.ops.aten.le.Scalar(cumsum, 4);  cumsum = None
    bitwise_and_1: "b8[s37]" = torch.ops.aten.bitwise_and.Tensor(bitwise_and, le_1);  bitwise_and = le_1 = None
    zeros_like: "i32[s37]" = torch.ops.aten.zeros_like.default(arg5_1, pin_memory = False)
    where_1: "i32[s37]" = torch.ops.aten.where.self(bitwise_and_1, arg5_1, zeros_like);  bitwise_and_1 = zeros_like = None
    sub_15: "i32[s37]" = torch.ops.aten.sub.Tensor(arg5_1, where_1);  arg5_1 = None
    plan_context_chunks_device = torch.ops.mla_ops.plan_context_chunks_device.default(sub_15, 16, 1)
    getitem: "i32[1, s37]" = plan_context_chunks_device[0]
    getitem_2: "i32[1, s37 + 1]" = plan_context_chunks_device[2];  plan_context_chunks_device = None
    cumsum_1: "i64[s37]" = torch.ops.aten.cumsum.default(sub_15, 0)
    gt_1: "b8[s37]" = torch.ops.aten.gt.Scalar(cumsum_1, 16);  cumsum_1 = None
    gt_2: "b8[s37]" = torch.ops.aten.gt.Scalar(sub_15, 0);  sub_15 = None
    bitwise_and_2: "b8[s37]" = torch.ops.aten.bitwise_and.Tensor(gt_1, gt_2);  gt_1 = gt_2 = None
    gt_3: "b8[s37]" = torch.ops.aten.gt.Scalar(where_1, 0)
    slice_3: "i32[s37]" = torch.ops.aten.slice.Tensor(arg4_1, 0, 1, 9223372036854775807)
    slice_4: "i32[s37]" = torch.ops.aten.slice.Tensor(arg4_1, 0, 0, -1)
    sub_27: "i32[s37]" = torch.ops.aten.sub.Tensor(slice_3, slice_4);  slice_3 = slice_4 = None
    scalar_tensor_1: "i32[]" = torch.ops.aten.scalar_tensor.default(0, dtype = torch.int32, layout = torch.strided, device = device(type='cpu'))
    where_2: "i32[s37]" = torch.ops.aten.where.self(gt_3, sub_27, scalar_tensor_1);  gt_3 = sub_27 = scalar_tensor_1 = None
    new_zeros: "i32[1]" = torch.ops.aten.new_zeros.default(where_2, [1], pin_memory = False)
    cumsum_2: "i32[s37]" = torch.ops.aten.cumsum.default(where_2, 0, dtype = torch.int32);  where_2 = None
    cat: "i32[s37 + 1]" = torch.ops.aten.cat.default([new_zeros, cumsum_2]);  new_zeros = cumsum_2 = None
    arange: "i32[s85]" = torch.ops.aten.arange.default(arg0_1, dtype = torch.int32, device = device(type='cpu'), pin_memory = False)
    searchsorted: "i64[s85]" = torch.ops.aten.searchsorted.Tensor(arg4_1, arange, right = True);  arange = None
    sub_34: "i64[s85]" = torch.ops.aten.sub.Tensor(searchsorted, 1);  searchsorted = None
    sub_36: "Sym(s37 - 1)" = arg2_1 - 1;  arg2_1 = None
    clamp: "i64[s85]" = torch.ops.aten.clamp.default(sub_34, 0, sub_36);  sub_34 = sub_36 = None
    index_select: "b8[s85]" = torch.ops.aten.index_select.default(bitwise_and_2, 0, clamp);  bitwise_and_2 = clamp = None
    t: "f32[12, 22]" = torch.ops.aten.t.default(arg9_1)
    mm: "f32[s85, 22]" = torch.ops.aten.mm.default(arg7_1, t);  arg7_1 = t = None
    view: "f32[s85, 2, 11]" = torch.ops.aten.view.default(mm, [-1, 2, 11]);  mm = None
    split_with_sizes = torch.ops.aten.split_with_sizes.default(view, [6, 5], -1);  view = None
    getitem_4: "f32[s85, 2, 6]" = split_with_sizes[0]
    getitem_5: "f32[s85, 2, 5]" = split_with_sizes[1];  split_with_sizes = None
    new_empty: "f32[s85, 2, 5]" = torch.ops.aten.new_empty.default(arg1_1, [arg0_1, 2, 5], pin_memory = False)
    new_empty_1: "f32[2, s85]" = torch.ops.aten.new_empty.default(arg1_1, [2, arg0_1], dtype = torch.float32, pin_memory = False);  arg0_1 = None
    auto_functionalized_v2 = torch.ops.higher_order.auto_functionalized_v2(torch.ops.mla_ops.suffix_attention.default, q = arg1_1, k_nope = getitem_4, k_pe = arg8_1, v = getitem_5, query_start_loc = arg4_1, softmax_scale = 0.25, sliding_window = 0, _out_base_index = 0, _lse_base_index = 1, _all_bases = [new_empty, new_empty_1]);  getitem_4 = arg8_1 = getitem_5 = new_empty = new_empty_1 = None
    getitem_7: "f32[s85, 2, 5]" = auto_functionalized_v2[1]
    getitem_8: "f32[2, s85]" = auto_functionalized_v2[2];  auto_functionalized_v2 = None
    zeros_like_1: "f32[s85, 2, 5]" = torch.ops.aten.zeros_like.default(getitem_7, pin_memory = False)
    full_like: "f32[2, s85]" = torch.ops.aten.full_like.default(getitem_8, -inf, pin_memory = False)
    auto_functionalized_v2_1 = torch.ops.higher_order.auto_functionalized_v2(torch.ops.mla_ops.absorbed_context_attention.default, q = arg1_1, kv_cache = arg6_1, block_table = arg3_1, query_start_loc = arg4_1, context_lens = where_1, kv_b_proj_weight = arg9_1, softmax_scale = 0.25, k_scale = None, absorbed_rows = 4, absorbed_token_loc = cat, sliding_window = 0, _out_base_index = 0, _lse_base_index = 1, _all_bases = [zeros_like_1, full_like]);  where_1 = cat = zeros_like_1 = full_like = None
    getitem_10: "f32[s85, 2, 5]" = auto_functionalized_v2_1[1]
    getitem_11: "f32[2, s85]" = auto_functionalized_v2_1[2];  auto_functionalized_v2_1 = None
    new_empty_2: "f32[16, 16]" = torch.ops.aten.new_empty.default(arg1_1, [16, 16], pin_memory = False)
    new_empty_3: "f32[16, 22]" = torch.ops.aten.new_empty.default(arg1_1, [16, 22], pin_memory = False)
    select: "i32[s37 + 1]" = torch.ops.aten.select.int(getitem_2, 0, 0);  getitem_2 = None
    select_1: "i32[s37]" = torch.ops.aten.select.int(getitem, 0, 0);  getitem = None
    auto_functionalized_v2_2 = torch.ops.higher_order.auto_functionalized_v2(torch.ops.mla_ops.gather_context.default, kv_cache = arg6_1, block_table = arg3_1, cu_seq_lens = select, starts = select_1, k_scale = None, _workspace_base_index = 0, _all_bases = [new_empty_2]);  arg6_1 = arg3_1 = new_empty_2 = None
    getitem_15: "f32[16, 16]" = auto_functionalized_v2_2[1];  auto_functionalized_v2_2 = None
    split_with_sizes_3 = torch.ops.aten.split_with_sizes.default(getitem_15, [12, 4], 1)
    getitem_18: "f32[16, 12]" = split_with_sizes_3[0];  split_with_sizes_3 = None
    auto_functionalized_v2_3 = torch.ops.higher_order.auto_functionalized_v2(torch.ops.mla_ops.up_project.default, latent = getitem_18, kv_b_proj_weight = arg9_1, cu_seq_lens = select, _out_base_index = 0, _all_bases = [new_empty_3]);  getitem_18 = arg9_1 = new_empty_3 = None
    getitem_21: "f32[16, 22]" = auto_functionalized_v2_3[1];  auto_functionalized_v2_3 = None
    view_2: "f32[16, 2, 11]" = torch.ops.aten.view.default(getitem_21, [-1, 2, 11])
    split_with_sizes_4 = torch.ops.aten.split_with_sizes.default(view_2, [6, 5], -1);  view_2 = None
    getitem_22: "f32[16, 2, 6]" = split_with_sizes_4[0];  split_with_sizes_4 = None
    split_with_sizes_5 = torch.ops.aten.split_with_sizes.default(getitem_15, [12, 4], 1);  getitem_15 = None
    getitem_25: "f32[16, 4]" = split_with_sizes_5[1];  split_with_sizes_5 = None
    view_3: "f32[16, 2, 11]" = torch.ops.aten.view.default(getitem_21, [-1, 2, 11]);  getitem_21 = None
    split_with_sizes_6 = torch.ops.aten.split_with_sizes.default(view_3, [6, 5], -1);  view_3 = None
    getitem_27: "f32[16, 2, 5]" = split_with_sizes_6[1];  split_with_sizes_6 = None
    auto_functionalized_v2_4 = torch.ops.higher_order.auto_functionalized_v2(torch.ops.mla_ops.context_attention.default, q = arg1_1, k_nope = getitem_22, k_pe = getitem_25, v = getitem_27, query_start_loc = arg4_1, cu_seq_lens = select, starts = select_1, softmax_scale = 0.25, context_lens = None, sliding_window = 0, _out_base_index = 0, _lse_base_index = 1, _all_bases = [getitem_10, getitem_11]);  arg1_1 = getitem_22 = getitem_25 = getitem_27 = arg4_1 = select = select_1 = getitem_10 = getitem_11 = None
    getitem_29: "f32[s85, 2, 5]" = auto_functionalized_v2_4[1]
    getitem_30: "f32[2, s85]" = auto_functionalized_v2_4[2];  auto_functionalized_v2_4 = None
    merge_attn_states = torch.ops.mla_ops.merge_attn_states.default(getitem_29, getitem_30, getitem_7, getitem_8);  getitem_29 = getitem_30 = getitem_7 = getitem_8 = None
    getitem_31: "f32[s85, 2, 5]" = merge_attn_states[0];  merge_attn_states = None
    view_4: "b8[s85, 1, 1]" = torch.ops.aten.view.default(index_select, [-1, 1, 1]);  index_select = None
    full_like_1: "f32[s85, 2, 5]" = torch.ops.aten.full_like.default(getitem_31, nan, pin_memory = False)
    where_3: "f32[s85, 2, 5]" = torch.ops.aten.where.self(view_4, full_like_1, getitem_31);  view_4 = full_like_1 = getitem_31 = None
    return (where_3,)""")

    def test_fused_merge(self):
        from torch._inductor.decomposition import select_decomp_table

        def merge(out_a, lse_a, out_b, lse_b):
            return torch.ops.mla_ops.merge_attn_states(out_a, lse_a, out_b, lse_b)

        gm = torch.fx.experimental.proxy_tensor.make_fx(merge, decomposition_table=select_decomp_table())(
            torch.randn(3, 2, 4), torch.randn(2, 3), torch.randn(3, 2, 4), torch.randn(2, 3)
        )
        assert "mla_ops" not in gm.code
        self.assertExpectedInline(graph_text(gm), """\
def forward(self, out_a_1: "f32[3, 2, 4]", lse_a_1: "f32[2, 3]", out_b_1: "f32[3, 2, 4]", lse_b_1: "f32[2, 3]"):
    isinf: "b8[2, 3]" = torch.ops.aten.isinf.default(lse_a_1)
    scalar_tensor: "f32[]" = torch.ops.aten.scalar_tensor.default(-inf, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where: "f32[2, 3]" = torch.ops.aten.where.self(isinf, scalar_tensor, lse_a_1);  isinf = scalar_tensor = lse_a_1 = None
    isinf_1: "b8[2, 3]" = torch.ops.aten.isinf.default(lse_b_1)
    scalar_tensor_1: "f32[]" = torch.ops.aten.scalar_tensor.default(-inf, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where_1: "f32[2, 3]" = torch.ops.aten.where.self(isinf_1, scalar_tensor_1, lse_b_1);  isinf_1 = scalar_tensor_1 = lse_b_1 = None
    maximum: "f32[2, 3]" = torch.ops.aten.maximum.default(where, where_1)
    isinf_2: "b8[2, 3]" = torch.ops.aten.isinf.default(maximum)
    scalar_tensor_2: "f32[]" = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where_2: "f32[2, 3]" = torch.ops.aten.where.self(isinf_2, scalar_tensor_2, maximum);  isinf_2 = scalar_tensor_2 = maximum = None
    sub: "f32[2, 3]" = torch.ops.aten.sub.Tensor(where, where_2);  where = None
    exp: "f32[2, 3]" = torch.ops.aten.exp.default(sub);  sub = None
    sub_1: "f32[2, 3]" = torch.ops.aten.sub.Tensor(where_1, where_2);  where_1 = None
    exp_1: "f32[2, 3]" = torch.ops.aten.exp.default(sub_1);  sub_1 = None
    add: "f32[2, 3]" = torch.ops.aten.add.Tensor(exp, exp_1)
    log: "f32[2, 3]" = torch.ops.aten.log.default(add)
    add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(log, where_2);  log = where_2 = None
    gt: "b8[2, 3]" = torch.ops.aten.gt.Scalar(add, 0)
    scalar_tensor_3: "f32[]" = torch.ops.aten.scalar_tensor.default(1.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where_3: "f32[2, 3]" = torch.ops.aten.where.self(gt, add, scalar_tensor_3);  gt = add = scalar_tensor_3 = None
    div: "f32[2, 3]" = torch.ops.aten.div.Tensor(exp, where_3);  exp = None
    permute: "f32[3, 2]" = torch.ops.aten.permute.default(div, [1, 0]);  div = None
    unsqueeze: "f32[3, 2, 1]" = torch.ops.aten.unsqueeze.default(permute, -1);  permute = None
    div_1: "f32[2, 3]" = torch.ops.aten.div.Tensor(exp_1, where_3);  exp_1 = where_3 = None
    permute_1: "f32[3, 2]" = torch.ops.aten.permute.default(div_1, [1, 0]);  div_1 = None
    unsqueeze_1: "f32[3, 2, 1]" = torch.ops.aten.unsqueeze.default(permute_1, -1);  permute_1 = None
    mul: "f32[3, 2, 4]" = torch.ops.aten.mul.Tensor(out_a_1, unsqueeze);  out_a_1 = unsqueeze = None
    mul_1: "f32[3, 2, 4]" = torch.ops.aten.mul.Tensor(out_b_1, unsqueeze_1);  out_b_1 = unsqueeze_1 = None
    add_2: "f32[3, 2, 4]" = torch.ops.aten.add.Tensor(mul, mul_1);  mul = mul_1 = None
    return (add_2, add_1)""")

        _, (code,) = run_and_get_code(torch.compile(merge, dynamic=True), torch.randn(5, 2, 4), torch.randn(2, 5),
                                      torch.randn(5, 2, 4), torch.randn(2, 5))
        kernels = re.findall(r"^(cpp_fused_\w+) = async_compile", code, flags=re.M)
        assert len(kernels) == 1 and "mla_ops" not in code.replace("mla_ops_inductor", ""), kernels


# ---- the device path makes no host sync ------------------------------------------------------

HOST_SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "tolist",
                 "_assert_async", "repeat_interleave"}


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_device_path_makes_no_host_sync():
    args = prefill_inputs([5, 0, 13], [3, 2, 4])
    with RecordOps() as recorded:
        mla_ops.mla_prefill(*args, WEIGHT, 0.25, workspace_size=WORKSPACE, max_chunks=3)
        assert not HOST_SYNC_OPS & set(recorded.names), sorted(set(recorded.names))
        args[-1].sum().item()  # the recorder does see a host read
    assert "item" in recorded.names or "_local_scalar_dense" in recorded.names


def test_device_path_runs_on_fake_tensors():
    """Fake tensors hold no data, so any host read of a device value would raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = prefill_inputs([5, 0, 13], [3, 2, 4])
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(t) for t in (*args, WEIGHT)]
        out = mla_ops.mla_prefill(*fake[:7], fake[7], 0.25, workspace_size=WORKSPACE, max_chunks=3)
    assert out.shape == (9, HEADS, VALUE)
    with FakeTensorMode() as mode, pytest.raises(Exception):  # the host path reads the lengths
        fake = [mode.from_tensor(t) for t in (*args, WEIGHT)]
        mla_ops.mla_prefill(*fake[:7], fake[7], 0.25, workspace_size=WORKSPACE)


# ---- the MLA model compiles whole ------------------------------------------------------------


def model_step_fn(model, max_chunks, absorb_max_query_len, block_size=4):
    """One compiled step: the device plan is made inside the graph, once for every layer. Its options are
    made outside: under dynamic=True an int the step closed over would be symbolic, and a plan's sizes are
    static."""
    options = mla_ops.PlanOptions(block_size=block_size, workspace_size=32, max_chunks=max_chunks,
                                  absorb_max_query_len=absorb_max_query_len)

    def step(ids, positions, caches, slots, table, qsl, lens):
        plan = mla_ops.plan_prefill(qsl, lens, table, options=options)
        return model(ids, positions, caches, slots, plan)
    return step


@torch.no_grad()
def test_mla_model_compiles_whole_and_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).eval()
    compiled = torch.compile(model_step_fn(model, 4, 3), fullgraph=True, dynamic=True)  # both paths in one graph
    base = normal_caches(model.allocate_kv_caches(64, 4))
    for i, (context_lens, query_lens) in enumerate(BUCKET_4[:6]):
        ids, positions, slots, table, qsl, lens = model_step(config, context_lens, query_lens, seed=i)
        caches, expect_caches = clone_caches(base), clone_caches(base)
        for cache in caches.tensors:
            torch._dynamo.mark_static(cache)  # a runner's cache buffers are fixed
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(ids, positions, caches, slots, table, qsl, lens)
        plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, absorb_max_query_len=0)  # eager, host, all chunked
        expect = model(ids, positions, expect_caches, slots, plan)
        torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=1e-5, atol=1e-5)


class RestartCounter(logging.Handler):
    """Dynamo's "Restarting analysis" log lines (a float specialised late makes one: the whole trace again)."""

    def __enter__(self):
        self.count, self.logger = 0, logging.getLogger("torch._dynamo.convert_frame")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)

    def emit(self, record):
        self.count += record.getMessage().startswith("Restarting analysis")


# The model's float constants (rope_theta, eps, scales, YaRN's) read as constants: a symbolic float that an
# op cannot take would be specialised after the trace and the whole analysis restarted.
SCALED = dict(rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=64, mscale=1.0,
                                mscale_all_dim=1.0), max_position_embeddings=2560,
              scalings=dict(embedding_scale=12.0, residual_scale=0.5, logits_scaling=4.0,
                            final_logit_softcapping=30.0))


@torch.no_grad()
@pytest.mark.skipif(not NESTED_REGIONS, reason="before torch 2.13 the model's floats are plain (regions.static_floats): "
                                               "Dynamo specialises them late, one restart")
def test_the_whole_step_compiles_without_restarting_analysis():
    # The tiny preset's constants and YaRN's and MiniCPM3's on top: one compile covers them all.
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = dataclasses.replace(mla_ops.MLAConfig.from_name("tiny"), **SCALED)
    model = mla_ops.MLAForCausalLM(config).eval()
    ids, positions, slots, table, qsl, lens = model_step(config, [5, 0, 13], [3, 2, 4], seed=0)
    caches, expect_caches = model.allocate_kv_caches(64, 4), model.allocate_kv_caches(64, 4)
    with RestartCounter() as restarts:
        out = torch.compile(model_step_fn(model, 4, 3), backend="aot_eager", fullgraph=True, dynamic=True)(
            ids, positions, caches, slots, table, qsl, lens)
    assert restarts.count == 0
    expect = model(ids, positions, expect_caches, slots, mla_ops.plan_prefill(qsl, lens, table, 4, 32))
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_device_plan_passed_into_the_compiled_model():
    """A plan made outside (eager, device form) is a pytree input: its tensors become graph inputs
    (traced with aot_eager: what is tested is the input, not Inductor's code)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).eval()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    base = model.allocate_kv_caches(64, 4)
    for i, (context_lens, query_lens) in enumerate(BUCKET_4[:4]):
        ids, positions, slots, table, qsl, lens = model_step(config, context_lens, query_lens, seed=i)
        plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, max_chunks=4, absorb_max_query_len=3)
        leaves, spec = torch.utils._pytree.tree_flatten(plan)
        assert torch.utils._pytree.tree_unflatten(leaves, spec) == plan
        caches, expect_caches = clone_caches(base), clone_caches(base)
        for cache in caches.tensors:
            torch._dynamo.mark_static(cache)  # a runner's cache buffers are fixed
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(ids, positions, caches, slots, plan)
        torch.testing.assert_close(out, model(ids, positions, expect_caches, slots, plan),
                                   rtol=1e-4, atol=1e-4)


@torch.no_grad()
@pytest.mark.skipif(not NESTED_REGIONS, reason="this torch has no reusable nested regions")
def test_the_whole_model_compiles_its_layer_once_plans_once_and_fuses_the_merge():
    """Inductor's code of a whole step, at 2 and 3 layers: the same kernels (the layer is a nested region, its
    code generated once and called per layer; at 1 layer a region called once is inlined), the device planner
    once, the merge fused. The caches (one tensor per layer) are not marked static."""
    def generated(layers):
        torch._dynamo.reset()
        torch.manual_seed(0)
        config = mla_ops.MLAConfig(**{**mla_ops.models.config.mla_configs["tiny"], "num_hidden_layers": layers})
        model = mla_ops.MLAModel(config).eval()
        ids, positions, slots, table, qsl, lens = model_step(config, [5, 0, 13], [3, 2, 4], seed=0)
        caches, expect_caches = model.allocate_kv_caches(64, 4), model.allocate_kv_caches(64, 4)
        step = model_step_fn(model, 4, 3)
        out, codes = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=True),
                                      ids, positions, caches, slots, table, qsl, lens)
        torch.testing.assert_close(out, step(ids, positions, expect_caches, slots, table, qsl, lens),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=1e-5, atol=1e-5)
        code = "\n".join(codes)
        kernels = re.findall(r"^(cpp_fused_\w+) = async_compile", code, flags=re.M)
        # a region's code: torch 2.13's repeated_subgraph0, or 2.14's auto_functionalized_subgraph_0 (its writes inside)
        return code, kernels, re.findall(r"= (repeated_subgraph\d+|auto_functionalized_subgraph_\d+)\(", code)

    (one_code, one_kernels, one_calls), (code, kernels, calls) = generated(2), generated(3)
    assert kernels == one_kernels  # nothing generated per layer
    # the layer is one region, called once per layer
    assert Counter(one_calls) == {name: 2 for name in set(one_calls)} and len(set(one_calls)) == 1
    assert Counter(calls) == {name: 3 for name in set(one_calls)}
    # The layer's attention (K=4 chunk slots) is in its region's code once; the planner runs once per step.
    assert code.count("mla_ops.context_attention.default(") == one_code.count("mla_ops.context_attention.default(") == 4
    call = code[code.index("def call("):]
    assert len(re.findall(r"cpp_fused_\w*plan_context_chunks_device\w*\(", call)) == \
        len(re.findall(r"cpp_fused_\w*plan_context_chunks_device\w*\(", one_code[one_code.index("def call("):])) >= 1
    assert any("merge_attn_states" in k for k in kernels) and "torch.ops.mla_ops.merge_attn_states" not in code
    # The cache writes: in the region's code (torch >= 2.14), else one per layer in the step's
    assert call.count("mla_ops.write_latent_cache.default(") == (0 if WRITES_IN_REGIONS else 3)
    assert code.count("mla_ops.write_latent_cache.default(") == (1 if WRITES_IN_REGIONS else 3)


# ---- a changed lowering never reuses stale compiled code --------------------------------------

CACHE_SCRIPT = """
import os, sys, torch
import mla_ops, mla_ops.lowering.decompositions as decompositions
from mla_ops.ops.merge import merge_states_reference

if os.environ.get("PATCH_LOWERING"):
    def doubled_merge(*args):  # a "changed lowering": same op, different code
        out, lse = merge_states_reference(*args)
        return out * 2, lse
    decompositions.DECOMPOSITIONS[torch.ops.mla_ops.merge_attn_states.default] = doubled_merge
mla_ops.enable()

def merge(a, la, b, lb):
    return torch.ops.mla_ops.merge_attn_states(a, la, b, lb)[0]

g = torch.Generator().manual_seed(0)
args = (torch.randn(4, 2, 3, generator=g), torch.randn(2, 4, generator=g),
        torch.randn(4, 2, 3, generator=g), torch.randn(2, 4, generator=g))
out = torch.compile(merge)(*args)
eager = mla_ops.merge_attn_states(*args)[0]
from torch._dynamo.utils import counters
print(round(float((out / eager).mean()), 3), counters["inductor"]["fxgraph_cache_hit"],
      counters["inductor"]["fxgraph_cache_miss"])
"""


def test_changed_lowering_misses_the_shared_compile_cache(tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    env.pop("PATCH_LOWERING", None)

    script = tmp_path / "compile_merge.py"
    script.write_text(CACHE_SCRIPT)

    def run(**extra):
        result = subprocess.run([sys.executable, str(script)], env={**env, **extra}, capture_output=True,
                                text=True, cwd=REPO_ROOT)
        assert result.returncode == 0, result.stderr[-3000:]
        ratio, hits, misses = result.stdout.split()
        return float(ratio), int(hits), int(misses)

    assert run() == (1.0, 0, 1)  # cold cache: compiled
    assert run() == (1.0, 1, 0)  # same lowering, second process: served from the cache
    assert run(PATCH_LOWERING="1") == (2.0, 0, 1)  # changed lowering: recompiled, not stale
