#!/usr/bin/env python3
"""Compiles the package's hot kernels for an H100/H200 (sm_90) without a GPU and reports, per shipped
configuration, registers per thread, stack bytes (register spills) and shared memory.

Triton compiles for any target offline (``triton.compile`` of an ``ASTSource``; its wheel carries
ptxas and cuobjdump), so register pressure can be read on a machine without a GPU. NOTES v12: the
sweep spilled 96 bytes, the dlogits kernel 304 and the chunked sweep 1616 before their epilogues
were slimmed; ``tests/kernel/test_registers.py`` keeps them at (nearly) none.

Usage:
    python3 scripts/registers.py            # a table
    python3 scripts/registers.py --json     # one JSON list on stdout
    python3 scripts/registers.py --matmul 128,256,64,8,8,3 128,128,64,8,4,3   # matmul candidates
    python3 scripts/registers.py --unaligned  # without the divisibility hints a launch at real shapes gets

Runs the compiler, not the interpreter: TRITON_INTERPRET must be unset (this script refuses otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "torch-ext"))

# Non-constexpr arguments by name: fp32 / int pointers; every other pointer is the input dtype (bf16).
_FP32_PTRS = {"stats_ptr", "lse_ptr", "coef_ptr", "class_weight_ptr", "dbias_ptr", "scale_ptr", "tile_max_ptr",
              "z_target_ptr"}
_INT_PTRS = {"targets_ptr": "*i64", "argmax_ptr": "*i32"}
_FLOATS = {"logit_scale", "softcap", "softcap_out", "grad_scale", "scale"}


@dataclass(frozen=True)
class Case:
    name: str
    kernel: str  # attribute of fused_linear_ce.<module>
    module: str
    constexprs: dict
    descriptors: dict  # argument name -> block shape
    num_warps: int
    num_stages: int
    c_dtype: str = "*bf16"  # matmul_kernel's c_ptr
    lo_dtype: str = "bf16"  # matmul_kernel's lo_ptr / lo_desc element, used when COMPENSATED
    # Every pointer and integer argument marked divisible by 16, as a launch at the package's shapes
    # specialises them (16-byte aligned buffers; N, H, V, strides and offsets multiples of 16). Without
    # the hints a pointer kernel compiles for unaligned accesses: the chunked gradient kernel with 32
    # registers and 4.5-6 KB of stack, where a real launch gets no spill.
    divisible: bool = True
    # Integer arguments that are 1 at the launch (Triton specialises a 1 into a constant): the chunked
    # buffer's class stride, or its row stride where the buffer is class-major (hosted in grad_weight).
    unit_strides: tuple = ("stride_ev",)


def cases() -> list[Case]:
    from fused_linear_ce import configs

    sweep, chunked, mm = configs._GPU_SWEEP, configs._GPU_CHUNKED_SWEEP, configs._GPU_MATMUL
    small = configs._GPU_CHUNKED_SWEEP_SMALL_H
    pr = configs._GPU_MATMUL_PAIRED_ROWS
    dlogits = configs._GPU_DLOGITS
    logit = dict(HAS_BIAS=False, HAS_SOFTCAP=False, BLOCK_H=sweep.block_h, EVEN_H=True, BF16_EMULATION=False,
                 INPUT_PRECISION="tf32", TMA=True)
    forward = dict(logit, METRICS=False, SMOOTHING=False, SQUARES=False, HAS_CLASS_WEIGHT=False, BLOCK_N=sweep.block_n,
                   BLOCK_V=sweep.block_v, EVEN_V=True, STORE_E=False, E_TMA=False, E_T=False, GROUP_M=0,
                   SKIP_IGNORED=True)
    descs = dict(hidden_desc=(sweep.block_n, sweep.block_h), weight_desc=(sweep.block_v, sweep.block_h))
    backward = dict(logit, SMOOTHING=False, ENTROPY_GRAD=False, HAS_CLASS_WEIGHT=False, BLOCK_N=dlogits.block_n, BLOCK_V=dlogits.block_v,
                    BLOCK_H=dlogits.block_h, GROUP_M=dlogits.group_m)
    dlogits_descs = dict(hidden_desc=(dlogits.block_n, dlogits.block_h), weight_desc=(dlogits.block_v, dlogits.block_h))
    matmul = dict(ACCUMULATE=False, HAS_SCALE=True, BLOCK_M=mm.block_m, BLOCK_P=mm.block_p, BLOCK_K=mm.block_k,
                  GROUP_M=mm.group_m, EVEN_M=True, EVEN_P=True, EVEN_K=True, BF16_EMULATION=False,
                  INPUT_PRECISION="tf32", TMA=True, B_T=False, COMPENSATED=False, C_TMA=mm.c_tma, SPLIT_PAIR=False,
                  SPLIT_K=1)
    # A plain contiguous result through a descriptor where the shipped config says (``c_tma``); a
    # strided one always through pointers ("matmul, pointers").
    c_desc = dict(c_desc=(mm.block_m, mm.block_p), lo_desc=(mm.block_m, mm.block_p)) if mm.c_tma else {}

    def pair(name, cfg, A_T, lo_dtype="bf16"):
        """A product summed into a compensated pair (through descriptors) at ``cfg``, its epilogue on
        column halves where ``cfg.split_pair`` says, as ``gemm.matmul`` launches it."""
        c_block = (cfg.block_m, cfg.block_p // 2 if cfg.split_pair else cfg.block_p)
        lo_block = (c_block[0], c_block[1] // 2) if lo_dtype == "u8" else c_block  # 4-bit: two a byte
        a_desc = (cfg.block_k, cfg.block_m) if A_T else (cfg.block_m, cfg.block_k)
        return Case(name, "matmul_kernel", "gemm",
                    dict(matmul, BLOCK_M=cfg.block_m, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                         A_T=A_T, ACCUMULATE=True, COMPENSATED=True, C_TMA=True, SPLIT_PAIR=cfg.split_pair),
                    dict(a_desc=a_desc, b_desc=(cfg.block_k, cfg.block_p), c_desc=c_block, lo_desc=lo_block),
                    cfg.num_warps, cfg.num_stages, lo_dtype=lo_dtype)

    def gradient(name, entropy_grad, bias_grad, rows=None, warps=None, class_major=False):
        """The chunked path's in-place gradient kernel (pointer loads) as ``chunked.gradient_in_place``
        launches it: the sweep's vocabulary tiles, ``gradient_rows`` / ``gradient_warps`` unless given."""
        from fused_linear_ce import chunked as chunked_module

        rows = rows or chunked_module.gradient_rows(chunked, entropy_grad)
        warps = warps or chunked_module.gradient_warps(chunked, entropy_grad)  # never interpreted here
        return Case(name, "softmax_gradient_kernel", "chunked",
                    dict(HAS_SOFTCAP=False, SMOOTHING=False, ENTROPY_GRAD=entropy_grad, HAS_CLASS_WEIGHT=False,
                         BIAS_GRAD=bias_grad, BLOCK_N=rows, BLOCK_V=chunked_module.gradient_cols(chunked),
                         STATS_V=chunked.block_v, BF16_EMULATION=False),
                    {}, warps, 1, unit_strides=("stride_e",) if class_major else ("stride_ev",))

    def chunked_sweep(name, cfg=chunked, **extra):
        """The chunked path's sweep (STORE_E, its exponentials through a descriptor, over the buffer's
        transpose with E_T) at ``cfg``'s tiles on a ragged V, as ``sweep._triton_sweep`` launches it."""
        e_block = (cfg.block_v, cfg.block_n) if extra.get("E_T") else (cfg.block_n, cfg.block_v)
        return Case(name, "lse_sweep_kernel", "sweep_kernels",
                    dict(forward, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, EVEN_V=False,
                         STORE_E=True, E_TMA=True, GROUP_M=cfg.group_m, **extra),
                    dict(hidden_desc=(cfg.block_n, cfg.block_h), weight_desc=(cfg.block_v, cfg.block_h),
                         e_desc=e_block), cfg.num_warps, cfg.num_stages,
                    unit_strides=("stride_e",) if extra.get("E_T") else ("stride_ev",))

    return [
        Case("sweep", "lse_sweep_kernel", "sweep_kernels", forward, descs, sweep.num_warps, sweep.num_stages),
        Case("sweep, ragged V", "lse_sweep_kernel", "sweep_kernels", dict(forward, EVEN_V=False), descs,
             sweep.num_warps, sweep.num_stages),
        Case("sweep, metrics", "lse_sweep_kernel", "sweep_kernels", dict(forward, METRICS=True), descs,
             sweep.num_warps, sweep.num_stages),
        Case("sweep, metrics, ragged V", "lse_sweep_kernel", "sweep_kernels",
             dict(forward, METRICS=True, EVEN_V=False), descs, sweep.num_warps, sweep.num_stages),
        chunked_sweep("chunked sweep"),
        chunked_sweep("chunked sweep, class-major", E_T=True),
        chunked_sweep("chunked sweep, H <= 1024", cfg=small),
        chunked_sweep("chunked sweep, metrics", METRICS=True),
        chunked_sweep("chunked sweep, softcap and bias", HAS_SOFTCAP=True, HAS_BIAS=True),
        Case("sweep, every per-token field", "lse_sweep_kernel", "sweep_kernels",
             dict(forward, METRICS=True, SMOOTHING=True, SQUARES=True, EVEN_V=False), descs,
             sweep.num_warps, sweep.num_stages),
        Case("dlogits", "dlogits_kernel", "recompute", dict(backward, HAS_BIAS=False, BIAS_GRAD=False),
             dlogits_descs, dlogits.num_warps, dlogits.num_stages),
        Case("dlogits, bias gradient", "dlogits_kernel", "recompute",
             dict(backward, HAS_BIAS=True, BIAS_GRAD=True), dlogits_descs, dlogits.num_warps, dlogits.num_stages),
        Case("dlogits, entropy gradient", "dlogits_kernel", "recompute", dict(backward, ENTROPY_GRAD=True,
             HAS_BIAS=False, BIAS_GRAD=False), dlogits_descs, dlogits.num_warps, dlogits.num_stages),
        Case("matmul, da^T", "matmul_kernel", "gemm", dict(matmul, A_T=True),
             dict(a_desc=(mm.block_k, mm.block_m), b_desc=(mm.block_k, mm.block_p), **c_desc), mm.num_warps,
             mm.num_stages),
        Case("matmul", "matmul_kernel", "gemm", dict(matmul, A_T=False),
             dict(a_desc=(mm.block_m, mm.block_k), b_desc=(mm.block_k, mm.block_p), **c_desc), mm.num_warps,
             mm.num_stages),
        Case("matmul, da^T, fp32 sum", "matmul_kernel", "gemm", dict(matmul, A_T=True, ACCUMULATE=True),
             dict(a_desc=(mm.block_k, mm.block_m), b_desc=(mm.block_k, mm.block_p), **c_desc), mm.num_warps,
             mm.num_stages, c_dtype="*fp32"),
        Case("matmul, pointers", "matmul_kernel", "gemm", dict(matmul, A_T=False, C_TMA=False),
             dict(a_desc=(mm.block_m, mm.block_k), b_desc=(mm.block_k, mm.block_p)), mm.num_warps, mm.num_stages),
        # grad_hidden's K reduction in two halves added into fp32 by atomics (``gemm.split_k``)
        Case("matmul, split K", "matmul_kernel", "gemm",
             dict(matmul, A_T=False, C_TMA=True, HAS_SCALE=False, SPLIT_K=2),
             dict(a_desc=(mm.block_m, mm.block_k), b_desc=(mm.block_k, mm.block_p),
                  c_desc=(mm.block_m, mm.block_p // 2)), mm.num_warps, mm.num_stages, c_dtype="*fp32"),
        pair("matmul, da^T, compensated", mm, A_T=True),
        pair("matmul, da^T, compensated int8", mm, A_T=True, lo_dtype="i8"),
        pair("matmul, da^T, compensated 4-bit", mm, A_T=True, lo_dtype="u8"),
        pair("matmul, compensated int8", mm, A_T=False, lo_dtype="i8"),
        pair("matmul, paired rows", pr, A_T=False, lo_dtype="i8"),
        pair("matmul, compensated int8, unsplit", dataclasses.replace(mm, split_pair=False), A_T=False, lo_dtype="i8"),
        gradient("chunked gradient", entropy_grad=False, bias_grad=False),
        gradient("chunked gradient, class-major", entropy_grad=False, bias_grad=False, class_major=True),
        gradient("chunked gradient, class-major, bias gradient", entropy_grad=False, bias_grad=True, class_major=True),
        gradient("chunked gradient, bias gradient", entropy_grad=False, bias_grad=True),
        gradient("chunked gradient, entropy gradient", entropy_grad=True, bias_grad=False),
        gradient("chunked gradient, entropy and bias gradients", entropy_grad=True, bias_grad=True),
        gradient("chunked gradient, entropy gradient, the sweep's rows", entropy_grad=True, bias_grad=False,
                 rows=chunked.block_n, warps=8),
        Case("matmul, da^T, compensated, pointers", "matmul_kernel", "gemm",
             dict(matmul, A_T=True, ACCUMULATE=True, COMPENSATED=True, C_TMA=False),
             dict(a_desc=(mm.block_k, mm.block_m), b_desc=(mm.block_k, mm.block_p)), mm.num_warps, mm.num_stages),
    ]


# The matmul's uses, for ``--matmul``: (constexprs, A read through its transpose, c's and lo's dtypes).
_MATMUL_USES = {
    "plain": (dict(A_T=False), False, "*bf16", "bf16"),
    "da^T": (dict(A_T=True), True, "*bf16", "bf16"),
    "da^T, fp32 sum": (dict(A_T=True, ACCUMULATE=True), True, "*fp32", "bf16"),
    "plain, C_TMA": (dict(A_T=False, C_TMA=True), False, "*bf16", "bf16"),
    "da^T, C_TMA": (dict(A_T=True, C_TMA=True), True, "*bf16", "bf16"),
    "da^T, fp32 sum, C_TMA": (dict(A_T=True, ACCUMULATE=True, C_TMA=True), True, "*fp32", "bf16"),
    "da^T, compensated int8": (dict(A_T=True, ACCUMULATE=True, COMPENSATED=True, C_TMA=True), True, "*bf16", "i8"),
    "compensated int8": (dict(A_T=False, ACCUMULATE=True, COMPENSATED=True, C_TMA=True), False, "*bf16", "i8"),
    "da^T, compensated int8, split": (dict(A_T=True, ACCUMULATE=True, COMPENSATED=True, C_TMA=True, SPLIT_PAIR=True),
                                      True, "*bf16", "i8"),
    "compensated int8, split": (dict(A_T=False, ACCUMULATE=True, COMPENSATED=True, C_TMA=True, SPLIT_PAIR=True),
                                False, "*bf16", "i8"),
}


def matmul_cases(spec: str) -> list[Case]:
    """The matmul's uses (``_MATMUL_USES``) at a candidate config
    ``block_m,block_p,block_k,group_m,num_warps,num_stages`` (``experiment_matmul_configs.py``)."""
    bm, bp, bk, gm, warps, stages = (int(x) for x in spec.split(","))
    base = dict(ACCUMULATE=False, HAS_SCALE=True, BLOCK_M=bm, BLOCK_P=bp, BLOCK_K=bk, GROUP_M=gm, EVEN_M=True,
                EVEN_P=True, EVEN_K=True, BF16_EMULATION=False, INPUT_PRECISION="tf32", TMA=True, B_T=False,
                COMPENSATED=False, C_TMA=False, SPLIT_PAIR=False, SPLIT_K=1)
    out = []
    for use, (extra, a_t, c_dtype, lo_dtype) in _MATMUL_USES.items():
        descs = dict(a_desc=(bk, bm) if a_t else (bm, bk), b_desc=(bk, bp))
        c_block = (bm, bp // 2 if extra.get("SPLIT_PAIR") else bp)
        if extra.get("C_TMA"):
            descs.update(c_desc=c_block)
        if extra.get("COMPENSATED"):
            descs.update(lo_desc=c_block)
        out.append(Case(f"matmul {bm}x{bp}x{bk} w{warps} s{stages}, {use}", "matmul_kernel", "gemm",
                        dict(base, **extra), descs, warps, stages, c_dtype=c_dtype, lo_dtype=lo_dtype))
    return out


def pingpong_cases() -> list[Case]:
    """The Hopper ping-pong sweep (``pingpong.py``, Gluon) at its shipped config, where this Triton
    has Gluon: skipping wholly ignored row blocks (the per-token default) and not (a returned lse)."""
    from fused_linear_ce import configs, pingpong

    if not pingpong.HAVE_GLUON:
        return []
    cfg = configs.pingpong(2048)
    descs = {"h_desc": [cfg.block_n, cfg.block_k], "w_desc": [cfg.block_v, cfg.block_k]}
    base = dict(STAGES=cfg.stages, SKIP_IGNORED=True, CONSUMER_REGS=cfg.consumer_regs,
                LOADER_REGS=cfg.loader_regs, num_warps=4)
    base = dict(base, METRICS=False)
    return [Case("pingpong sweep", "pingpong_sweep_kernel", "pingpong", base, descs, 4, 1),
            Case("pingpong sweep, metrics", "pingpong_sweep_kernel", "pingpong", dict(base, METRICS=True), descs, 4, 1),
            Case("pingpong sweep, every block", "pingpong_sweep_kernel", "pingpong", dict(base, SKIP_IGNORED=False),
                 descs, 4, 1)]


def _gluon_descriptor_type(shape) -> str:
    """The signature string of a Gluon tensor descriptor of ``shape`` blocks (bf16)."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)
    desc = TensorDescriptor.from_tensor(torch.empty(512, 512, dtype=torch.bfloat16), shape, layout)
    return native_specialize_impl(BaseBackend, desc, False, True, True)[0]


def _signature(fn, case: Case) -> dict:
    sig = {}
    for arg in fn.arg_names:
        if arg in case.constexprs:
            sig[arg] = "constexpr"
        elif arg in case.descriptors and case.module == "pingpong":
            sig[arg] = _gluon_descriptor_type(case.descriptors[arg])
        elif arg in case.descriptors:
            rows, cols = case.descriptors[arg]
            elem = case.lo_dtype if arg == "lo_desc" else case.c_dtype[1:] if arg == "c_desc" else "bf16"
            sig[arg] = f"tensordesc<{elem}[{rows}, {cols}]>"
        elif arg.endswith("_desc"):  # a descriptor argument this configuration leaves unused
            sig[arg] = "*bf16"
        elif arg == "c_ptr":
            sig[arg] = case.c_dtype
        elif arg == "lo_ptr":
            sig[arg] = f"*{case.lo_dtype}"
        elif arg in _FP32_PTRS:
            sig[arg] = "*fp32"
        elif arg in _INT_PTRS:
            sig[arg] = _INT_PTRS[arg]
        elif arg.endswith("_ptr"):
            sig[arg] = "*bf16"
        elif arg in _FLOATS:
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
    return sig


def compile_case(case: Case, workdir: Path) -> dict:
    """{name, registers, stack, shared} of ``case`` compiled for sm_90."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fused_linear_ce import configs

    fn = getattr(importlib.import_module(f"fused_linear_ce.{case.module}"), case.kernel)
    # A launch specialises an integer argument of 1 into a constant: the buffers' unit strides.
    units = {arg: 1 for arg in case.unit_strides if arg in fn.arg_names}
    case = dataclasses.replace(case, constexprs={**units, **case.constexprs})
    signature = _signature(fn, case)
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
             if case.divisible and (signature[arg].startswith("*") or signature[arg] == "i32")}
    if case.module == "pingpong":  # Gluon: its own source type; no fp-fusion option (explicit layouts)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn=fn, signature=signature, attrs=attrs,
                             constexprs={(fn.arg_names.index(k),): v for k, v in case.constexprs.items()})
        options = dict(num_warps=case.num_warps)
    else:
        src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                        constexprs={(fn.arg_names.index(k),): v for k, v in case.constexprs.items()})
        options = dict(num_warps=case.num_warps, num_stages=case.num_stages,
                       enable_fp_fusion=configs.fp_fusion(None))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=options)
    cubin = workdir / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    return dict(name=case.name, registers=int(fields["REG"]), stack=int(fields["STACK"]),
                shared=int(compiled.metadata.shared))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--matmul", nargs="+", metavar="BM,BP,BK,GM,WARPS,STAGES",
                    help="instead of the shipped kernels: the matmul's uses at these candidate configs")
    ap.add_argument("--unaligned", action="store_true",
                    help="no divisibility hints (a launch with unaligned buffers or sizes that are not multiples of 16)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("registers.py compiles for sm_90: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        chosen = [c for spec in args.matmul for c in matmul_cases(spec)] if args.matmul else cases() + pingpong_cases()
        if args.unaligned:
            chosen = [dataclasses.replace(c, divisible=False) for c in chosen]
        rows = [compile_case(case, Path(tmp)) for case in chosen]
    if args.json:
        print(json.dumps(rows))
    else:
        width = max(len(r["name"]) for r in rows)
        print(f"{'kernel (sm_90)':{width}s} {'registers':>9s} {'stack B':>8s} {'shared KB':>9s}")
        for r in rows:
            print(f"{r['name']:{width}s} {r['registers']:9d} {r['stack']:8d} {r['shared'] / 1024:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
