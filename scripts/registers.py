#!/usr/bin/env python3
"""Compiles every configuration the package can launch on a GPU target (sm_90 unless ``--arch``: a
CUDA sm number or an AMD gfx name) without a GPU and reports, per configuration, registers per
thread, stack bytes (register spills) and shared memory, or the compile error.

Triton compiles for any target offline (``triton.compile`` of an ``ASTSource``; its wheel carries
ptxas and cuobjdump, and the AMD backend), so register pressure can be read on a machine without a
GPU. NOTES v12: the sweep spilled 96 bytes, the dlogits kernel 304 and the chunked sweep 1616 before
their epilogues were slimmed; ``tests/kernel/test_registers.py`` keeps them at (nearly) none.

Each target compiles its family's tables (the record in ``archs.py`` that declares it), with TMA
tensor descriptors where the family has them (``archs.Arch.tma``; elsewhere the same kernels with
pointer loads and stores, as a launch there builds them) and the dot precision a launch there passes
(``device.input_precision``). On AMD (``GPUTarget("hip", gfx, wave)``) the figures come from the
amdgcn metadata: ``registers`` the VGPRs a lane, ``agprs`` the accumulation registers,
``vgpr_spills`` / ``sgpr_spills`` the registers spilled, ``stack`` the scratch bytes a lane, ``shared``
the LDS a workgroup.

Usage:
    python3 scripts/registers.py            # a table (sm_90)
    python3 scripts/registers.py --arch 80 --json   # one JSON list on stdout, for an A100
    python3 scripts/registers.py --arch gfx942      # an MI300X
    python3 scripts/registers.py --matmul 128,256,64,8,8,3 128,128,64,8,4,3   # matmul candidates
    python3 scripts/registers.py --unaligned  # without the divisibility hints a launch at real shapes gets

Runs the compiler, not the interpreter: TRITON_INTERPRET must be unset (this script refuses otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "torch-ext"))

# Case: tests build their own (test_divergence_plan.py)
from register_cases import Case, arch_of, cases, matmul_cases, pingpong_cases  # noqa: E402

# Non-constexpr arguments by name: fp32 / int pointers; every other pointer is the input dtype (bf16).
_FP32_PTRS = {"stats_ptr", "lse_ptr", "coef_ptr", "class_weight_ptr", "dbias_ptr", "scale_ptr", "tile_max_ptr",
              "z_target_ptr", "zs_ptr", "zt_ptr", "out_ptr"}
_INT_PTRS = {"targets_ptr": "*i64", "argmax_ptr": "*i32", "counted_ptr": "*i8"}
_FLOATS = {"logit_scale", "softcap", "softcap_out", "grad_scale", "scale", "scale_s", "cap_s", "cap_out_s", "chain_s",
           "scale_t", "cap_t", "cap_out_t", "beta", "alpha", "log_a", "log_b"}


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
            elem = case.lo_dtype if arg == "lo_desc" else case.c_dtype[1:] if arg == "c_desc" else case.dtype
            sig[arg] = f"tensordesc<{elem}[{rows}, {cols}]>"
        elif arg.endswith("_desc"):  # a descriptor argument this configuration leaves unused (or a pointer)
            sig[arg] = f"*{case.dtype}"
        elif arg == "c_ptr":
            sig[arg] = case.c_dtype
        elif arg == "lo_ptr":
            sig[arg] = f"*{case.lo_dtype}"
        elif arg in _FP32_PTRS:
            sig[arg] = "*fp32"
        elif arg in _INT_PTRS:
            sig[arg] = _INT_PTRS[arg]
        elif arg.endswith("_ptr"):
            sig[arg] = f"*{case.dtype}"
        elif arg in _FLOATS:
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
    return sig


def case_key(case: Case) -> str:
    """What the compile of ``case`` depends on: cases with one key compile once (``compile_all``)."""
    return json.dumps([case.kernel, case.module, sorted(case.constexprs.items()), sorted(case.descriptors.items()),
                       case.num_warps, case.num_stages, case.c_dtype, case.lo_dtype, case.divisible,
                       list(case.unit_strides), case.dtype], default=str)


def config_text(case: Case) -> str:
    """The launch parameters of ``case`` that a table sets: block sizes, warps, stages."""
    blocks = " ".join(f"{k}={v}" for k, v in sorted(case.constexprs.items()) if k.startswith("BLOCK_"))
    return f"{blocks} warps={case.num_warps} stages={case.num_stages}"


def compile_all(chosen: list[Case], target: str) -> list[dict]:
    """``compile_case`` of each case for ``target``, each distinct configuration compiled once; a
    compile error becomes the row's ``error``."""
    import tempfile

    done: dict[str, dict] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in chosen:
            key = case_key(case)
            if key not in done:
                try:
                    done[key] = compile_case(case, Path(tmp), target)
                except Exception as exc:  # reported per configuration: the matrix says which fail and why
                    lines = [line for line in str(exc).splitlines() if line.strip()]
                    done[key] = dict(error=f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300])
            rows.append(dict(name=case.name, arch=target, config=config_text(case), **done[key]))
    return rows


def unit_strides(case: Case) -> tuple:
    """The strides that are 1 at every launch at the package's layouts (contiguous rows of hidden,
    weight, bias and targets; the matmul's operands as ``gemm.matmul`` gets them: da, or da^T read by
    columns, times hidden or weight, into a contiguous result), which Triton specialises: the pointer
    loads below sm_90 vectorise on them (without, 16-bit loads one element at a time, and 4-5 KB of
    stack on sm_80)."""
    if case.kernel in ("lse_sweep_kernel", "dlogits_kernel"):
        return ("stride_hh", "stride_wh", "stride_b", "stride_t")
    if case.kernel == "matmul_kernel":
        return ("stride_am" if case.constexprs.get("A_T") else "stride_ak", "stride_bp", "stride_cp")
    return ("stride_t",)


def compile_case(case: Case, workdir: Path, target: str | int = "90") -> dict:
    """{registers, stack, shared} of ``case`` compiled for ``target`` (a CUDA sm number or a gfx
    name; ``amd_usage`` adds AMD's own figures)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fused_linear_ce import configs

    arch = arch_of(str(target))
    fn = getattr(importlib.import_module(f"fused_linear_ce.{case.module}"), case.kernel)
    # A launch specialises an integer argument of 1 into a constant: the buffers' unit strides.
    units = {arg: 1 for arg in case.unit_strides + unit_strides(case) if arg in fn.arg_names}
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
    if arch.backend == "rocm":
        compiled = triton.compile(src, target=GPUTarget("hip", str(target), arch.wave), options=options)
        return amd_usage(compiled)
    compiled = triton.compile(src, target=GPUTarget("cuda", int(target), 32), options=options)
    cubin = workdir / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    return dict(registers=int(fields["REG"]), stack=int(fields["STACK"]), shared=int(compiled.metadata.shared))


def amd_usage(compiled) -> dict:
    """An AMD compile's figures from the ``.amdgpu_metadata`` block of its amdgcn: VGPRs
    (``registers``), AGPRs, VGPRs spilled to scratch, SGPRs spilled (into VGPR lanes, no scratch),
    scratch bytes a lane (``stack``), and the LDS the kernel takes (``shared``: Triton's plan,
    launched as dynamic LDS, plus any static)."""
    asm = compiled.asm["amdgcn"]

    def field(key):
        found = re.findall(rf"\.{key}:\s+(\d+)", asm)
        return int(found[0]) if found else 0

    return dict(registers=field("vgpr_count"), agprs=field("agpr_count"), vgpr_spills=field("vgpr_spill_count"),
                sgpr_spills=field("sgpr_spill_count"), stack=field("private_segment_fixed_size"),
                shared=int(compiled.metadata.shared) + field("group_segment_fixed_size"))


def matrix_targets(backend: str) -> tuple:
    """The targets the portability matrix (tests/kernel/test_arch_matrix.py) compiles for ``backend``:
    each family's ``matrix`` targets (every CUDA one metadata.json declares), CUDA's as sm numbers."""
    from fused_linear_ce import archs

    if backend == "cuda":
        return tuple(t.replace(".", "") for arch in archs.of_backend("cuda") for t in arch.matrix)
    return tuple(t for arch in archs.of_backend("rocm") for t in arch.matrix)


def arch_rows(job) -> list[dict]:
    """The rows of one target: ``job`` is (target, tables, matmul specs or None, unaligned)."""
    target, tables, matmul, unaligned = job
    if matmul:
        chosen = [c for spec in matmul for c in matmul_cases(spec, target)]
    else:
        arch = arch_of(target)
        chosen = cases(target, tables) + (pingpong_cases() if arch.pingpong and arch.backend == "cuda" else [])
    if unaligned:
        chosen = [dataclasses.replace(c, divisible=False) for c in chosen]
    return compile_all(chosen, target)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--arch", nargs="+", default=["90"], metavar="TARGET",
                    help="compile for a CUDA sm number or an AMD gfx name, one or more (the matrix: "
                    f"{', '.join(matrix_targets('cuda') + matrix_targets('rocm'))}); default 90")
    ap.add_argument("--tables", metavar="FAMILY", help="compile this family's tables (archs.ARCHS) instead of "
                    "the target's own, e.g. --arch 80 --tables sm90 for what sm_90's would do there")
    ap.add_argument("--matmul", nargs="+", metavar="BM,BP,BK,GM,WARPS,STAGES",
                    help="instead of the shipped kernels: the matmul's uses at these candidate configs")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="architectures compiled in parallel, one process each (default: the CPU count)")
    ap.add_argument("--unaligned", action="store_true",
                    help="no divisibility hints (a launch with unaligned buffers or sizes that are not multiples of 16)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("registers.py compiles for a GPU target: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    jobs = [(arch, args.tables, args.matmul, args.unaligned) for arch in args.arch]
    if args.jobs > 1 and len(jobs) > 1:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(min(args.jobs, len(jobs)),
                                                    mp_context=multiprocessing.get_context("spawn")) as pool:
            rows = [row for part in pool.map(arch_rows, jobs) for row in part]
    else:
        rows = [row for job in jobs for row in arch_rows(job)]
    if args.json:
        print(json.dumps(rows))
        return 0
    width = max(len(r["name"]) for r in rows)
    for arch in args.arch:
        label = arch if arch.startswith("gfx") else f"sm_{arch}"
        print(f"{f'kernel ({label})':{width}s} {'registers':>9s} {'stack B':>8s} {'shared KB':>9s}  config")
        for r in (r for r in rows if r["arch"] == arch):
            if "error" in r:
                print(f"{r['name']:{width}s} {r['error']}")
            else:
                print(f"{r['name']:{width}s} {r['registers']:9d} {r['stack']:8d} {r['shared'] / 1024:9.1f}  {r['config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
