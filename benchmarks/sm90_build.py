"""Build the device path's Triton kernels for an H200 (sm_90) on any machine, and read the build.

No GPU is needed: Triton compiles to a cubin with the ptxas it ships, and ``cuobjdump`` reads
registers, stack and local memory (spills) per thread off it. The signatures are what a launch at a
released model's dims passes (16-bit, unit strides specialised to 1 and the rest divisible by 16,
as Triton's launcher specialises them), with the tile configs the launchers pick for those dims, so
these are the variants a GPU run compiles. One row per (model, kernel) over ``MODELS`` (DeepSeek's
dims first; a kernel whose dims another model already built is not built again). Reported: shared
memory, registers, stack / local bytes, whether loads are asynchronous copies (software-pipelined)
and whether the dot runs on Hopper's warpgroup tensor cores (wgmma).

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

from benchmarks._lib.batches import Dims
from benchmarks._lib.report import write_json_atomic
from mla_ops.triton import absorbed, attention, rows_gemm

H200 = GPUTarget("cuda", 90, 32)
PAGE = 64  # FlashMLA's cache page size
# The released models' attention dims (heads, L, P, R, V), from their config.json defaults in transformers 5.24.
MODELS = {
    "deepseek_v3": Dims(128, 512, 128, 64, 128),  # also Kimi K2.x, DeepSeek-V3.2
    "deepseek_v2_lite": Dims(16, 512, 128, 64, 128),
    "longcat_flash": Dims(64, 512, 128, 64, 128),
    "glm4_moe_lite": Dims(20, 512, 192, 64, 256),  # GLM-4.7-Flash
    "glm_moe_dsa": Dims(64, 512, 192, 64, 256),  # GLM-5
    "mistral4": Dims(32, 256, 64, 64, 128),  # Mistral Small 4
    "minicpm3": Dims(40, 256, 64, 32, 64),
    "mistral_large4": Dims(64, 512, 64, 64, 128),
    "mistral_large4_nope": Dims(64, 512, 64, 0, 128),  # its layers without RoPE
}
INT_POINTERS = {"loc_ptr", "tokens_ptr", "block_table_ptr", "query_start_loc_ptr", "latent_loc_ptr",
                "context_lens_ptr", "cu_k_ptr", "starts_ptr"}
FP32_POINTERS = {"k_scale_ptr", "lse_ptr"}
FLOATS = {"qk_scale"}
WINDOWED = ("absorbed_attention", "context_attention", "suffix_attention")  # also built with a sliding window


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


def kernels(d: Dims, fp8: bool = False) -> dict:
    """name -> (jit function, constexprs, unit strides, num_warps, num_stages, fp8 cache) at dims ``d``."""
    bm, bn, bk, gemm_warps, gemm_stages = rows_gemm.GPU_CONFIG_16BIT
    gemm = dict(FP32_DOT=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=rows_gemm.GROUP_M)
    out = {
        "up_projection": (rows_gemm._rows_gemm_kernel, dict(gemm, K=d.latent, MAP_A=False, MAP_C=False),
                          ["stride_a_k", "stride_w_k", "stride_c_col"], gemm_warps, gemm_stages, False),
        # W_UK^T is a view: its output columns are contiguous, its reduction rows are not.
        "absorbed_fold": (rows_gemm._rows_gemm_kernel, dict(gemm, K=d.nope, MAP_A=True, MAP_C=False),
                          ["stride_a_k", "stride_w_out", "stride_c_col"], gemm_warps, gemm_stages, False),
        "absorbed_unfold": (rows_gemm._rows_gemm_kernel, dict(gemm, K=d.latent, MAP_A=False, MAP_C=True),
                            ["stride_a_k", "stride_w_k", "stride_c_col"], gemm_warps, gemm_stages, False),
    }
    for cache_fp8 in (False, True) if fp8 else (False,):
        block_m, block_h, block_n, block_dv, warps, stages = absorbed.tile_shape(torch.bfloat16, False, d.heads,
                                                                                 d.latent)
        block_r = max(16, triton.next_power_of_2(d.rope))
        consts = dict(HEAD_L=d.latent, HEAD_R=d.rope, BLOCK_L=triton.next_power_of_2(d.latent), BLOCK_R=block_r,
                      BLOCK_DV=block_dv, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_N=block_n, PAGE_SIZE=PAGE,
                      WINDOW=False, IS_FP8=cache_fp8, IS_DS_MLA=False, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32",
                      INTERPRETED=False)
        unit = ["stride_qld", "stride_qpd", "stride_cache_col", "stride_table_col", "stride_qsl", "stride_lat",
                "stride_ctx", "stride_old", "stride_lt"]
        out[f"absorbed_attention{'_fp8' if cache_fp8 else ''}"] = (absorbed._absorbed_fwd, consts, unit, warps,
                                                                    stages, cache_fp8)
    block_m, block_n, warps, stages, _ = attention.launch_config(torch.bfloat16, False, d.nope, d.rope, d.value)
    block_p, block_r, block_v = attention.head_blocks(d.nope, d.rope, d.value)
    for causal in (False, True):
        consts = dict(HEAD_P=d.nope, HEAD_R=d.rope, HEAD_V=d.value, BLOCK_P=block_p, BLOCK_R=block_r, BLOCK_V=block_v,
                      BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, MERGE=not causal, WINDOW=False,
                      DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", INTERPRETED=False)
        unit = ["stride_qd", "stride_kd", "stride_pd", "stride_vd", "stride_od", "stride_lt", "stride_qsl",
                "stride_cuk", "stride_starts", "stride_ctx"]
        out["suffix_attention" if causal else "context_attention"] = (attention._attn_fwd, consts, unit, warps,
                                                                      stages, False)
    for name in WINDOWED:  # a sliding window's variants (DESIGN §11): the same tiles, every key tile masked
        fn, consts, *rest = out[name]
        out[f"{name}_window"] = (fn, dict(consts, WINDOW=True), *rest)
    return out


def specs(models: Sequence[str]):
    """``(model, kernel, spec)`` per model, each distinct build once (the first model that needs it)."""
    seen = set()
    for model in models:
        for name, spec in kernels(MODELS[model], fp8=model == "deepseek_v3").items():
            fn, consts, *_ = spec
            key = (fn, tuple(sorted(consts.items())))
            if key not in seen:
                seen.add(key)
                yield model, name, spec


def resources(cubin: bytes) -> dict:
    """Registers, stack and local bytes per thread, from ``cuobjdump -res-usage``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", text)}


def build(model: str, name: str, spec) -> dict:
    fn, constexprs, unit_strides, num_warps, num_stages, fp8 = spec
    sig, consts, attrs = signature(fn, constexprs, unit_strides, fp8)
    source = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(source, target=H200, options=dict(num_warps=num_warps, num_stages=num_stages))
    ir = compiled.asm["ttgir"]
    d = MODELS[model]
    return dict(model=model, kernel=name, heads=d.heads, dims=dict(L=d.latent, P=d.nope, R=d.rope, V=d.value),
                num_warps=num_warps, num_stages=num_stages, shared_bytes=compiled.metadata.shared,
                **resources(compiled.asm["cubin"]), async_copies="async_copy" in ir, wgmma="warp_group_dot" in ir)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", nargs="*", help="kernel names (default: all)")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    args = parser.parse_args(argv)
    rows = [build(model, name, spec) for model, name, spec in specs(args.models) if not args.only or name in args.only]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        write_json_atomic(args.json, dict(triton=triton.__version__, target="sm_90", results=rows))
    return rows


if __name__ == "__main__":
    main()
