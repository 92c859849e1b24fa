"""One GPU call: the recompute path's plans at small budgets (v7 in NOTES.md).

    python3 benchmarks/experiments/experiment_borrowed.py [--shapes S1 S2 S3] [--out DIR]

Per shape (bf16, random data as tune.py), each variant is checked against an fp32 reference (TF32
off), timed forward+backward (do_bench median) and its peak extra memory measured (above the inputs
and the gradients). Variants: the planner's choice at 64 / 128 / 256 MiB; the same budgets forced to
the previous plans (two passes; one pass with the N x H accumulator inside the budget) or to the
borrowed accumulator; Liger as the side-by-side peer when installed. Then one profiled step per
kernel of the 64 MiB plan at S1. Prints a table last; writes experiment_borrowed.json under --out.
"""

import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from fused_linear_ce import configs, fused_linear_cross_entropy  # noqa: E402
from fused_linear_ce import plan as planning  # noqa: E402

from experiment_common import MiB, kernel_times, measure, parse_args, problems, write_results  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936)}
PLANNER = planning.plan_passes


def forced(kind):
    """A planner that takes ``kind`` where the real one would choose otherwise."""

    def plan(n, v, h, dtype, chunk_bytes, block_n, block_v, need_rows, need_dw):
        passes = PLANNER(n, v, h, dtype, chunk_bytes, block_n, block_v, need_rows, need_dw)
        budget = configs.chunk_budget(chunk_bytes)
        cols = planning._vocab_cols(budget // dtype.itemsize, n, block_v)
        if kind == "borrowed" and configs.borrows_weight_grad(n, v, dtype):
            return (configs.BackwardPlan(n, cols, True, False, borrowed=True),)
        if kind == "two-pass" and passes[0].borrowed:
            rows = max(block_n, (budget // (v * dtype.itemsize + 4 * h)) // block_n * block_n)
            return (configs.BackwardPlan(rows, v, False, False, True, False),
                    configs.BackwardPlan(n, cols, False, False, False, True))
        return passes

    return plan


def main():
    args = parse_args(SHAPES)
    rows, kernels = [], {}
    for shape, (hidden, weight, targets, ref, grads_bytes, step, liger) in problems(SHAPES, args.shapes):
        n, h, v = SHAPES[shape]
        variants = {}
        for mib in (64, 128, 256):
            for kind in ("planner", "two-pass", "borrowed"):
                def fn(hd, wd, mib=mib):
                    return fused_linear_cross_entropy(hd, wd, targets, chunk_bytes=mib * MiB, strategy="recompute")
                variants[f"{mib}M-{kind}"] = (fn, kind)
        if liger is not None:
            variants["liger"] = (liger, "peer")
        mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=20, rep=100)
        seen = {}
        for name, (fn, kind) in variants.items():
            planning.plan_passes = forced(kind) if kind in ("two-pass", "borrowed") else PLANNER
            if kind != "peer":
                cfg = configs.dlogits_config(torch.bfloat16)
                plan = planning.plan_passes(n, v, h, torch.bfloat16, int(name.split("M")[0]) * MiB, cfg.block_n,
                                           cfg.block_v, True, True)
                key = tuple(plan)
                if key in seen:  # the same plan as an earlier variant: not timed twice
                    rows.append(dict(shape=shape, name=name, same_as=seen[key]))
                    print(rows[-1], flush=True)
                    continue
                seen[key] = name
                desc = " + ".join(f"{p.rows}x{p.cols}{' borrowed' if p.borrowed else ''}"
                                  f"{' acc' if p.dx_accumulator and not p.borrowed else ''}" for p in plan)
            else:
                desc = "peer"
            try:
                rows.append(dict(shape=shape, name=name, plan=desc, matmul_ms=mm, **measure(step, fn, ref, grads_bytes)))
            except Exception as exc:
                rows.append(dict(shape=shape, name=name, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            print(rows[-1], flush=True)
        planning.plan_passes = PLANNER

        if shape == "S1":
            kernels["S1-64M-planner"] = kernel_times(lambda: step(variants["64M-planner"][0]))
            print(kernels, flush=True)
        torch.cuda.empty_cache()

    write_results(args.out, "experiment_borrowed.json", rows, kernels=kernels)

if __name__ == "__main__":
    main()
