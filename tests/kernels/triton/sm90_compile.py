"""Compile every Triton kernel for sm_90 (H100/H200) without a GPU; print a JSON report.

Run as ``python -m tests.kernels.triton.sm90_compile`` in a process WITHOUT ``TRITON_INTERPRET``
(the interpreter replaces the kernels at decoration time). It runs Triton's whole pipeline
(front end, MLIR passes, LLVM, ptxas) for the production case (bf16, D 128, 8 KV / 32 query
heads, page 16) with the constexprs and launch options the launchers use, so GPU-only compile
errors show up on a CPU-only machine too. With the NVIDIA ``cuobjdump`` that Triton ships it
also reports registers and spill stack per kernel. ``--variants``: the attention kernels'
sliding-window variants and the MoE grouped GEMM instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from prefixgate.kernels.triton.copy_pages import _copy_pages_kernel
from prefixgate.kernels.triton.decode import DECODE_BLOCK_N, _paged_decode_kernel
from prefixgate.kernels.triton.decode_reduce import _decode_reduce_kernel
from prefixgate.kernels.triton.moe import _expert_gemm_kernel
from prefixgate.kernels.triton.prefill import (
    PREFILL_BLOCK_M_LONG,
    PREFILL_BLOCK_M_SHORT,
    PREFILL_BLOCK_N,
    _paged_prefill_kernel,
)
from prefixgate.kernels.triton.write_kv import _write_kv_kernel

TARGET = GPUTarget("cuda", 90, 32)
DEFAULT = ("write_kv", "decode_split", "decode_single", "decode_reduce", "prefill",
           "prefill_short", "copy_pages")
VARIANTS = ("decode_split", "decode_reduce", "prefill", "moe_gemm")  # (windowed attention)
D, HKV, GROUP, PAGE = 128, 8, 4, 16
ATTENTION_PTRS = {
    "query_ptr": "*bf16",
    "k_cache_ptr": "*bf16",
    "v_cache_ptr": "*bf16",
    "block_tables_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "out_ptr": "*bf16",
    "partial_out_ptr": "*fp32",
    "partial_max_ptr": "*fp32",
    "partial_sum_ptr": "*fp32",
    "sinks_ptr": "*fp32",
}


def compile_one(fn, ptrs: dict, consts: dict, num_warps: int, num_stages: int = 2) -> dict:
    """Compile ``fn`` for sm_90; pointers and strides are assumed 16-divisible (as at runtime)."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        signature[name] = ptrs.get(name, "fp32" if name == "scale_log2" else "i32")
        # stride_bt_s varies per step, so the kernels keep it unspecialised
        if name in ptrs or (name.startswith("stride") and name != "stride_bt_s"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    kernel = triton.compile(
        source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    report = {"ptx_cp_async": kernel.asm["ptx"].count("cp.async.cg")}
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if cuobjdump.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            usage = subprocess.run(
                [str(cuobjdump), "--dump-resource-usage", cubin.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        fields = dict(
            item.split(":", 1)
            for line in usage.splitlines()
            if "REG:" in line
            for item in line.split()
        )
        report.update(registers=int(fields["REG"]), spill_stack=int(fields["STACK"]))
    return report


def _kernels(windowed: bool) -> dict[str, tuple]:
    """name -> (kernel, pointer types, constexprs, num_warps), as the launchers launch them;
    ``windowed``: the attention kernels' sliding-window variants."""
    attention = {
        "HEAD_DIM": D,
        "BLOCK_D": D,
        "PAGE_SIZE": PAGE,
        "GROUP_SIZE": GROUP,
        "COMPUTE_DTYPE": tl.bfloat16,
        "DOT_PRECISION": "tf32",
        "WINDOWED": windowed,
        # gpt-oss's sliding layers carry attention sinks: the variants compile both together
        "HAS_SINKS": windowed,
    }
    kernels = {
        "write_kv": (
            _write_kv_kernel,
            {
                "key_ptr": "*bf16",
                "value_ptr": "*bf16",
                "k_cache_ptr": "*bf16",
                "v_cache_ptr": "*bf16",
                "slot_mapping_ptr": "*i64",
            },
            {"PAGE_SIZE": PAGE, "NUM_KV_HEADS": HKV, "HEAD_DIM": D, "BLOCK_H": HKV, "BLOCK_D": D},
            4,
        ),
        "decode_split": (
            _paged_decode_kernel,
            ATTENTION_PTRS,
            {
                **attention,
                "NUM_Q_HEADS": HKV * GROUP,
                "BLOCK_G": 16,
                "BLOCK_N": DECODE_BLOCK_N,
                "SPLIT_K": True,
            },
            4,
        ),
        "decode_single": (
            _paged_decode_kernel,
            ATTENTION_PTRS,
            {
                **attention,
                "NUM_Q_HEADS": HKV * GROUP,
                "BLOCK_G": 16,
                "BLOCK_N": DECODE_BLOCK_N,
                "SPLIT_K": False,
            },
            4,
        ),
        "decode_reduce": (
            _decode_reduce_kernel,
            ATTENTION_PTRS,
            {
                "NUM_Q_HEADS": HKV * GROUP,
                "BLOCK_SPLITS": 8,
                "HEAD_DIM": D,
                "BLOCK_D": D,
                "WINDOWED": windowed,
                "HAS_SINKS": windowed,
            },
            4,
        ),
        "prefill": (
            _paged_prefill_kernel,
            ATTENTION_PTRS,
            {
                **attention,
                "BLOCK_Q": PREFILL_BLOCK_M_LONG // GROUP,
                "BLOCK_M": PREFILL_BLOCK_M_LONG,
                "BLOCK_N": PREFILL_BLOCK_N,
            },
            8,
        ),
        "prefill_short": (
            _paged_prefill_kernel,
            ATTENTION_PTRS,
            {
                **attention,
                "BLOCK_Q": PREFILL_BLOCK_M_SHORT // GROUP,
                "BLOCK_M": PREFILL_BLOCK_M_SHORT,
                "BLOCK_N": PREFILL_BLOCK_N,
            },
            4,
        ),
        "copy_pages": (
            _copy_pages_kernel,
            {"kv_pool_ptr": "*bf16", "src_ptr": "*i64", "dst_ptr": "*i64"},
            {"PAGE_ELEMS": PAGE * HKV * D, "BLOCK": 4096},
            4,
        ),
    }
    kernels["moe_gemm"] = (
        _expert_gemm_kernel,
        {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "pairs_ptr": "*i32",
         "block_expert_ptr": "*i32", "routing_ptr": "*bf16"},
        {"ROW_DIV": 8, "APPLY_WEIGHT": True, "COMPUTE_DTYPE": tl.bfloat16,
         "DOT_PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32},
        4,
    )  # fmt: skip
    return kernels


def main(variants: bool = False) -> dict:
    """``variants``: the attention kernels' sliding-window variants (a Gemma 3 local layer)
    and the MoE grouped GEMM, instead of the default set."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"
    kernels = _kernels(windowed=variants)
    chosen = VARIANTS if variants else DEFAULT
    results = {}
    for name in chosen:
        fn, ptrs, consts, num_warps = kernels[name]
        results[name] = compile_one(fn, ptrs, consts, num_warps=num_warps)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main(variants="--variants" in sys.argv[1:])
