"""Build the device path's Triton kernels for an H200 (sm_90) on any machine, and read the build.

No GPU is needed: Triton compiles to a cubin with the ptxas it ships, and ``cuobjdump`` reads
registers, stack and local memory (spills) per thread off it. The signatures are what a launch
at DeepSeek dims passes (16-bit, unit strides specialised to 1 and the rest divisible by 16, as
Triton's launcher specialises them), so these are the variants a GPU run compiles. Reported per
kernel: shared memory, registers, stack / local bytes, whether loads are asynchronous copies
(software-pipelined) and whether the dot runs on Hopper's warpgroup tensor cores (wgmma).

    python -m benchmarks.sm90_build --json benchmarks/results/sm90_build.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import tempfile
from typing import Sequence

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks._lib.batches import V3
from benchmarks._lib.report import write_json_atomic
from mla_ops.triton import absorbed, attention, rows_gemm

H200 = GPUTarget("cuda", 90, 32)
LATENT, NOPE, ROPE, VALUE = V3.latent, V3.nope, V3.rope, V3.value  # DeepSeek's head dims
PAGE = 64  # FlashMLA's cache page size
INT_POINTERS = {"loc_ptr", "tokens_ptr", "block_table_ptr", "query_start_loc_ptr", "latent_loc_ptr",
                "context_lens_ptr", "cu_k_ptr", "starts_ptr"}
FP32_POINTERS = {"k_scale_ptr", "lse_ptr"}
FLOATS = {"qk_scale"}


def signature(fn, constexprs: dict, unit_strides: Sequence[str], fp8_cache: bool = False):
    """(signature, constexprs, attrs) of a launch: pointers typed, unit strides constant, the rest i32."""
    names = list(inspect.signature(fn.fn).parameters)
    consts = dict(constexprs, **{name: 1 for name in unit_strides})
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ("*i32" if name in INT_POINTERS else "*fp32" if name in FP32_POINTERS
                         else "*u8" if name == "cache_ptr" and fp8_cache else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def kernels() -> dict:
    """name -> (jit function, constexprs, unit strides, num_warps, num_stages, fp8 cache)."""
    bm, bn, bk, gemm_warps, gemm_stages = rows_gemm.GPU_CONFIG_16BIT
    gemm = dict(FP32_DOT=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=rows_gemm.GROUP_M)
    out = {
        "up_projection": (rows_gemm._rows_gemm_kernel, dict(gemm, K=LATENT, MAP_A=False, MAP_C=False),
                          ["stride_a_k", "stride_w_k", "stride_c_col"], gemm_warps, gemm_stages, False),
        # W_UK^T is a view: its output columns are contiguous, its reduction rows are not.
        "absorbed_fold": (rows_gemm._rows_gemm_kernel, dict(gemm, K=NOPE, MAP_A=True, MAP_C=False),
                          ["stride_a_k", "stride_w_out", "stride_c_col"], gemm_warps, gemm_stages, False),
        "absorbed_unfold": (rows_gemm._rows_gemm_kernel, dict(gemm, K=LATENT, MAP_A=False, MAP_C=True),
                            ["stride_a_k", "stride_w_k", "stride_c_col"], gemm_warps, gemm_stages, False),
    }
    for heads, fp8 in ((16, False), (128, False), (128, True)):
        block_m, block_h, block_n, block_dv, warps, stages = absorbed.tile_shape(torch.bfloat16, False, heads, LATENT)
        consts = dict(HEAD_L=LATENT, HEAD_R=ROPE, BLOCK_L=LATENT, BLOCK_R=ROPE, BLOCK_DV=block_dv, BLOCK_M=block_m,
                      BLOCK_H=block_h, BLOCK_N=block_n, PAGE_SIZE=PAGE, IS_FP8=fp8, DOT_DTYPE=tl.bfloat16,
                      DOT_PRECISION="tf32", INTERPRETED=False)
        unit = ["stride_qld", "stride_qpd", "stride_cache_col", "stride_table_col", "stride_qsl", "stride_lat",
                "stride_ctx", "stride_old", "stride_lt"]
        out[f"absorbed_attention_N{heads}{'_fp8' if fp8 else ''}"] = (absorbed._absorbed_fwd, consts, unit, warps,
                                                                       stages, fp8)
    block_m, block_n, warps, stages = attention.CUDA_CONFIG_16BIT
    for causal in (False, True):
        consts = dict(HEAD_P=NOPE, HEAD_R=ROPE, HEAD_V=VALUE, BLOCK_P=NOPE, BLOCK_R=ROPE, BLOCK_V=VALUE,
                      BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, MERGE=not causal, DOT_DTYPE=tl.bfloat16,
                      DOT_PRECISION="tf32", INTERPRETED=False)
        unit = ["stride_qd", "stride_kd", "stride_pd", "stride_vd", "stride_od", "stride_lt", "stride_qsl",
                "stride_cuk", "stride_starts"]
        out["suffix_attention" if causal else "context_attention"] = (attention._attn_fwd, consts, unit, warps,
                                                                      stages, False)
    return out


def resources(cubin: bytes) -> dict:
    """Registers, stack and local bytes per thread, from ``cuobjdump -res-usage``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}


def build(name: str, spec) -> dict:
    fn, constexprs, unit_strides, num_warps, num_stages, fp8 = spec
    sig, consts, attrs = signature(fn, constexprs, unit_strides, fp8)
    source = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(source, target=H200, options=dict(num_warps=num_warps, num_stages=num_stages))
    ir = compiled.asm["ttgir"]
    return dict(kernel=name, num_warps=num_warps, num_stages=num_stages, shared_bytes=compiled.metadata.shared,
                **resources(compiled.asm["cubin"]), async_copies="async_copy" in ir, wgmma="warp_group_dot" in ir)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", nargs="*", help="kernel names (default: all)")
    args = parser.parse_args(argv)
    rows = [build(name, spec) for name, spec in kernels().items() if not args.only or name in args.only]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        write_json_atomic(args.json, dict(triton=triton.__version__, target="sm_90", results=rows))
    return rows


if __name__ == "__main__":
    main()
