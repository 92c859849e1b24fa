"""One GPU call: two programs per SM against one, for the sweep, the dlogits kernel and the chunked sweep.

    python3 benchmarks/experiments/experiment_tiles.py [--run run1|run2] [--shapes S1 S2 S3] [--out DIR]

Before run 1 (commit c0ece1d shipped its result) every logit kernel ran one 128 x 256 (or 256 x 128)
tile with 8 warps and 3 stages: 255 registers a
thread and 144 KB of shared memory, so one program per SM, and a tile's softmax epilogue (and the
dlogits kernel's store of da) runs while that SM's tensor cores idle. A 128 x 128 tile with 4 warps
takes 255 registers x 128 threads and 96 KB (3 stages; ``scripts/registers.py`` compiles them
offline): two programs fit one SM, and one's epilogue can overlap the other's mainloop, at the cost
of more operand traffic per product (two 128-wide operand tiles per 128 x 128 instead of 384 rows per
128 x 256). Per shape (bf16, tune.py's random data), each variant checked against an fp32 reference:
- the evaluation forward with the sweep's variants (``configs._GPU_SWEEP``),
- forward+backward at 64 and 256 MiB with the dlogits kernel's variants (``configs._GPU_DLOGITS``),
  and per-kernel times of one 64 MiB step,
- the chunked path in one chunk with the chunked sweep's variants (``configs._GPU_CHUNKED_SWEEP``),
timed in interleaved rounds (medians). ``--run`` picks the variants (``RUNS``; results in
``results/tiles/``). Prints a table last; writes experiment_tiles_<run>.json under --out.
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from experiment_common import (MiB, interleaved, kernel_times, measured_row, median, package_eval,  # noqa: E402
                               parse_args, problems, write_results)
from fused_linear_ce import configs, fused_linear_cross_entropy  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936)}
SWEEP, DLOGITS, CHUNKED = configs._GPU_SWEEP, configs._GPU_DLOGITS, configs._GPU_CHUNKED_SWEEP
TWO_PER_SM = dict(block_n=128, block_v=128, num_warps=4, num_stages=3, resident=2)
# Run 1: two programs per SM against one (128 x 128 tiles with 4 warps).
RUN1 = dict(
    sweep={
        "base": SWEEP,
        "128x128 w4 s3 x2": replace(SWEEP, **TWO_PER_SM),
        "128x128 w4 s2 x2": replace(SWEEP, **dict(TWO_PER_SM, num_stages=2)),
        "64x256 w4 s2 x2": replace(SWEEP, block_n=64, num_warps=4, num_stages=2, resident=2),
        "64x128 w4 s4 x2": replace(SWEEP, block_n=64, block_v=128, num_warps=4, num_stages=4, resident=2),
    },
    dlogits={
        "base": DLOGITS,
        "128x128 w4 s3": replace(DLOGITS, **TWO_PER_SM),
        "64x256 w4 s2": replace(DLOGITS, block_n=64, num_warps=4, num_stages=2),
        "128x256 w8 s4": replace(DLOGITS, num_stages=4),
        "128x128 w8 s3": replace(DLOGITS, block_v=128),
    },
    chunked={
        "base": CHUNKED,
        "128x128 w4 s2": replace(CHUNKED, block_n=128, num_warps=4, num_stages=2),
        "128x128 w4 s3": replace(CHUNKED, block_n=128, num_warps=4, num_stages=3),
    },
    settings=("64M", "256M"),
)
# Run 2: run 1's winner for the chunked sweep (128 x 128, 4 warps, 3 stages: one program per SM) and
# its neighbours; 128-wide H steps (half the loop trips) for the sweep and the dlogits kernel.
CHUNKED_128 = replace(CHUNKED, block_n=128, num_warps=4, num_stages=3)
RUN2 = dict(
    sweep={
        "base": SWEEP,
        "128x256x128 w8 s2": replace(SWEEP, block_h=128, num_stages=2),
        "256x128 w8 s3": replace(SWEEP, block_n=256, block_v=128),
    },
    dlogits={
        "base": DLOGITS,
        "128x256x128 w8 s2": replace(DLOGITS, block_h=128, num_stages=2),
    },
    chunked={
        "base": CHUNKED,
        "128x128 w4 s3 g16": CHUNKED_128,
        "128x128 w4 s3 g32": replace(CHUNKED_128, group_m=32),
        "128x128 w4 s3 g8": replace(CHUNKED_128, group_m=8),
        "128x128 w4 s4 g16": replace(CHUNKED_128, num_stages=4),
        "128x128x128 w4 s2 g16": replace(CHUNKED_128, block_h=128, num_stages=2),
        "128x128 w8 s3 g16": replace(CHUNKED_128, num_warps=8),
    },
    settings=("64M",),
)
RUNS = {"run1": RUN1, "run2": RUN2}
ROUNDS = 3


def patched(name, cfg, fn):
    """``fn`` run with ``configs.<name>`` set to ``cfg``."""
    def run():
        saved = getattr(configs, name)
        setattr(configs, name, cfg)
        try:
            return fn()
        finally:
            setattr(configs, name, saved)
    return run


def main():
    run_name = "run2"
    if "--run" in sys.argv:  # this script's own option, before the shared ones
        i = sys.argv.index("--run")
        run_name = sys.argv.pop(i + 1)
        sys.argv.pop(i)
    variants = RUNS[run_name]
    sweeps, dlogits_variants, chunked_variants = variants["sweep"], variants["dlogits"], variants["chunked"]
    args = parse_args(SHAPES)
    rows, kernels = [], []
    for shape, (hidden, weight, targets, ref, grads_bytes, step, _liger) in problems(SHAPES, args.shapes):
        mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=20, rep=200)
        rows.append(dict(shape=shape, name="matmul", ms=mm, matmul_ms=mm))
        base_losses = package_eval(hidden, weight, targets)()

        runs, labels = {}, {}
        for name, cfg in sweeps.items():
            run = patched("_GPU_SWEEP", cfg, package_eval(hidden, weight, targets))
            try:
                err = ((run() - base_losses).abs().max() / base_losses.abs().max()).item()
                assert err < 1e-5, f"per-row losses differ from the base sweep's: {err:.1e}"
            except Exception as exc:
                rows.append(dict(shape=shape, name=f"eval {name}", error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                print(rows[-1], flush=True)
                continue
            runs[f"eval {name}"], labels[f"eval {name}"] = run, dict(err=err)

        def fwdbwd(table, setting, **kwargs):
            for name, cfg in table.items():
                def fn(hd, wd, kwargs=kwargs):
                    return fused_linear_cross_entropy(hd, wd, targets, **kwargs)
                key = f"{setting} {name}"
                var = {"dlogits": "_GPU_DLOGITS", "chunked": "_GPU_CHUNKED_SWEEP"}[setting.split("-")[0]]
                row = patched(var, cfg, lambda fn=fn, key=key: measured_row(step, fn, ref, grads_bytes, name=key))()
                if "error" in row:
                    rows.append(dict(row, shape=shape))
                    print(rows[-1], flush=True)
                    continue
                labels[key] = {k: row[k] for k in ("dx", "dw", "loss", "extra_mib")}
                runs[key] = patched(var, cfg, lambda fn=fn: step(fn))

        for setting in variants["settings"]:
            fwdbwd(dlogits_variants, f"dlogits-{setting}", chunk_bytes=int(setting[:-1]) * MiB, strategy="recompute")
        fwdbwd(chunked_variants, "chunked-whole", chunk_bytes=1 << 50, strategy="chunked")
        fwdbwd(chunked_variants, "chunked-1G", chunk_bytes=1 << 30, strategy="chunked")
        times = interleaved(runs, rounds=ROUNDS, rep=400)
        for key, ts in times.items():
            rows.append(dict(shape=shape, name=key, ms=median(ts), rounds=ts, matmul_ms=mm, **labels[key]))
            print(rows[-1], flush=True)
        for name, cfg in dlogits_variants.items():
            key = f"dlogits-64M {name}"
            if key in runs:
                t = kernel_times(runs[key], top=6)
                kernels.append(dict(shape=shape, name=key, kernels=t))
                print(key, ", ".join(f"{k} {v:.2f}" for k, v in t.items()), flush=True)
        runs.clear()
        torch.cuda.empty_cache()
    write_results(args.out, f"experiment_tiles_{run_name}.json", rows, kernels=kernels,
                  variants=dict(sweep={k: repr(v) for k, v in sweeps.items()},
                                dlogits={k: repr(v) for k, v in dlogits_variants.items()},
                                chunked={k: repr(v) for k, v in chunked_variants.items()}))


if __name__ == "__main__":
    main()
