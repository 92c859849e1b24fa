"""One GPU call: the recompute path's products straight into a bf16 gradient on cuBLAS (v10 in NOTES.md).

    python3 benchmarks/experiment_cublas.py [--shapes S1 S2 S3 S4] [--out DIR]

Per shape (bf16, random data as tune.py), each variant is checked against an fp32 reference (TF32
off), timed forward+backward (do_bench median) and its peak extra memory measured. Variants, per
setting (64 MiB, the default 256 MiB, chunked whole; S4: the default only):
- ``cublas``: as the package runs (``products.direct``: cuBLAS, reduced-precision reductions off);
- ``triton``: the same products on the package's Triton matmul (the previous runner);
- ``cublas-rpr``: cuBLAS with torch's default flags (reduced-precision reductions allowed).
Liger as the side-by-side peer when installed.

Its results (`results/cublas/experiment_cublas.json`) are of commit 9907ea2, where bf16 folded the
common factor into da so that every product into a gradient went to cuBLAS; that fold repeats one
rounding error on every row (NOTES v10) and is gone. Since then the recompute path's products that
carry the factor run on the Triton matmul in every variant, so ``cublas`` and ``triton`` differ only
where there is no factor and on the chunked path. At S1 the 64 MiB setting is also timed the way the
harness does (``bench.measure``), and one step of it is profiled per kernel. Prints a table last;
writes experiment_cublas.json under --out.
"""

import contextlib
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import fused_linear_cross_entropy, products  # noqa: E402

import bench  # noqa: E402
from experiment_common import MiB, kernel_times, measure, parse_args, problems, write_results  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936),
          "S4": (65536, 4096, 128256)}
DIRECT, GUARD = products.direct, products.full_precision_reductions


def runner(kind):
    """Installs the products runner ``kind`` (see the module docstring)."""
    products.direct, products.full_precision_reductions = DIRECT, GUARD
    if kind == "triton":
        def direct(a, b, out):
            products.matmul(a, b, out, False)
            return out

        products.direct = direct
    elif kind == "cublas-rpr":
        products.full_precision_reductions = contextlib.nullcontext


def main():
    args = parse_args(SHAPES)
    rows, kernels = [], {}
    for shape, (hidden, weight, targets, ref, grads_bytes, step, liger) in problems(SHAPES, args.shapes):
        settings = {"256M": dict(strategy="recompute", chunk_bytes=256 * MiB)}
        if shape != "S4":
            settings["64M"] = dict(strategy="recompute", chunk_bytes=64 * MiB)
            settings["chunked-whole"] = dict(strategy="chunked", chunk_bytes=1 << 50)
        mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=20, rep=100)
        for setting, kwargs in settings.items():
            def fn(hd, wd, kwargs=kwargs):
                return fused_linear_cross_entropy(hd, wd, targets, **kwargs)

            for kind in ("cublas", "triton", "cublas-rpr"):
                runner(kind)
                name = f"{setting}-{kind}"
                try:
                    rows.append(dict(shape=shape, name=name, matmul_ms=mm, **measure(step, fn, ref, grads_bytes)))
                except Exception as exc:
                    rows.append(dict(shape=shape, name=name, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                print(rows[-1], flush=True)
            runner("cublas")
            if shape == "S1" and setting == "64M":
                out = bench.measure(lambda hd, wd, t: fn(hd, wd), hidden, weight, targets, ref_tuple(ref), False)
                rows.append(dict(shape=shape, name="64M-cublas-harness", matmul_ms=mm, ms=out["fwdbwd_ms"],
                                 extra_mib=out["extra_mib"], dx=out["dx_rel"], dw=out["dw_rel"]))
                print(rows[-1], flush=True)
                kernels["S1-64M-cublas"] = kernel_times(lambda: step(fn))
                runner("triton")
                kernels["S1-64M-triton"] = kernel_times(lambda: step(fn))
                runner("cublas")
                print(kernels, flush=True)
        if liger is not None and shape != "S4":
            rows.append(dict(shape=shape, name="liger", matmul_ms=mm, **measure(step, liger, ref, grads_bytes)))
            print(rows[-1], flush=True)
            if shape == "S1":
                out = bench.measure(lambda hd, wd, t: liger(hd, wd), hidden, weight, targets, ref_tuple(ref), False)
                rows.append(dict(shape=shape, name="liger-harness", matmul_ms=mm, ms=out["fwdbwd_ms"],
                                 extra_mib=out["extra_mib"], dx=out["dx_rel"], dw=out["dw_rel"]))
                print(rows[-1], flush=True)
        torch.cuda.empty_cache()

    write_results(args.out, "experiment_cublas.json", rows, kernels=kernels)


def ref_tuple(ref):
    """experiment_common.reference's (loss, dx, dw) as bench.measure takes it (a float loss)."""
    loss, dx, dw = ref
    return loss.item(), dx, dw


if __name__ == "__main__":
    main()
